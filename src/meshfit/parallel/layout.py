"""`Layout`: the one decision of how a job is laid out, made once, before any model work.

`Layout.resolve` takes the mesh sizes (`ParallelDims`), the world size and the options that
change how the data-parallel engine works (ZeRO stage, offload, mixed precision, sequence /
loss parallel, DDP keywords), checks every rule (one-line `ValueError`s naming the field,
the value and the fix; each rule written once, below) and returns a frozen description:

- the **engine** that keeps the data-parallel replicas in step (`Engine`): none (one
  process, or tensor/pipeline parallel without a data-parallel axis), DDP (ZeRO stage 0),
  ZeRO-1 (DDP + ZeroRedundancyOptimizer), FSDP2 (stages 2/3; stage 1 under tp/pp) or
  replicate-only FSDP2 (stage 0 under tp/pp);
- the **mesh axes** and the sub-meshes each technique runs on;
- the **warnings** for layouts that work but that the guide advises against;
- the **costs** a planner reads (`LayoutCosts`): how the engine divides parameters,
  gradients and optimizer state, what it gathers during the step, and what it keeps extra.

`Layout.check_model` adds the rules that need the model (sizes that tensor parallel must
divide, blocks for the pipeline stages), and `Layout.candidates` enumerates every layout of a
world size for a model, each with its refusal when it has one. `meshfit train`'s preflight,
`Accelerator` and `Accelerator.prepare_pipeline` all go through here; nothing else
re-validates a layout.

Why every data-parallel layout with tp or pp runs on FSDP2: with a ``tp`` axis the model's
parameters are DTensors, which DDP and ZeroRedundancyOptimizer do not take; with a ``pp``
axis torch's schedules run a backward per micro-batch, which DDP's bucket rebuilding
miscounts (measured, torch 2.13: "rebuilt parameter indices size is not same as original
model parameters size" on the first step). FSDP2 (the engine torch's own DTensor-aware
``replicate`` is built on; torchtitan does the same) runs over the 2-D ``(dp_replicate,
dp_shard)`` sub-mesh:

    stage 0 (DP+TP)    ``dp_shard`` = 1: replicate-only: each rank keeps whole (TP-local)
                       parameters and gradients are all-reduced over ``dp_replicate``, as DDP.
                       Cost over DDP (torch 2.13's FSDP2, read in _fsdp_param_group.py): with
                       a shard group of one it skips the all-gather but still copies the
                       parameters into an unsharded buffer, held from forward to the end of
                       backward — one more parameter copy than DDP during the step
                       (`LayoutCosts.extra_param_copies`).
    stage 1 (ZeRO-1)   ``reshard_after_forward=False`` and gradients reduced on the last
                       micro-batch only (sync_each_batch must stay off): during the step a
                       rank holds what ZeRO-1 holds (whole parameters and gradients) and the
                       optimizer state is 1/dp_shard; the all-reduce + broadcast of ZeRO-1
                       become a reduce-scatter + all-gather of the same volume.
    stages 2 and 3     as without ``tp``.

Data-parallel ranks are ``dp_replicate x dp_shard``: all of them see different data, so
gathering, reducing and data-loader sharding use the flattened group of both axes. The
``tp`` ranks of one data-parallel group see the same batch, so ``tp`` never enters them.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, get_args

from meshfit.distributed.dims import AXES, ParallelDims

if TYPE_CHECKING:  # torch loads when a model or a mesh is at hand: a layout is checked without it
    import torch

__all__ = ["AVAILABLE_AXES", "Candidate", "Engine", "Layout", "LayoutCosts", "MixedPrecision",
           "ModelFacts", "Offload", "ZERO_STAGES", "check_options", "precision_dtype"]

# Axes whose techniques exist today; the others are planned (see the README's feature table).
AVAILABLE_AXES = ("pp", "dp_replicate", "dp_shard", "tp", "ep")
_DP_AXES = ("dp_replicate", "dp_shard")
ZERO_STAGES = (0, 1, 2, 3)
Offload = Literal["none", "cpu"]
MixedPrecision = Literal["no", "bf16", "fp16"]


def precision_dtype(mode: str) -> torch.dtype | None:
    """The low-precision compute dtype of a `MixedPrecision` mode (None for "no")."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mode)


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


# Field names in errors are the Accelerator's keywords unless the caller passes its own
# spellings (`meshfit train` passes its config keys: `meshfit.train.config.LAYOUT_NAMES`).
def _namer(names: Mapping[str, str] | None):
    names = names or {}
    return lambda key: names.get(key, key)


# ----------------------------------------------------------------------------- the options
def _options_problem(*, zero_stage, offload, sync_each_batch, mixed_precision,
                     sequence_parallel, loss_parallel, n, dims=None) -> str | None:
    """Values that are wrong whatever the layout."""
    if dims is not None and not isinstance(dims, ParallelDims):
        return f"{n('parallel')}={dims!r} must be a meshfit.ParallelDims"
    if zero_stage is not None and (isinstance(zero_stage, bool) or zero_stage not in ZERO_STAGES):
        return (f"{n('zero_stage')}={zero_stage!r} must be 0 (DDP), 1, 2 or 3 (unset: 3 when "
                "dp_shard > 1, else 0)")
    if offload not in get_args(Offload):
        return f"{n('offload')}={offload!r} is not one of 'none', 'cpu'"
    if offload == "cpu" and zero_stage is not None and zero_stage < 3:
        return (f"{n('offload')}='cpu' needs zero_stage=3 (FSDP2 offloads the sharded "
                f"parameters and their state), got {n('zero_stage')}={zero_stage}; set "
                "zero_stage=3 or offload='none'")
    if not (sync_each_batch is True or sync_each_batch is False or sync_each_batch == "auto"):
        return f"{n('sync_each_batch')}={sync_each_batch!r} must be true, false or 'auto'"
    if mixed_precision not in get_args(MixedPrecision):
        return (f"{n('mixed_precision')}={mixed_precision!r} is not a precision meshfit knows; "
                f"use one of {', '.join(repr(v) for v in get_args(MixedPrecision))}")
    for key, value in (("sequence_parallel", sequence_parallel),
                       ("loss_parallel", loss_parallel)):
        if not isinstance(value, bool):
            return f"{n(key)}={value!r} must be true or false"
    return None


def check_options(*, parallel=None, zero_stage=None, offload="none", sync_each_batch=False,
                  mixed_precision="no", sequence_parallel=False, loss_parallel=False,
                  names: Mapping[str, str] | None = None) -> None:
    """One-line ValueError for an option value that is wrong whatever the layout (usable
    before the world size is known, e.g. when a config file is read)."""
    problem = _options_problem(dims=parallel, zero_stage=zero_stage, offload=offload,
                               sync_each_batch=sync_each_batch, mixed_precision=mixed_precision,
                               sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
                               n=_namer(names))
    if problem:
        raise ValueError(problem)


# ----------------------------------------------------------------------------- the rules
@dataclass(frozen=True)
class _Request:
    dims: ParallelDims  # resolved
    stage: int
    offload: str
    mixed_precision: str
    sequence_parallel: bool
    loss_parallel: bool
    ddp_kwargs: bool
    engine: Engine


def _axes_available(r: _Request, n) -> str | None:
    planned = [a for a in r.dims.enabled() if a not in AVAILABLE_AXES]
    if planned:
        sizes = ", ".join(f"{a}={getattr(r.dims, a)}" for a in planned)
        return (f"{n('parallel')}: {sizes}: this axis is not yet available in meshfit; use the "
                "data-parallel axes (dp_replicate, dp_shard), tp, pp and ep for now")
    return None


def _ep_rules(r: _Request, n) -> str | None:
    if r.dims.ep == 1:
        return None
    if r.dims.tp > 1:
        return (f"{n('ep')}={r.dims.ep} with {n('tp')}={r.dims.tp} is not yet available in "
                "meshfit (the experts would have to be replicated or split over the "
                "tensor-parallel ranks); use ep with the data-parallel axes and pp, or tp "
                "without ep")
    if r.stage == 0:
        return (f"{n('zero_stage')}=0 with {n('ep')}={r.dims.ep}: expert parallelism runs on "
                f"the sharded data-parallel ranks (FSDP2); use zero_stage 1, 2 or 3")
    return None


def _stage_needs_shards(r: _Request, n) -> str | None:
    if r.stage > 0 and r.dims.dp_shard == 1:
        return (f"{n('zero_stage')}={r.stage} shards over the dp_shard axis, which has size 1; "
                f"set {n('dp_shard')} > 1 or zero_stage=0")
    if r.stage == 0 and r.dims.dp_shard > 1:
        return (f"{n('zero_stage')}=0 (DDP) shards nothing, but {n('dp_shard')}="
                f"{r.dims.dp_shard}; use dp_replicate for plain data parallel, or zero_stage "
                "1, 2 or 3")
    return None


def _offload_needs_stage3(r: _Request, n) -> str | None:
    if r.offload == "cpu" and r.stage < 3:
        return (f"{n('offload')}='cpu' needs zero_stage=3, and this layout resolves to "
                f"zero_stage={r.stage}; set {n('dp_shard')} > 1 and zero_stage=3, or "
                "offload='none'")
    return None


def _tp_options_need_tp(r: _Request, n) -> str | None:
    for key in ("sequence_parallel", "loss_parallel"):
        if getattr(r, key) and r.dims.tp == 1:
            return f"{n(key)}=true needs {n('tp')} > 1 (tensor parallel); set tp or drop it"
    return None


def _not_yet_with_pp(r: _Request, n) -> str | None:
    if r.dims.pp == 1:
        return None
    if r.loss_parallel:
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


def _ddp_kwargs_need_ddp(r: _Request, n) -> str | None:
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


_RULES = (_axes_available, _ep_rules, _stage_needs_shards, _offload_needs_stage3, _tp_options_need_tp,
          _not_yet_with_pp, _ddp_kwargs_need_ddp)


def _warnings(dims: ParallelDims, stage: int, local_world_size: int | None) -> tuple[str, ...]:
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


def _engine(dims: ParallelDims, stage: int, distributed: bool) -> Engine:
    if not distributed:
        return Engine.NONE
    model_parallel = dims.tp > 1 or dims.pp > 1 or dims.ep > 1
    if model_parallel and dims.dp == 1:
        return Engine.NONE
    if model_parallel:
        return Engine.FSDP2_REPLICATE if dims.dp_shard == 1 else Engine.FSDP2
    if stage >= 2:
        return Engine.FSDP2
    return Engine.DDP if stage == 0 else Engine.ZERO1


def _mesh_axes(dims: ParallelDims) -> tuple[str, ...]:
    # Axes of size 1 are dropped, except the data-parallel ones: with tp or pp both are kept
    # (the data-parallel wrapper of a model-parallel model is FSDP2 over the 2-D
    # (dp_replicate, dp_shard) sub-mesh); otherwise dp_replicate is kept when no data-parallel
    # axis is larger, so that a one-process job still has a mesh to pass around.
    keep = set(_DP_AXES) if dims.tp > 1 or dims.pp > 1 else set()
    if not any(a in _DP_AXES for a in dims.enabled()):
        keep.add("dp_replicate")
    return tuple(a for a in AXES if getattr(dims, a) > 1 or a in keep)


# ----------------------------------------------------------------------------- costs
@dataclass(frozen=True, kw_only=True)
class LayoutCosts:
    """How the data-parallel engine divides and copies the model states on one rank, as
    multipliers of the model's own sizes (tensor parallel divides them further by the TP
    plan; `meshfit.memory.zero_formula` is the same arithmetic without tp/pp)."""

    param_shards: int
    """Ranks a parameter is split over between steps (FSDP2: dp_shard, at stage 2 too)."""
    grad_shards: int
    """Ranks a synchronised gradient is split over after the reduction."""
    optimizer_shards: int
    """Ranks the optimizer state is split over (stage >= 1: dp_shard)."""
    optimizer_partition: Literal["none", "whole_parameters", "elements"]
    """ZeRO-1 partitions whole parameters greedily (uneven when a few tensors dominate);
    FSDP2 splits every parameter per element (balanced)."""
    whole_grads_until_boundary: bool
    """Gradients are kept whole while accumulating micro-batches (reduced on the last)."""
    gathered_params: Literal["none", "one_block", "all_blocks"]
    """Parameters gathered during the step: one block at a time (stage 3) or every block
    from its forward to its backward (stage 2, stage 1 under tp/pp)."""
    extra_param_copies: int
    """Parameter copies held beyond the engine's own during the step (replicate-only FSDP2
    copies the parameters into an unsharded buffer from forward to backward: 1)."""
    host_offload: bool
    """Sharded parameters, gradients and optimizer state live in host memory."""
    grad_reduction: Literal["none", "all_reduce", "reduce_scatter", "reduce_scatter+all_reduce"]
    """The gradient collective of one optimizer step (HSDP: reduce-scatter inside a shard
    group, all-reduce across the replicas)."""


def _costs(dims: ParallelDims, engine: Engine, stage: int, offload: bool) -> LayoutCosts:
    fsdp = engine in (Engine.FSDP2, Engine.FSDP2_REPLICATE)
    shards = dims.dp_shard if fsdp else 1
    if engine is Engine.NONE:
        reduction = "none"
    elif engine is Engine.FSDP2 and dims.dp_replicate > 1:
        reduction = "reduce_scatter+all_reduce"
    elif engine is Engine.FSDP2:
        reduction = "reduce_scatter"
    else:
        reduction = "all_reduce"
    gathered = "none"
    if engine is Engine.FSDP2:
        gathered = "one_block" if stage == 3 else "all_blocks"
    return LayoutCosts(
        param_shards=shards, grad_shards=shards,
        optimizer_shards=dims.dp_shard if stage >= 1 else 1,
        optimizer_partition="elements" if engine is Engine.FSDP2 else
        "whole_parameters" if engine is Engine.ZERO1 else "none",
        whole_grads_until_boundary=not fsdp or stage < 2, gathered_params=gathered,
        extra_param_copies=1 if engine is Engine.FSDP2_REPLICATE else 0,
        host_offload=offload, grad_reduction=reduction)


# ----------------------------------------------------------------------------- the model
@dataclass(frozen=True, kw_only=True)
class ModelFacts:
    """What the layout rules need to know of a model (no weights needed)."""

    n_blocks: int
    """Transformer blocks: pipeline stages are cut between them."""
    divisible: tuple[tuple[str, int, str], ...] = ()
    """(field, size, kind) that the tensor-parallel degree must divide (heads, widths,
    vocabulary: the model's TP plan says which)."""
    experts: tuple[int, ...] = ()
    """Experts of each mixture-of-experts block (`meshfit.models.MoE`) that expert
    parallelism can split; () for a dense model."""

    @classmethod
    def of(cls, model: torch.nn.Module, *, pipeline_plan=None, tp_plan=None) -> ModelFacts:
        """The facts of `model` (a meta-device model is enough), from its plans: the given
        ones, else the built-in ones of its type (a model without a built-in TP plan states
        no sizes; `apply_tp` then checks the plan it is given)."""
        from meshfit.models.plans import TPPlan, has_builtin_plans, pipeline_plan_for, plan_for

        builtin = has_builtin_plans(model)
        if pipeline_plan is None and not builtin:
            raise ValueError(f"no built-in pipeline plan for {type(model).__name__}; pass "
                             "plan=PipelinePlan(blocks=..., first=..., last=...)")
        pipeline_plan = pipeline_plan or pipeline_plan_for(model)
        if isinstance(tp_plan, TPPlan):
            divisible = tuple(tp_plan.divisible)
        else:
            divisible = tuple(plan_for(model).divisible) if builtin and tp_plan is None else ()
        from meshfit.parallel.ep import moe_modules

        return cls(n_blocks=len(pipeline_plan.blocks_of(model)), divisible=divisible,
                   experts=tuple(m.n_experts for m in moe_modules([model])))


# ----------------------------------------------------------------------------- the layout
@dataclass(frozen=True, kw_only=True)
class Layout:
    """A resolved, valid layout: build it with `Layout.resolve`."""

    dims: ParallelDims
    """The mesh sizes, resolved against the world size."""
    engine: Engine
    zero_stage: int
    """0 (nothing sharded) to 3; the engine's stage (0 also for `Engine.NONE`)."""
    offload: bool
    """Sharded states in host memory (stage 3 only)."""
    mixed_precision: str
    sequence_parallel: bool = False
    loss_parallel: bool = False
    mesh_axes: tuple[str, ...] = ()
    """The device mesh's named axes, outermost first (`build_mesh`)."""
    warnings: tuple[str, ...] = ()
    """Layouts that work but that the guide advises against, with the reason."""
    costs: LayoutCosts = field(default=None)  # type: ignore[assignment]

    # ------------------------------------------------------------------ resolving
    @classmethod
    def resolve(cls, dims: ParallelDims | None = None, world_size: int = 1, *,
                distributed: bool = True, zero_stage: int | None = None,
                offload: str = "none", mixed_precision: str = "no",
                sequence_parallel: bool = False, loss_parallel: bool = False,
                ddp_kwargs: Mapping | None = None, local_world_size: int | None = None,
                names: Mapping[str, str] | None = None) -> Layout:
        """The layout of `dims` on `world_size` processes, or a one-line ValueError.

        `distributed=False`: a single process with no process group (no engine at all).
        `zero_stage`: None means 3 when dp_shard > 1, else 0. `local_world_size`: processes
        per node, for the warning about tensor-parallel groups that cross nodes. `names`:
        how the caller spells each field in errors (e.g. ``{"zero_stage":
        "parallel.zero_stage"}``)."""
        out = cls._decide(dims, world_size, distributed=distributed, zero_stage=zero_stage,
                          offload=offload, mixed_precision=mixed_precision,
                          sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
                          ddp_kwargs=bool(ddp_kwargs), local_world_size=local_world_size,
                          names=names)
        if isinstance(out, str):
            raise ValueError(out)
        return out

    @classmethod
    def _decide(cls, dims, world_size, *, distributed, zero_stage, offload, mixed_precision,
                sequence_parallel, loss_parallel, ddp_kwargs, local_world_size,
                names) -> Layout | str:
        n = _namer(names)
        problem = _options_problem(dims=dims, zero_stage=zero_stage, offload=offload,
                                   sync_each_batch=False, mixed_precision=mixed_precision,
                                   sequence_parallel=sequence_parallel,
                                   loss_parallel=loss_parallel, n=n)
        if problem:
            return problem
        dims = (dims or ParallelDims()).resolve(world_size)  # its own size checks
        stage = zero_stage if zero_stage is not None else (3 if dims.dp_shard > 1 else 0)
        engine = _engine(dims, stage, distributed)
        request = _Request(dims, stage, offload, mixed_precision, sequence_parallel,
                           loss_parallel, ddp_kwargs, engine)
        for rule in _RULES:
            problem = rule(request, n)
            if problem:
                return problem
        return cls(dims=dims, engine=engine, zero_stage=stage, offload=offload == "cpu",
                   mixed_precision=mixed_precision, sequence_parallel=sequence_parallel,
                   loss_parallel=loss_parallel, mesh_axes=_mesh_axes(dims),
                   warnings=_warnings(dims, stage, local_world_size),
                   costs=_costs(dims, engine, stage, offload == "cpu"))

    # ------------------------------------------------------------------ facts
    @property
    def is_data_parallel(self) -> bool:
        return self.engine is not Engine.NONE

    @property
    def is_fsdp(self) -> bool:
        return self.engine in (Engine.FSDP2, Engine.FSDP2_REPLICATE)

    @property
    def owns_mixed_precision(self) -> bool:
        """The engine computes in low precision itself (FSDP's MixedPrecisionPolicy), so no
        autocast goes around the model."""
        return self.is_fsdp

    @property
    def param_dtype(self) -> torch.dtype | None:
        """The compute dtype of gathered parameters under FSDP's policy (None: as stored)."""
        return precision_dtype(self.mixed_precision) if self.is_fsdp else None

    @property
    def reshard_after_forward(self) -> bool:
        """FSDP2 frees a block's gathered parameters after its forward (stage 3)."""
        return self.zero_stage == 3

    @property
    def dp_axes(self) -> tuple[str, ...]:
        """The mesh axes whose ranks see different data (flattened into one group)."""
        return tuple(a for a in _DP_AXES if a in self.mesh_axes)

    @property
    def fsdp_axes(self) -> tuple[str, ...]:
        """FSDP2's mesh: it shards over the last axis and replicates over the first (HSDP);
        replicate-only keeps a size-1 shard axis, a size-1 replicate axis is dropped."""
        if self.dims.dp_replicate == 1 and self.dims.dp_shard > 1:
            return ("dp_shard",)
        return _DP_AXES

    def _forward_collective(self) -> tuple[str, int, str] | None:
        if self.dims.pp > 1:
            return "pp", self.dims.pp, "the pipeline stages exchange activations in forward"
        if self.dims.tp > 1:
            return "tp", self.dims.tp, "the tensor-parallel all-reduces in forward"
        if self.dims.ep > 1:
            return "ep", self.dims.ep, "the experts' all-to-alls in forward"
        if self.zero_stage >= 2:
            return "zero_stage", self.zero_stage, "FSDP's all-gathers in forward"
        return None

    @property
    def forward_collectives(self) -> str | None:
        """Why this layout's forward pass communicates (None: it does not). A rank that
        fails in such a forward (say, out of memory) leaves the others waiting."""
        found = self._forward_collective()
        return None if found is None else f"{found[0]}={found[1]}: {found[2]}"

    def describe(self) -> str:
        """e.g. ``"ZeRO-3 (FSDP2) on dp_shard 4 x tp 2"``."""
        engine = {Engine.NONE: "no data-parallel wrapper", Engine.DDP: "DDP",
                  Engine.ZERO1: "ZeRO-1 (DDP + ZeroRedundancyOptimizer)",
                  Engine.FSDP2: f"ZeRO-{self.zero_stage} (FSDP2)",
                  Engine.FSDP2_REPLICATE: "replicate-only FSDP2"}[self.engine]
        mesh = " x ".join(f"{a} {getattr(self.dims, a)}" for a in self.dims.enabled())
        return f"{engine} on {mesh}" if mesh else engine

    # ------------------------------------------------------------------ model rules
    def check_model(self, facts: ModelFacts, *, seq_len: int | None = None,
                    schedule: str = "1f1b", microbatches: int | None = None,
                    virtual_stages: int | None = None,
                    names: Mapping[str, str] | None = None) -> None:
        """One-line ValueError when the model does not fit this layout: sizes that tp must
        divide, a sequence length sequence parallel cannot split, pipeline stages the
        blocks cannot fill (with `schedule`/`microbatches`/`virtual_stages` when known)."""
        problem = self.model_problem(facts, seq_len=seq_len, schedule=schedule,
                                     microbatches=microbatches, virtual_stages=virtual_stages,
                                     names=names)
        if problem:
            raise ValueError(problem)

    def model_problem(self, facts: ModelFacts, *, seq_len=None, schedule="1f1b",
                      microbatches=None, virtual_stages=None, names=None) -> str | None:
        from meshfit.models.plans import divisibility_problem
        from meshfit.parallel.pp import pipeline_problem

        n, tp, pp, ep = _namer(names), self.dims.tp, self.dims.pp, self.dims.ep
        if ep > 1:
            if not facts.experts:
                return (f"{n('ep')}={ep} needs a mixture-of-experts model, and this one has no "
                        "MoE blocks of meshfit's reference GPT (set its n_experts, e.g. the "
                        f"moe-tiny preset), or set {n('ep')}=1")
            bad = next((e for e in facts.experts if e % ep), None)
            if bad is not None:
                return (f"{n('ep')}={ep} must divide the number of experts ({bad}): each ep "
                        f"rank holds n_experts / ep of them; use an ep that divides {bad}")
        if tp > 1:
            problem = divisibility_problem(facts.divisible, tp)
            if problem:
                return f"{n('tp')}: {problem}" if names else problem
            if self.sequence_parallel and seq_len is not None and seq_len % tp:
                return (f"{n('seq_len')}={seq_len} does not divide by {n('tp')}={tp}, which "
                        f"{n('sequence_parallel')}=true needs; use a multiple of {tp}")
        if pp > 1:
            problem = pipeline_problem(facts.n_blocks, pp, schedule=schedule,
                                       microbatches=pp if microbatches is None else microbatches,
                                       virtual_stages=virtual_stages, names=names)
            if problem:
                return problem
        return None

    def check_batch_probe(self, names: Mapping[str, str] | None = None) -> None:
        """Refuse probing the micro-batch size per rank (`find_executable_batch_size`) when
        the forward pass communicates: one rank running out of memory would strand the
        others in a collective."""
        found = self._forward_collective()
        if found:
            n, (key, value, why) = _namer(names), found
            raise ValueError(f"{n('find_batch_size')}=true is not supported with {n(key)}="
                             f"{value}: {why} would leave the other ranks waiting when one runs "
                             f"out of memory; set {n('find_batch_size')}=false and size the "
                             "micro-batch yourself")

    # ------------------------------------------------------------------ the mesh
    def build_mesh(self, device_type: str):
        """The `DeviceMesh` of this layout over the default process group (a collective)."""
        from torch.distributed.device_mesh import init_device_mesh

        ep = self.dims.ep
        names, shape = [], []
        for a in self.mesh_axes:
            if a == "ep":
                continue
            if a == "dp_shard" and ep > 1:
                # ep is the inner part of dp_shard: each group of ep consecutive dp_shard
                # ranks splits the experts; "dp_shard" is the flattened whole.
                names += ["dp_shard_mod_ep", "ep"]
                shape += [self.dims.dp_shard // ep, ep]
            else:
                names.append(a)
                shape.append(getattr(self.dims, a))
        mesh = init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))
        if ep > 1:
            mesh[("dp_shard_mod_ep", "ep")]._flatten("dp_shard")
        return mesh

    def dp_mesh(self, mesh):
        """The 1-D mesh of all data-parallel ranks (dp_replicate x dp_shard flattened)."""
        axes = self.dp_axes
        return _slice(mesh, axes[0]) if len(axes) == 1 else _slice(mesh, axes)._flatten("dp")

    def fsdp_mesh(self, mesh):
        axes = self.fsdp_axes
        return _slice(mesh, axes[0]) if len(axes) == 1 else _slice(mesh, axes)

    def expert_fsdp_mesh(self, mesh):
        """Under ep: the mesh FSDP2 shards the experts over, the data-parallel ranks that hold
        the same experts ((dp_replicate, dp_shard / ep), sizes of 1 dropped); None when no
        rank but this one holds them (dp_replicate = 1, dp_shard = ep)."""
        if mesh is None or self.dims.ep == 1:
            return None
        axes = tuple(a for a, size in (("dp_replicate", self.dims.dp_replicate),
                                       ("dp_shard_mod_ep", self.dims.dp_shard // self.dims.ep))
                     if size > 1)
        if not axes:
            return None
        return _slice(mesh, axes[0]) if len(axes) == 1 else _slice(mesh, axes)

    def axis_mesh(self, mesh, axis: str):
        """The 1-D sub-mesh of `axis` ("tp", "pp", "dp_shard"), or None without that axis."""
        return _slice(mesh, axis) if mesh is not None and axis in self.mesh_axes else None

    # ------------------------------------------------------------------ enumeration
    @classmethod
    def candidates(cls, world_size: int, facts: ModelFacts, *, mixed_precision: str = "no",
                   zero_stages: tuple[int, ...] = ZERO_STAGES, offload: bool = True,
                   sequence_parallel: bool = True, local_world_size: int | None = None,
                   seq_len: int | None = None) -> Iterator[Candidate]:
        """Every layout of `world_size` processes for a model with `facts`: each split of
        the world into pp x dp_replicate x dp_shard x tp, each ZeRO stage (and stage 3 with
        CPU offload), with and without sequence parallel when tp > 1. A refused layout comes
        with its reason (the first rule it breaks) and no `layout`."""
        for pp, dp_replicate, dp_shard, tp in _splits(world_size, 4):
            dims = ParallelDims(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp)
            for stage in zero_stages:
                for off in ("none", "cpu") if offload and stage == 3 else ("none",):
                    for sp in (False, True) if sequence_parallel and tp > 1 else (False,):
                        options = dict(zero_stage=stage, offload=off, sequence_parallel=sp)
                        out = cls._decide(dims, world_size, distributed=True,
                                          mixed_precision=mixed_precision, loss_parallel=False,
                                          ddp_kwargs=False, local_world_size=local_world_size,
                                          names=None, **options)
                        if not isinstance(out, str):
                            problem = out.model_problem(facts, seq_len=seq_len)
                            out = problem or out
                        yield Candidate(dims=dims, options=options,
                                        layout=None if isinstance(out, str) else out,
                                        refused=out if isinstance(out, str) else None)


def _slice(mesh, axes):
    """``mesh[axes]``. Under ep, ``dp_shard`` is the flattened (dp_shard_mod_ep, ep) pair,
    and torch 2.13 warns on every slice of a flattened dimension that it "will be
    deprecated in PT 2.11" — while still supporting it; the warning is not the user's."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        return mesh[axes]


@dataclass(frozen=True)
class Candidate:
    """One layout `Layout.candidates` considered: `layout` when legal, else `refused`."""

    dims: ParallelDims
    options: dict
    layout: Layout | None
    refused: str | None


def _splits(n: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every ordered factorisation of `n` into `parts` positive factors."""
    if parts == 1:
        yield (n,)
        return
    for d in (d for d in range(1, n + 1) if n % d == 0):
        for rest in _splits(n // d, parts - 1):
            yield (d, *rest)

