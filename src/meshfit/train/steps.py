"""What `meshfit train`'s loop trains, behind one interface built by `prepare_steps`: the
model prepared whole (`ModelSteps`) or, under pp > 1, this rank's pipeline stages
(`PipelineSteps`). Each gives the loop ``accumulate()``, ``forward_backward(x, y, accum)``
(the cross-entropy, for the metrics), ``eval_loss(x, y)``, ``clip(max_norm)``,
``after_step(step, out_dir)``, and ``modules`` (switched between train() and eval()),
``params`` (what the optimizer is built over), ``exported`` (what the final weights are
gathered from), ``whole_batches`` (evaluation in whole pipeline batches), ``description``
(for the banner) and ``has_moe``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from meshfit.accelerator import Accelerator
from meshfit.models import GPT
from meshfit.models.plans import adapted_model
from meshfit.parallel.ep import moe_modules
from meshfit.parallel.pp import gather_timings
from meshfit.train.config import RunConfig
from meshfit.train.models import loss_function, plans, resolve_plan
from meshfit.train.pipeline_record import write_run

PIPELINE_TIMED_STEPS = 5
"""Optimizer steps whose per-micro-batch timings a pipeline run records (then stops: on
CUDA the recording synchronises the device around every forward and backward)."""


class ModelSteps:
    """A model from `Accelerator.prepare`: one forward and backward per micro-batch."""

    whole_batches = False  # any number of evaluation sequences will do

    def __init__(self, acc: Accelerator, model: torch.nn.Module, loss):
        self.acc, self.model, self.loss = acc, model, loss
        self.modules, self.params, self.exported = [model], model, model
        self.description = ""
        base = getattr(model, "module", model)  # DDP and compile wrap it
        self.moes = moe_modules([base]) if isinstance(base, GPT) else []  # the reference GPT's

    def accumulate(self):
        return self.acc.accumulate(self.model)

    def forward_backward(self, x, y, accum: int, weight: float | None = None,
                         positions: torch.Tensor | None = None) -> torch.Tensor:
        """The micro-batch's loss, backpropagated (x `weight`: the token weighting of
        `meshfit.train.trainer._token_weights`; a micro-batch without a trained target is
        run with one target made up and weight 0, so every rank still runs its backward).
        `positions`: of rows packing several examples (`meshfit.models.packing.packed_forward`)."""
        if weight is not None and weight == 0:
            y = y.clone()
            y.view(-1)[0] = 0
        loss = self._loss(x, y, positions)
        if not loss.requires_grad:
            raise ValueError("the model's loss does not depend on any trainable parameter "
                             "(requires_grad is False): its forward returns values computed "
                             "without gradient (under torch.no_grad, detached, or new tensors); "
                             "return the output of its layers")
        reported = self._cross_entropy(loss)
        if weight is not None:
            loss, reported = loss * weight, reported * weight
        self.acc.backward(loss)  # divides by the accumulation steps itself
        return reported

    def eval_loss(self, x, y, positions: torch.Tensor | None = None) -> torch.Tensor:
        return self._cross_entropy(self._loss(x, y, positions))

    def _loss(self, x, y, positions):
        x, y = self.acc.shard_sequence(x, y)  # under cp: this rank's part of each sequence
        return self.loss(self.model, x, y) if positions is None else \
            self.loss(self.model, x, y, positions)

    def _cross_entropy(self, loss: torch.Tensor) -> torch.Tensor:
        """A mixture of experts' loss includes its auxiliary losses (the reference GPT's MoE
        blocks; a transformers MoE with output_router_logits): the reported loss is the
        cross-entropy (as under pp), the auxiliary part is reported apart. (The auxiliary
        losses depend on how windows are batched: a validation loss with them would depend
        on the layout.)"""
        aux = [m.last_aux_loss.detach() for m in self.moes if m.last_aux_loss is not None]
        hf_aux = getattr(self.loss, "last_aux", None)  # a transformers MoE's router loss
        if hf_aux is not None:
            aux.append(hf_aux)
        return loss.detach() - sum(aux) if aux else loss

    def clip(self, max_norm: float) -> torch.Tensor:
        return self.acc.clip_grad_norm_(self.model.parameters(), max_norm)

    def after_step(self, step: int, out_dir: Path) -> None:
        pass


class PipelineSteps:
    """This rank's `Pipeline` (pp > 1), whose `step` runs all of a batch's micro-batches."""

    whole_batches = True  # evaluation batches are cut into micro-batches too

    def __init__(self, acc: Accelerator, pipeline, cfg: RunConfig, micro: int, chunks: int):
        self.acc, self.pipeline, self.steps = acc, pipeline, cfg.train.steps
        self.modules = pipeline.wrapped_modules
        self.params = torch.nn.ModuleList(pipeline.modules)  # this rank's stages
        self.exported = pipeline
        self.description = (f", {cfg.parallel.schedule} schedule with {chunks} micro-batches "
                            f"of {micro} (stages begin at blocks {pipeline.points})")

    def accumulate(self):
        return self.acc.accumulate()  # the schedule synchronises on its last micro-batch

    def forward_backward(self, x, y, accum: int, weight: float | None = None,
                         positions=None) -> torch.Tensor:
        """The pipeline batch's mean loss over its counted targets, backpropagated; with
        `weight` (`ModelSteps.forward_backward`) scaled by it. (Packed rows, `positions`,
        are refused before launch under pp.)"""
        x, y = self.acc.shard_sequence(x, y)  # under cp: this rank's part of each sequence
        if weight is None:
            return self.pipeline.step(x, y, scale=1.0 / accum)
        if weight == 0:  # no trained target: one made up, weighing nothing
            y = y.clone()
            y.view(-1)[0] = 0
        return self.pipeline.step(x, y, scale=weight / accum) * weight

    def eval_loss(self, x, y, positions=None) -> torch.Tensor:
        return self.pipeline.eval_loss(*self.acc.shard_sequence(x, y))

    def clip(self, max_norm: float) -> torch.Tensor:
        return self.acc.clip_grad_norm_(self.pipeline, max_norm)  # every stage's part

    def after_step(self, step: int, out_dir: Path) -> None:
        if step == min(self.steps, PIPELINE_TIMED_STEPS):
            _save_pipeline_timings(self.pipeline, out_dir if self.acc.is_main_process else None)


def prepare_steps(acc: Accelerator, cfg: RunConfig, model: torch.nn.Module,
                  chunks: int) -> ModelSteps | PipelineSteps:
    """The prepared model, or under pp > 1 this rank's pipeline: each pipeline step takes
    micro x chunks sequences per data-parallel rank and cuts them into `chunks`
    micro-batches (the global batch is micro x chunks x dp x accumulation)."""
    if acc.parallel.pp == 1:
        trained = ModelSteps(acc, acc.prepare(model), loss_function(model))
    else:
        # LoRA: the stages are cut from the model inside the PeftModel (its adapted linears
        # go with their blocks); the adapters are written back under peft's names at the end
        inner = adapted_model(model)
        # ([parallel]'s schedule and virtual stages come with the request; an unset count of
        # micro-batches is the whole accumulation, `RunConfig.microbatches`)
        pipeline = acc.prepare_pipeline(inner, microbatches=chunks,
                                        plan=resolve_plan(plans(cfg)[1], inner),
                                        init_seed=cfg.train.seed,
                                        record_timings=True)  # for PIPELINE_TIMED_STEPS steps
        trained = PipelineSteps(acc, pipeline, cfg, cfg.train.micro_batch_size, chunks)
    trained.has_moe = bool(moe_modules([model]))  # on any stage: every rank logs routing
    return trained


def _save_pipeline_timings(pipeline, out_dir: Path | None) -> None:
    """Every pp rank's timings so far into the run folder (`meshfit pipeline-chart RUN`);
    a collective over the pp group. Recording stops afterwards."""
    timings = gather_timings(pipeline)
    pipeline.record_timings(False)
    if out_dir is not None:
        write_run(out_dir, pipeline.meta(), timings)
