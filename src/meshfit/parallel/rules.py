"""The layout rules: every check of a requested layout, each written once.

A rule is a function of the request resolved against the world size (`Resolved`: the
`LayoutRequest` whole, its mesh sizes and ZeRO stage resolved, the engine it runs on) that
returns its refusal as one line naming the field, the value and the fix, or None. The values
a request holds are checked when it is built (`LayoutRequest.problem`);
`meshfit.parallel.layout.Layout.resolve` then runs every rule here in order. Also here: which engine a layout runs on, which mesh axes
it keeps, and the warnings the guide gives for layouts that work but are not advised.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal, get_args

from meshfit.distributed.dims import AXES, DP_AXES, ParallelDims
from meshfit.parallel.request import (ZERO_STAGES, LayoutRequest, Offload, namer,
                                      offload_stage_problem)

__all__ = ["DP_AXES", "Engine", "MixedPrecision", "Offload", "Resolved", "ZERO_STAGES",
           "default_zero_stage", "engine_for", "first_problem", "layout_warnings",
           "mesh_axes_for", "namer", "offload_stage_problem", "precision_problem"]

MixedPrecision = Literal["no", "bf16", "fp16"]


class Engine(enum.Enum):
    """What keeps the data-parallel replicas in step."""

    NONE = "none"
    """No data-parallel wrapper: one process, or tensor/pipeline parallel alone."""
    DDP = "ddp"
    """DistributedDataParallel over every data-parallel rank (ZeRO stage 0)."""
    ZERO1 = "zero1"
    """DDP + ZeroRedundancyOptimizer partitioning the optimizer state over ``dp_shard``."""
    FSDP2 = "fsdp2"
    """``fully_shard`` over ``dp_shard`` (HSDP with ``dp_replicate``): stages 2/3, and stage 1
    of a tensor- or pipeline-parallel model."""
    FSDP2_REPLICATE = "fsdp2_replicate"
    """``fully_shard`` over ``dp_replicate`` with a shard group of one: stage 0 of a tensor- or
    pipeline-parallel model (DDP does not take DTensor parameters)."""


# ----------------------------------------------------------------------------- the options
# (The values of a request itself are checked when it is built: `LayoutRequest.problem`.)
def precision_problem(mixed_precision, n) -> str | None:
    """A mixed-precision mode the layouts do not know."""
    if mixed_precision not in get_args(MixedPrecision):
        return (f"{n('mixed_precision')}={mixed_precision!r} is not a precision meshfit knows; "
                f"use one of {', '.join(repr(v) for v in get_args(MixedPrecision))}")
    return None


# ----------------------------------------------------------------------------- the rules
@dataclass(frozen=True)
class Resolved:
    """What the rules read: the request whole (`LayoutRequest`), its sizes resolved against
    the world size, the ZeRO stage it resolves to, and what the caller adds (the precision,
    whether DDP keywords were given, the engine)."""

    request: LayoutRequest
    dims: ParallelDims  # resolved
    stage: int
    mixed_precision: str
    ddp_kwargs: bool
    engine: Engine

    @property
    def offload(self) -> str:
        return self.request.offload


def _cp_rules(r: Resolved, n) -> str | None:
    if r.dims.cp == 1:
        return None
    axis = "tp" if r.dims.tp > 1 else "pp" if r.dims.pp > 1 else None
    if axis and r.stage == 0:
        return (f"{n('zero_stage')}=0 with {n('cp')}={r.dims.cp} and {n(axis)}="
                f"{getattr(r.dims, axis)}: the data-parallel engine of a {axis} model (FSDP2) "
                "shards its parameters over dp_shard x cp; set zero_stage 1, 2 or 3")
    return None


def _ep_rules(r: Resolved, n) -> str | None:
    if r.dims.ep == 1:
        return None
    if r.stage == 0:
        return (f"{n('zero_stage')}=0 with {n('ep')}={r.dims.ep}: expert parallelism runs on "
                f"the sharded data-parallel ranks (FSDP2); use zero_stage 1, 2 or 3")
    return None


def _stage_needs_shards(r: Resolved, n) -> str | None:
    if r.stage > 0 and r.dims.dp_shard * r.dims.cp == 1:  # (under cp: over dp_shard x cp)
        return (f"{n('zero_stage')}={r.stage} shards over the dp_shard axis, which has size 1; "
                f"set {n('dp_shard')} > 1 or zero_stage=0")
    if r.stage == 0 and r.dims.dp_shard > 1:
        return (f"{n('zero_stage')}=0 (DDP) shards nothing, but {n('dp_shard')}="
                f"{r.dims.dp_shard}; use dp_replicate for plain data parallel, or zero_stage "
                "1, 2 or 3")
    return None


def _disk_rules(r: Resolved, n) -> str | None:
    if r.offload != "disk":
        return None
    if r.request.offload_params and (r.stage != 3 or r.engine is not Engine.FSDP2):
        return (f"{n('offload_params')}=true needs zero_stage=3 (only then is each rank's "
                f"parameter shard its own), and this layout resolves to zero_stage={r.stage}; "
                f"set {n('dp_shard')} > 1 and zero_stage=3, or drop offload_params")
    if r.dims.pp > 1:
        return (f"{n('offload')}='disk' with {n('pp')} > 1 is not available yet; use it with "
                "the data-parallel axes and tp")
    return None


def _offload_needs_stage3(r: Resolved, n) -> str | None:
    return offload_stage_problem(r.offload, r.stage, n)


def _tp_options_need_tp(r: Resolved, n) -> str | None:
    for key in ("sequence_parallel", "loss_parallel"):
        if getattr(r.request, key) and r.dims.tp == 1:
            return f"{n(key)}=true needs {n('tp')} > 1 (tensor parallel); set tp or drop it"
    return None


def _not_yet_with_pp(r: Resolved, n) -> str | None:
    if r.dims.pp == 1:
        return None
    if r.request.loss_parallel:
        return (f"{n('loss_parallel')}=true with {n('pp')} > 1 is not yet available in meshfit "
                "(the last stage would hand vocabulary-sharded logits to the schedule); set "
                "loss_parallel=false")
    if r.mixed_precision == "fp16":
        return (f"{n('mixed_precision')}='fp16' with {n('pp')} > 1 is not yet available in "
                "meshfit (the loss scale would have to agree across stages); use 'bf16'")
    if r.offload != "none":
        return (f"{n('offload')}={r.offload!r} with {n('pp')} > 1 is not yet available in "
                "meshfit (the stages' tied gradients and norm are combined on the device); "
                "use offload='none'")
    return None


def _ddp_kwargs_need_ddp(r: Resolved, n) -> str | None:
    # A single process (engine NONE) accepts them: the same script runs DDP on more ranks.
    model_parallel = r.dims.tp > 1 or r.dims.pp > 1
    if r.ddp_kwargs and (model_parallel or r.stage >= 2):
        if model_parallel and r.dims.dp == 1:
            engine = "a layout without a data-parallel axis"
        elif model_parallel:
            engine = "FSDP2 (the data-parallel engine under tp/pp > 1)"
        else:
            engine = f"FSDP2 (zero_stage={r.stage})"
        return f"{n('ddp_kwargs')} apply to DDP, which {engine} does not use; drop them"
    return None


_RULES = (_cp_rules, _ep_rules, _stage_needs_shards, _disk_rules,
          _offload_needs_stage3,
          _tp_options_need_tp, _not_yet_with_pp, _ddp_kwargs_need_ddp)


def first_problem(request: Resolved, n) -> str | None:
    """The refusal of the first rule `request` breaks (None: it breaks none); `n` spells the
    fields as the caller's user writes them (`namer`)."""
    for rule in _RULES:
        problem = rule(request, n)
        if problem:
            return problem
    return None


def layout_warnings(dims: ParallelDims, stage: int, local_world_size: int | None
                    ) -> tuple[str, ...]:
    """Layouts that work but that the guide advises against, each with the reason."""
    out = []
    if local_world_size and dims.tp > 1 and (dims.tp > local_world_size
                                             or local_world_size % dims.tp):
        out.append(
            f"tp={dims.tp} with {local_world_size} processes per node: tensor-parallel groups "
            "cross nodes, so every block's all-reduces go over the slower inter-node link "
            "(Megatron-LM keeps tp within a node); use a tp that divides the processes per "
            "node and put the rest on pp or the data-parallel axes")
    if dims.pp > 1 and stage >= 2:
        why = (f"zero_stage={stage} with pp={dims.pp}: a pipeline runs a backward per "
               "micro-batch, so gradients sharded per micro-batch would cost a reduce-scatter "
               "each; torch's schedules keep whole gradients until the last micro-batch "
               "instead (DeepSpeed refuses ZeRO-2/3 with its pipeline engine for this reason)")
        if stage == 2:
            out.append(why + ", which makes stage 2 the same as zero_stage=1 here")
        else:
            out.append(why + ", and stage 3 re-gathers every stage's parameters for each "
                       "micro-batch's forward and backward; prefer zero_stage=1")
    return tuple(out)


def default_zero_stage(dp_shard: int) -> int:
    """The ZeRO stage of a request that names none: 3 (FSDP2) when the dp_shard axis shards,
    else 0 (DDP)."""
    return 3 if dp_shard > 1 else 0


def engine_for(dims: ParallelDims, stage: int, distributed: bool) -> Engine:
    if not distributed:
        return Engine.NONE
    model_parallel = dims.tp > 1 or dims.pp > 1 or dims.ep > 1
    if model_parallel and dims.dp * dims.cp == 1:
        return Engine.NONE
    if model_parallel:  # (under cp: FSDP2 shards over dp_shard x cp)
        return Engine.FSDP2_REPLICATE if dims.dp_shard * dims.cp == 1 else Engine.FSDP2
    if stage >= 2:
        return Engine.FSDP2
    return Engine.DDP if stage == 0 else Engine.ZERO1


def mesh_axes_for(dims: ParallelDims) -> tuple[str, ...]:
    # Axes of size 1 are dropped, except the data-parallel ones: with tp or pp both are kept
    # (the data-parallel wrapper of a model-parallel model is FSDP2 over the 2-D
    # (dp_replicate, dp_shard) sub-mesh); otherwise dp_replicate is kept when no data-parallel
    # axis is larger, so that a one-process job still has a mesh to pass around.
    keep = set(DP_AXES) if dims.tp > 1 or dims.pp > 1 else set()
    if not any(a in DP_AXES for a in dims.enabled()):
        keep.add("dp_replicate")
    return tuple(a for a in AXES if getattr(dims, a) > 1 or a in keep)

