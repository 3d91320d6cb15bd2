"""`Trainer`: transformers' own, its accelerator meshfit's `Accelerator`.

transformers' Trainer builds Accelerate's ``Accelerator`` in ``create_accelerator_and_
postprocess`` and, on resume, skips the batches already trained with Accelerate's
``skip_first_batches``; both are names of the ``transformers.trainer`` module. While this
Trainer is built and while it trains, those two names are meshfit's (`_on_meshfit`), so
transformers' own code runs unchanged on meshfit's Accelerator: every argument transformers
passes it (mixed precision, the data loader configuration, DDP's keywords, the accumulation
plugin, ``torch_compile``'s dynamo plugin) means what it means under Accelerate, and the
layout is ``TrainingArguments.parallel`` (`meshfit.transformers.arguments`).

Accelerate's ``skip_first_batches`` does not know meshfit's prepared loader (it would rebuild
a loader over the whole dataset, not this process's share); meshfit's skips within its own
loader's order, so a resumed epoch goes on where it stopped (tested bit-exact).

Under tp and cp two more things are told to transformers: the sizes (the
``parallelism_config`` it reads), and the loss's scale (`OnMeshfit.compute_loss`).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import threading
from typing import Any

import transformers
import transformers.trainer as hf_trainer

from meshfit.accelerator import Accelerator
from meshfit.accelerator.standalone import skip_first_batches
from meshfit.accelerator.compat.parallelism import ParallelismConfig
from meshfit.parallel.request import LayoutRequest
from meshfit.transformers.planned import planned_layout

__all__ = ["OnMeshfit", "Trainer", "on_meshfit"]

log = logging.getLogger("meshfit")
_SWAP = threading.RLock()  # the module's names are the process's: one Trainer at a time


def _compile_backend(plugin: Any) -> str | None:
    """``torch_compile``'s backend from transformers' TorchDynamoPlugin (None: no compile)."""
    backend = getattr(plugin, "backend", None)
    backend = getattr(backend, "value", backend)
    return None if backend is None or str(backend).upper() == "NO" else str(backend).lower()


def _plain_ddp(request: LayoutRequest) -> bool:
    """Whether the layout is plain DDP (every process a replica), the one meshfit hands the
    DistributedDataParallelKwargs transformers always passes (``find_unused_parameters``
    from the model, the ``ddp_*`` arguments); every other layout refuses DDP's keywords, so
    they are dropped there."""
    return request.dp_shard == 1 and (request.zero_stage or 0) == 0 and \
        request.tp == request.cp == request.ep == request.pp == 1


def shards_the_model(layout) -> bool:
    """Whether `layout` leaves a process without the whole model (ZeRO-3's shards, tp's and
    ep's slices, disk-offloaded parameters): its weights are then gathered to be saved."""
    dims = layout.dims
    return layout.zero_stage == 3 or dims.tp > 1 or dims.ep > 1 or dims.pp > 1 or \
        layout.request.offload_params


def _check_checkpoints(args, layout) -> None:
    """transformers writes a checkpoint's optimizer state from process 0 alone, whole
    (``optimizer.state_dict()``): on a layout that shards the optimizer state (ZeRO 1-3, tp,
    ep, offload) the other processes' shares would be missing (cp: not tested). Refused
    there, before any file is written, unless the checkpoints hold the model alone
    (``save_only_model``: its weights are gathered, `OnMeshfit._save`)."""
    dims = layout.dims
    whole = layout.zero_stage == 0 and dims.tp == dims.cp == dims.ep == dims.pp == 1 and \
        layout.request.offload == "none"
    strategy = str(getattr(args.save_strategy, "value", args.save_strategy))
    if not whole and strategy != "no" and not args.save_only_model:
        raise ValueError(
            f"TrainingArguments(save_strategy={strategy!r}) on {layout.request.describe()}: "
            "Trainer's checkpoints hold the optimizer state as process 0 has it, and this "
            "layout shards it (cp: not tested with it); set save_only_model=True (the "
            "model's weights, gathered) or save_strategy='no', or use a DDP layout")


@contextlib.contextmanager
def _on_meshfit(factory):
    """transformers.trainer's Accelerator and skip_first_batches are meshfit's inside."""
    with _SWAP:
        saved = hf_trainer.Accelerator, hf_trainer.skip_first_batches
        hf_trainer.Accelerator, hf_trainer.skip_first_batches = factory, skip_first_batches
        try:
            yield
        finally:
            hf_trainer.Accelerator, hf_trainer.skip_first_batches = saved


class OnMeshfit:
    """Put first among the bases of transformers' `Trainer` or a subclass of it (TRL's
    trainers): that trainer on meshfit's `Accelerator` (`on_meshfit`); with meshfit's
    `TrainingArguments`, ``args.parallel`` lays the model out."""

    def __init__(self, *args, **kwargs):
        # The training rows, for parallel="auto" (the planner reads their length): the
        # accelerator is built before transformers keeps them.
        bound = inspect.signature(super().__init__).bind_partial(*args, **kwargs).arguments
        self._rows_for_plan = bound.get("train_dataset")
        super().__init__(*args, **kwargs)

    def _meshfit_accelerator(self, **args) -> Accelerator:
        """What transformers builds its Accelerator with, as meshfit's keywords."""
        backend = _compile_backend(args.pop("dynamo_plugin", None))
        if backend is not None:
            args["dynamo_backend"] = backend
        request = getattr(self.args, "parallel", None)
        if request == "auto":
            request = planned_layout(self.model, self.args, self._rows_for_plan)
        if isinstance(request, LayoutRequest):
            args["parallel"] = request
            if not _plain_ddp(request):
                args["kwargs_handlers"] = [h for h in args.get("kwargs_handlers") or ()
                                           if type(h).__name__ != "DistributedDataParallelKwargs"]
            if request.offload == "disk":
                args["offload_dir"] = os.path.join(self.args.output_dir, "offload")
        accelerator = Accelerator(**args)
        _check_checkpoints(self.args, accelerator.layout)
        dims = accelerator.layout.dims
        if accelerator.parallelism_config is None and (dims.tp > 1 or dims.cp > 1):
            # What transformers reads of the layout: the processes of a tp or cp group share
            # one batch (it counts a step's tokens and the global batch with it), and under
            # cp it cuts each batch's sequences itself, through Accelerate's
            # maybe_context_parallel (meshfit's cuts as its ring attention expects), with
            # labels shifted before the cut.
            accelerator.parallelism_config = ParallelismConfig(
                dp_replicate_size=dims.dp_replicate, dp_shard_size=dims.dp_shard,
                tp_size=dims.tp, cp_size=dims.cp)
        return accelerator

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """transformers' loss, divided by tp x cp under tensor or context parallel. With
        ``average_tokens_across_devices`` transformers divides the loss by the tokens of the
        whole step, counted with ``accelerator.gather`` and divided by tp x cp (Accelerate's
        gather is over every process, and the ranks of a tp or cp group count one batch),
        then multiplies it by processes // tp. meshfit's gather is over the data-parallel
        processes only (a tp or cp group's share counted once already), so the count comes
        out tp x cp times too small: dividing the loss by tp x cp gives Accelerate's."""
        out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        dims = self.accelerator.layout.dims
        sharing = dims.tp * dims.cp
        if sharing > 1 and self.args.average_tokens_across_devices and \
                num_items_in_batch is not None and \
                (self.model_accepts_loss_kwargs or self.compute_loss_func):
            if return_outputs:
                return out[0] / sharing, out[1]
            return out / sharing
        return out

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """transformers' ``_save`` (``save_pretrained`` on the main process; every process
        calls it); on a layout that shards the model, with its whole weights gathered first
        (every process takes part)."""
        if state_dict is None and shards_the_model(self.accelerator.layout):
            state_dict = self.accelerator.get_state_dict(self.model)
        super()._save(output_dir, state_dict=state_dict)

    def create_accelerator_and_postprocess(self) -> None:
        with _on_meshfit(self._meshfit_accelerator):
            super().create_accelerator_and_postprocess()

    def train(self, *args, **kwargs):
        with _on_meshfit(self._meshfit_accelerator):
            return super().train(*args, **kwargs)


def on_meshfit(trainer_class: type) -> type:
    """`trainer_class` (transformers' `Trainer` or a subclass: TRL's ``SFTTrainer``, your
    own) running on meshfit's `Accelerator`: a subclass with `OnMeshfit` first."""
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, transformers.Trainer)):
        raise ValueError(f"on_meshfit({trainer_class!r}): give transformers.Trainer or a "
                         "subclass of it")
    return type(trainer_class.__name__, (OnMeshfit, trainer_class),
                {"__module__": trainer_class.__module__,
                 "__doc__": f"{trainer_class.__name__} on meshfit's Accelerator."})


class Trainer(OnMeshfit, transformers.Trainer):
    """transformers' `Trainer` on meshfit's `Accelerator`; with meshfit's
    `TrainingArguments`, ``args.parallel`` lays the model out."""
