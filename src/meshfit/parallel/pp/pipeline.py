"""`Pipeline`: this rank's part of a pipeline-parallel model, driven one batch at a time.

Layouts: every rank passes the same global batch `inputs` [B, T] and `targets` [B, T] to
`Pipeline.step`; the first stage splits the inputs into `microbatches` chunks of B/m rows, the
last stage the targets. Between stages travel hidden states [B/m, T, d_model]. The step's loss
equals a single process's mean token cross-entropy over the whole batch and is returned on
every rank (broadcast from the last stage's rank).

A weight shared between stages (GPT-2's tied embedding and head) becomes one copy per stage;
their gradients are summed after every step so the copies receive the same update and stay
equal, as Megatron-LM does for its embedding group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from meshfit._compat import pipelining as pp_internals
from meshfit.distributed.tensors import local_tensor
from meshfit.models.plans.regroup import canonical_state, regrouped_params
from meshfit.parallel.clip import clip_grad_norm_
from meshfit.parallel.ep import moe_modules
from meshfit.parallel.pp.schedule import TokenCrossEntropy, check_batch

__all__ = ["Pipeline"]


class Pipeline:
    """This rank's part of a pipeline: `modules` (its stage modules, in the order the schedule
    holds them), `stages` (torch PipelineStages), `schedule` (the torch schedule object),
    `timings` (list of dicts, appended to by every step when recording) and `step`."""

    def __init__(self, modules, stages, schedule, *, name, pp_group, pp_rank, num_stages, points,
                 microbatches, loss_fn, last_rank, tied, timings, step_info, virtual_stages,
                 placement):
        self.modules, self.stages, self.schedule = modules, stages, schedule
        self.virtual_stages, self.placement = virtual_stages, placement
        self.schedule_name, self.pp_group, self.pp_rank = name, pp_group, pp_rank
        self.num_stages, self.points, self.microbatches = num_stages, points, microbatches
        self.stage_indices = [s.stage_index for s in stages]
        self.timings = timings
        self._loss_fn, self._last_rank, self._tied = loss_fn, last_rank, tied
        self._step_info = step_info  # shared with the stages: stamps their timings
        self._tie_shapes: dict[int, tuple] = {}
        self.has_first = 0 in self.stage_indices
        self.has_last = num_stages - 1 in self.stage_indices
        self.device = stages[0].device
        self._trained = False  # the schedule has run a step with backward (see eval_loss)

    def record_timings(self, on: bool) -> None:
        """Start or stop appending per-micro-batch timings to `timings` (built with
        record_timings=True)."""
        if self.timings is None and on:
            raise ValueError("record_timings(True) needs a pipeline built with "
                             "record_timings=True")
        self._step_info["record"] = bool(on)

    @property
    def wrapped_modules(self) -> list[nn.Module]:
        """The stage modules as the schedule runs them (a data-parallel wrapper, if any)."""
        return [stage.submod for stage in self.stages]

    def meta(self) -> dict:
        """The layout, as `meshfit.charts.pipeline` reads it from a run folder (`meshfit.train.pipeline_record`)."""
        return {"schedule": self.schedule_name, "pp": len(self.placement),
                "microbatches": self.microbatches, "virtual_stages": self.virtual_stages,
                "num_stages": self.num_stages, "points": list(self.points),
                "placement": [list(held) for held in self.placement]}

    def parameters(self):
        for _, p in self.named_parameters():
            yield p

    def named_parameters(self):
        """This rank's parameters under the full model's names (a tied copy under its own)."""
        for m in self.modules:
            yield from m.named_parameters()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers, keyed as in the full model's state_dict."""
        out = {}
        for m in self.modules:
            out.update(m.state_dict())
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict (every stage's part, sharded tensors gathered) on CPU
        on global rank 0, {} elsewhere; a collective: call on every rank."""
        mine = {}
        for m in self.modules:  # full_tensor: collectives inside this stage's tp/dp groups
            whole = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
                     for k, v in m.state_dict().items()}
            mine.update(canonical_state(whole, regrouped_params(m)))  # GPT-2's c_attn
        # One copy of each stage travels: only the pipeline holding global rank 0 (its pp
        # rank 0) gathers, over its pp group; the other tp/dp replicas keep theirs.
        if 0 not in dist.get_process_group_ranks(self.pp_group):
            return {}
        parts: list = [None] * dist.get_world_size(self.pp_group) if dist.get_rank() == 0 \
            else None
        dist.gather_object(mine, parts, dst=0, group=self.pp_group)
        if dist.get_rank() != 0:
            return {}
        out = {}
        for part in parts:
            out.update(part)
        return out

    def step(self, inputs: torch.Tensor | None, targets: torch.Tensor | None, *,
             scale: float = 1.0) -> torch.Tensor:
        """Forward and backward over the batch; gradients accumulate in `.grad` as one
        `(scale * loss).backward()` of the whole-batch mean loss would leave them (zero them
        yourself; `scale=1/k` for k pipeline steps per optimizer step).

        Pass the same batch on every rank of the pipeline (ranks that do not need a tensor
        may pass None), so that a batch that does not divide into micro-batches fails on every
        rank before any communication; with data parallel, each data-parallel rank its own
        batch. Returns the batch's mean loss (detached, unscaled; see the module docstring).
        Under a data-parallel wrapper the stage gradients are reduced after the last
        micro-batch of every call (torch's schedules force it), so k calls per optimizer step
        reduce k times: prefer more `microbatches` to more calls."""
        args, target = self._inputs(inputs, targets)
        self._loss_fn.scale = scale
        moes = self._moe_modules()
        for m in moes:  # each micro-batch's auxiliary losses weigh as its loss does
            m.aux_grad_scale = scale / self.microbatches
        before = self._tied_grads_before()
        losses: list[torch.Tensor] = []
        try:
            self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        finally:
            self._loss_fn.scale = 1.0
            for m in moes:
                m.aux_grad_scale = None
        self._step_info["step"] += 1
        self._trained = True
        self._sum_tied_grads(before)
        loss = self._broadcast_loss(losses)
        return loss / scale if scale else loss  # scale 0: a batch that must weigh nothing

    def _moe_modules(self) -> list:
        """The mixture-of-experts blocks of this rank's stages: their auxiliary losses enter
        backward from each block's output (`MoE.aux_grad_scale`), since the loss the
        schedule differentiates is the last stage's cross-entropy alone."""
        return moe_modules(self.modules)

    def eval_loss(self, inputs: torch.Tensor | None, targets: torch.Tensor | None
                  ) -> torch.Tensor:
        """The batch's mean loss, leaving no gradients, on every pipeline rank; timings are
        not recorded. Forward only through the schedule's `eval`, except under zero_bubble:
        torch 2.13's eval of the V-shaped schedule fails where a rank hands a micro-batch
        to its own second stage ("can't steal_bwd_input if this stage doesn't have
        backward"), so there a full step runs and its gradients are dropped. The same is
        done for an evaluation before the first training step on a schedule that does not
        re-initialise its stages when it switches from eval to training (torch 2.11: the
        stages keep receive buffers that need no gradient, and the first training step then
        fails with "for chunk 0 has gradients None and is expecting to send gradients")."""
        by_step = self.schedule_name == "zero_bubble" or (
            not self._trained and not pp_internals.switches_modes(self.schedule))
        if not by_step and not hasattr(self.schedule, "eval"):
            raise RuntimeError(f"torch {torch.__version__}'s pipeline schedules have no eval(); "
                               "upgrade torch to evaluate a pipeline")
        if any(p.grad is not None for p in self.parameters()):
            # Switching a torch schedule between train and eval re-runs its shape inference,
            # which sets the gradients of FSDP-wrapped stages to None (torch 2.13).
            raise RuntimeError("eval_loss with gradients accumulated: evaluate between "
                               "optimizer steps, after optimizer.zero_grad(set_to_none=True)")
        args, target = self._inputs(inputs, targets)
        losses: list[torch.Tensor] = []
        recording, self._step_info["record"] = self._step_info["record"], False
        try:
            if by_step:
                with torch.enable_grad():  # (callers evaluate under no_grad)
                    self.schedule.step(*args, target=target, losses=losses,
                                       return_outputs=False)
            else:
                with torch.no_grad():
                    self.schedule.eval(*args, target=target, losses=losses)
        finally:
            self._step_info["record"] = recording
            if by_step:
                for p in self.parameters():
                    p.grad = None
        self._trained = self._trained or by_step
        return self._broadcast_loss(losses)

    def _inputs(self, inputs, targets):
        """This rank's schedule arguments and target, checked; the token count of the batch
        set on the loss (the divisor of its exact batch mean)."""
        for t in (inputs, targets):
            if t is not None:
                check_batch(t.shape[0], self.microbatches)
        for needed, t, what in ((self.has_first, inputs, "inputs"), (self.has_last, targets,
                                                                     "targets")):
            if needed and t is None:
                raise ValueError(f"{what}=None on pp rank {self.pp_rank}, which holds stage(s) "
                                 f"{self.stage_indices}; pass the batch's {what} on every rank")
        # Contiguous: torch 2.11's stages check each micro-batch's strides against those of
        # the first ("stride mismatch: expected (256, 1) actual (257, 1)" for x = w[:, :-1]).
        args = (inputs.to(self.device).contiguous(),) if self.has_first else ()
        target = targets.to(self.device).contiguous() if self.has_last else None
        if isinstance(self._loss_fn, TokenCrossEntropy) and self.has_last:
            self._loss_fn.count = (target != self._loss_fn.ignore_index).sum()
        return args, target

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the whole model's gradient norm (every stage, every shard) to `max_norm`;
        returns the norm, equal on every rank. A weight tied across stages counts once."""
        counted = [p for n, p in self.named_parameters() if n not in self._duplicate_names]
        return clip_grad_norm_(list(self.parameters()), max_norm, norm_type=norm_type,
                               counted=counted, across=self.pp_group, device=self.device)

    @property
    def _duplicate_names(self) -> set[str]:
        # Every copy of a tied weight but the first name's (held by exactly one stage).
        out = set()
        for tie in self._tied:
            out.update(tie.names[1:])
        return out

    def _broadcast_loss(self, losses) -> torch.Tensor:
        wide = any(p.dtype == torch.float64 for p in self.parameters())
        dtype = torch.float64 if wide else torch.float32  # as the loss: half is upcast
        loss = torch.stack([x.detach() for x in losses]).sum().to(dtype) if losses else \
            torch.zeros((), dtype=dtype, device=self.device)
        dist.broadcast(loss, group=self.pp_group, group_src=self._last_rank)
        return loss

    # Tied weights: one copy per stage; after each step every copy gets g0 + the sum of what
    # this step added to each copy (g0: the gradient accumulated before, equal on all copies).
    def _local_copies(self, names):
        return [p for n, p in self.named_parameters() if n in names]

    # Under tp/FSDP the copies are DTensors laid out alike (the plans shard embedding and
    # head both as Shard(0)), so their local shards are summed; ranks without a copy take
    # part in the all-reduce with zeros of the local shape, learnt once from the holders.
    def _tied_grads_before(self):
        out = []
        for tie in self._tied:
            local = self._local_copies(tie.names)
            g0 = _grad_as_param(local[0]) if local else None
            out.append(None if g0 is None else local_tensor(g0).clone())
        return out

    def _sum_tied_grads(self, before) -> None:
        for i, (tie, g0) in enumerate(zip(self._tied, before)):
            local = self._local_copies(tie.names)
            if not local and not tie.cross_rank:
                continue  # (a rank holding no copy of a tie kept within another rank)
            grads = [g for g in map(_grad_as_param, local) if g is not None]
            layout = self._tie_local_shape(i, tie, grads)
            if layout is None:
                continue  # no copy received a gradient on any rank
            shape, dtype = layout
            added = torch.zeros(shape, dtype=dtype, device=self.device)
            for g in grads:
                added += local_tensor(g) if g0 is None else local_tensor(g) - g0
            if tie.cross_rank:  # ranks without a copy take part with zeros
                dist.all_reduce(added, group=self.pp_group)
            total = added if g0 is None else g0 + added
            for p in local:
                if p.grad is None:
                    continue  # (a stage that received no gradient at all: nothing to add to)
                local_tensor(p.grad).copy_(total)

    def _tie_local_shape(self, i: int, tie, grads):
        """(local shape, dtype) of the tie's gradient, or None when no copy has one yet."""
        if i not in self._tie_shapes:
            mine = (tuple(local_tensor(grads[0]).shape), grads[0].dtype) if grads else None
            if tie.cross_rank:
                everyone: list = [None] * dist.get_world_size(self.pp_group)
                dist.all_gather_object(everyone, mine, group=self.pp_group)
                mine = next((x for x in everyone if x is not None), None)
            if mine is None:
                return None  # asked again next step (every rank agrees: nothing cached)
            self._tie_shapes[i] = mine
        return self._tie_shapes[i]


def _grad_as_param(p: torch.Tensor) -> torch.Tensor | None:
    """`p.grad`, laid out as `p` (a tensor-parallel embedding's gradient can come back
    replicated while its weight is sharded); re-assigned so that writes to it land."""
    g = p.grad
    if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
        p.grad = g = g.redistribute(p.device_mesh, p.placements)
    return g
