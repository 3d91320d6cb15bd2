"""Trainer checkpoints (``save_strategy``) and ``resume_from_checkpoint`` on layouts that shard
the optimizer state.

transformers writes a checkpoint's optimizer state as process 0 holds it
(``torch.save(optimizer.state_dict())`` into ``optimizer.pt``). Under DDP every process holds
all of it, and the bridge leaves transformers' own files as they are. Under ZeRO 1-3, tp, cp,
ep and CPU or disk offload a process holds only its share (ZeRO-1's partitions, FSDP2's
shards, tp's slices, state on disk), so that file would lack the others' shares. There the
bridge writes the optimizer state with meshfit's own `Accelerator.save_state`, a sharded DCP
checkpoint (each process writes its shares; committed atomically with a manifest, checked
on reading), in the folder `FOLDER` inside transformers' ``checkpoint-<step>``, and reads it
back with `Accelerator.load_state` (the model's weights, the optimizer state, the
Accelerator's step counters and every process's random generators, exactly).

The rest of the folder stays transformers': the whole model (``model.safetensors``, gathered
from the shards, `OnMeshfit._save`; loaded before the model is laid out, as transformers does
for DDP), ``scheduler.pt``, ``scaler.pt``, ``rng_state_<rank>.pth`` and
``trainer_state.json``, so rotation (``save_total_limit`` deletes whole ``checkpoint-<step>``
folders) and ``resume_from_checkpoint=True`` (the highest ``checkpoint-<step>``) work
unchanged.
"""

from __future__ import annotations

import os
import warnings

import torch
import transformers.trainer as hf_trainer

__all__ = ["FOLDER", "check", "load", "load_best", "save", "shards_the_optimizer"]

FOLDER = "optimizer_meshfit"
"""The DCP checkpoint's folder in ``checkpoint-<step>``. "optimizer" in the name: transformers'
own Trainer, asked to resume such a checkpoint, then looks for ``optimizer.pt`` and stops
(FileNotFoundError) instead of training on without the optimizer state."""


def shards_the_optimizer(layout) -> bool:
    """Whether a process of `layout` holds only a share of the optimizer state (every layout
    but plain DDP)."""
    dims = layout.dims
    return not (layout.zero_stage == 0 and dims.tp == dims.cp == dims.ep == dims.pp == 1
                and layout.request.offload == "none")


def check(args, layout) -> None:
    """Refuse, before anything is written, ``load_best_model_at_end`` with ``save_only_model``
    on a layout that shards the model: the best weights are read back from the checkpoint's
    sharded state (`load_best`), which such checkpoints lack."""
    if shards_the_optimizer(layout) and args.load_best_model_at_end and args.save_only_model:
        raise ValueError(
            f"TrainingArguments(load_best_model_at_end=True, save_only_model=True) on "
            f"{layout.request.describe()}: the best weights are loaded back from the "
            "checkpoint's sharded state, which save_only_model leaves out; set "
            "save_only_model=False, or load_best_model_at_end=False and load the best "
            "checkpoint's model.safetensors yourself")


def load_best(trainer) -> bool:
    """``load_best_model_at_end`` on a layout that shards the model: the best checkpoint's
    `FOLDER` read back with `Accelerator.load_state` (its weights into the shards, and the
    optimizer state, step counters and random generators of that step with them); transformers
    would load the whole ``model.safetensors`` into the sharded model, which fails. False on
    plain DDP (transformers' own loading runs)."""
    if not shards_the_optimizer(trainer.accelerator.layout):
        return False
    trainer.accelerator.load_state(os.path.join(trainer.state.best_model_checkpoint, FOLDER))
    return True


def save(trainer, output_dir: str) -> None:
    """The optimizer state as `FOLDER` (every process writes its shares) and the scheduler's
    as transformers writes it (process 0)."""
    trainer.accelerator.save_state(os.path.join(output_dir, FOLDER))
    if trainer.args.should_save:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (torch's "save the optimizer too" reminder)
            torch.save(trainer.lr_scheduler.state_dict(),
                       os.path.join(output_dir, hf_trainer.SCHEDULER_NAME))


def load(trainer, checkpoint: str) -> bool:
    """Restore `checkpoint`'s `FOLDER` and scheduler state; False when it has no `FOLDER`
    (transformers' own loading then runs). A checkpoint whose optimizer state is
    transformers' ``optimizer.pt`` (a DDP run's) is refused in one line on a layout that
    shards the state: loading it there would give each process the whole state."""
    folder = os.path.join(checkpoint, FOLDER)
    if not os.path.isdir(folder):
        layout = trainer.accelerator.layout
        if shards_the_optimizer(layout) and \
                os.path.isfile(os.path.join(checkpoint, hf_trainer.OPTIMIZER_NAME)):
            raise ValueError(
                f"resume_from_checkpoint={checkpoint!r}: its optimizer state is "
                f"{hf_trainer.OPTIMIZER_NAME}, written whole by a DDP run, and "
                f"parallel={layout.request.describe()!r} shards that state; resume it on the "
                "DDP layout it was written on, or start this layout from its model alone "
                "(from_pretrained of the checkpoint folder)")
        return False
    trainer.accelerator.load_state(folder)
    scheduler = os.path.join(checkpoint, hf_trainer.SCHEDULER_NAME)
    if os.path.isfile(scheduler):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
    return True
