"""`Layout`: the one decision of how a job is laid out, made once, before any model work.

`Layout.resolve` takes a `LayoutRequest` whole (the mesh sizes and the options that change
how the engines work: ZeRO stage, offload, sequence / loss parallel, the pipeline's schedule),
the world size and what the caller adds (mixed precision, DDP keywords), checks every rule
(one-line `ValueError`s naming the field, the value and the fix; each rule written once, in
`rules.py`) and returns a frozen description that keeps the request, resolved:

- the **engine** that keeps the data-parallel replicas in step (`Engine`, one per ZeRO
  stage and model-parallel case);
- the **mesh axes** and the sub-meshes each technique runs on;
- the **warnings** for layouts that work but that the guide advises against;
- the **costs** a planner reads (`LayoutCosts`): how the engine divides parameters,
  gradients and optimizer state, what it gathers during the step, and what it keeps extra.

`Layout.check_model` adds the rules that need the model, and `Layout.candidates` enumerates
every layout of a world size for a model. `meshfit train`'s preflight, `Accelerator` and
`Accelerator.prepare_pipeline` all go through here; nothing else re-validates a layout.

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

from collections.abc import Iterator, Mapping
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from meshfit.distributed.dims import ParallelDims
from meshfit.parallel import mesh as meshes
from meshfit.parallel.costs import LayoutCosts, costs_for
from meshfit.parallel.request import LayoutRequest
from meshfit.parallel.rules import (DP_AXES, ZERO_STAGES, Engine, Resolved, default_zero_stage,
                                    engine_for, first_problem, layout_warnings, mesh_axes_for,
                                    namer, precision_problem)

if TYPE_CHECKING:  # torch loads when a model or a mesh is at hand: a layout is checked without it
    import torch

# Engine and LayoutCosts (rules.py, costs.py) are part of what a `Layout` holds.
__all__ = ["Candidate", "Engine", "Layout", "LayoutCosts", "ModelFacts", "check_precision",
           "precision_dtype"]


def precision_dtype(mode: str) -> torch.dtype | None:
    """The low-precision compute dtype of a mixed-precision mode (None for "no")."""
    import torch  # here: torch-free at import (TORCH_FREE, tests/test_architecture.py)

    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mode)


def check_precision(mode: str, names: Mapping[str, str] | None = None) -> None:
    """One-line ValueError for a mixed-precision mode the layouts do not know (usable before
    the world size is known, e.g. when a config file is read)."""
    problem = precision_problem(mode, namer(names))
    if problem:
        raise ValueError(problem)


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
    """Experts of each mixture-of-experts block (`meshfit.models.MoE`, a transformers MoE's
    routed experts: `meshfit.parallel.ep.moe_modules`) that expert parallelism can split;
    () for a dense model."""

    @classmethod
    def of(cls, model: torch.nn.Module, *, pipeline_plan=None, tp_plan=None) -> ModelFacts:
        """The facts of `model` (a meta-device model is enough), from its plans: the given
        ones, else the built-in ones of its type (a model without a built-in TP plan states
        no sizes; `apply_tp` then checks the plan it is given)."""
        # here: the plans and ep.py import torch, and this module is torch-free (TORCH_FREE)
        from meshfit.models.plans import (TPPlan, adapted_model, has_builtin_plans,
                                          pipeline_plan_for, plan_for)
        from meshfit.parallel.ep import moe_modules

        model = adapted_model(model)  # LoRA changes no block, head or width
        builtin = has_builtin_plans(model)
        if pipeline_plan is None and not builtin:
            raise ValueError(f"no built-in pipeline plan for {type(model).__name__}; pass "
                             "plan=PipelinePlan(blocks=..., first=..., last=...)")
        pipeline_plan = pipeline_plan or pipeline_plan_for(model)
        if isinstance(tp_plan, TPPlan):
            divisible = tuple(tp_plan.divisible)
        else:
            divisible = tuple(plan_for(model).divisible) if builtin and tp_plan is None else ()
        return cls(n_blocks=len(pipeline_plan.blocks_of(model)), divisible=divisible,
                   experts=tuple(m.n_experts for m in moe_modules([model])))


# ----------------------------------------------------------------------------- the layout
@dataclass(frozen=True, kw_only=True)
class Layout:
    """A resolved, valid layout: build it with `Layout.resolve`."""

    request: LayoutRequest
    """What was asked, whole, with every mesh size and the ZeRO stage resolved (the type
    asked with: a `meshfit train` [parallel] section stays one)."""
    dims: ParallelDims
    """The mesh sizes, resolved against the world size."""
    engine: Engine
    mixed_precision: str
    mesh_axes: tuple[str, ...] = ()
    """The device mesh's named axes, outermost first (`build_mesh`)."""
    warnings: tuple[str, ...] = ()
    """Layouts that work but that the guide advises against, with the reason."""
    costs: LayoutCosts = field(default=None)  # type: ignore[assignment]

    # ------------------------------------------------------------------ resolving
    @classmethod
    def resolve(cls, request: LayoutRequest | None = None, world_size: int = 1, *,
                distributed: bool = True, mixed_precision: str = "no",
                ddp_kwargs: Mapping | None = None, local_world_size: int | None = None,
                names: Mapping[str, str] | None = None) -> Layout:
        """The layout of `request` (default: every rank on dp_replicate) on `world_size`
        processes, or a one-line ValueError.

        `distributed=False`: a single process with no process group (no engine at all).
        `mixed_precision` and `ddp_kwargs` (given or not) are the caller's, which rules read
        too. `local_world_size`: processes per node, for the warning about tensor-parallel
        groups that cross nodes. `names`: how the caller spells each field in errors (e.g.
        ``{"zero_stage": "parallel.zero_stage"}``)."""
        out = cls._decide(request or LayoutRequest(), world_size, distributed=distributed,
                          mixed_precision=mixed_precision, ddp_kwargs=bool(ddp_kwargs),
                          local_world_size=local_world_size, names=names)
        if isinstance(out, str):
            raise ValueError(out)
        return out

    @classmethod
    def _decide(cls, request: LayoutRequest, world_size: int, *, distributed: bool,
                mixed_precision: str, ddp_kwargs: bool, local_world_size: int | None,
                names) -> Layout | str:
        n = namer(names)
        if not isinstance(request, LayoutRequest):
            return (f"{n('parallel')}={request!r} must be a meshfit LayoutRequest (the "
                    "mesh sizes and the layout's options, whole)")
        problem = precision_problem(mixed_precision, n)  # (the request checked itself)
        if problem:
            return problem
        dims = request.dims().resolve(world_size)  # its own size checks
        stage = request.zero_stage if request.zero_stage is not None \
            else default_zero_stage(dims.dp_shard)
        engine = engine_for(dims, stage, distributed)
        resolved = dataclasses.replace(request, **dims.sizes(), zero_stage=stage)
        problem = first_problem(Resolved(resolved, dims, stage, mixed_precision, ddp_kwargs,
                                         engine), n)
        if problem:
            return problem
        host = request.offload == "cpu" or request.offload_params  # (files held on the host)
        return cls(request=resolved, dims=dims, engine=engine, mixed_precision=mixed_precision,
                   mesh_axes=mesh_axes_for(dims),
                   warnings=layout_warnings(dims, stage, local_world_size),
                   costs=costs_for(dims, engine, stage, host))

    # ------------------------------------------------------------------ facts
    @property
    def zero_stage(self) -> int:
        """0 (nothing sharded) to 3; the engine's stage (0 also for `Engine.NONE`)."""
        return self.request.zero_stage

    @property
    def host_offload(self) -> bool:
        """Sharded states held in host memory: CPU offload (stage 3), or the parameter shards
        in files of offload="disk" (``offload_params``)."""
        return self.request.offload == "cpu" or self.request.offload_params

    @property
    def sequence_parallel(self) -> bool:
        return self.request.sequence_parallel

    @property
    def loss_parallel(self) -> bool:
        return self.request.loss_parallel

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
        return tuple(a for a in DP_AXES if a in self.mesh_axes)

    @property
    def fsdp_axes(self) -> tuple[str, ...]:
        """FSDP2's mesh: it shards over the last axis and replicates over the first (HSDP);
        replicate-only keeps a size-1 shard axis, a size-1 replicate axis is dropped."""
        if self.dims.dp_replicate == 1 and self.dims.dp_shard * self.dims.cp > 1:
            return ("dp_shard",)  # (under cp: `meshfit.parallel.mesh.shard_axis`)
        return DP_AXES

    def _forward_collective(self) -> tuple[str, int, str] | None:
        if self.dims.pp > 1:
            return "pp", self.dims.pp, "the pipeline stages exchange activations in forward"
        if self.dims.tp > 1:
            return "tp", self.dims.tp, "the tensor-parallel all-reduces in forward"
        if self.dims.ep > 1:
            return "ep", self.dims.ep, "the experts' all-to-alls in forward"
        if self.dims.cp > 1:
            return "cp", self.dims.cp, "the ring attention's sends and receives in forward"
        if self.zero_stage >= 2:
            return "zero_stage", self.zero_stage, "FSDP's all-gathers in forward"
        return None

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
                    schedule: str | None = None, microbatches: int | None = None,
                    virtual_stages: int | None = None,
                    names: Mapping[str, str] | None = None) -> None:
        """One-line ValueError when the model does not fit this layout: sizes that tp must
        divide, a sequence length sequence parallel cannot split, pipeline stages the
        blocks cannot fill. The pipeline's `schedule`, `microbatches` and `virtual_stages`
        are the request's unless given (a caller that fills in an unset count, or a planner
        trying other schedules); unset micro-batches count one per stage."""
        problem = self.model_problem(facts, seq_len=seq_len, schedule=schedule,
                                     microbatches=microbatches, virtual_stages=virtual_stages,
                                     names=names)
        if problem:
            raise ValueError(problem)

    def model_problem(self, facts: ModelFacts, *, seq_len=None, schedule=None,
                      microbatches=None, virtual_stages=None, names=None) -> str | None:
        # here: both import torch (pipeline_problem with torch.distributed.pipelining), and
        # this module is torch-free (TORCH_FREE)
        from meshfit.models.plans import divisibility_problem
        from meshfit.parallel.pp import pipeline_problem

        n, tp, pp, ep = namer(names), self.dims.tp, self.dims.pp, self.dims.ep
        if ep > 1:
            if not facts.experts:
                return (f"{n('ep')}={ep} needs a mixture-of-experts model, and this one has no "
                        "MoE blocks (meshfit's reference GPT with n_experts, e.g. the moe-tiny "
                        "preset, or a transformers MoE: Mixtral, Qwen2/3-MoE, GLM-4-MoE, "
                        f"DeepSeek-V3), or set {n('ep')}=1")
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
            r = self.request
            microbatches = microbatches if microbatches is not None else r.microbatches
            problem = pipeline_problem(facts.n_blocks, pp, schedule=schedule or r.schedule,
                                       microbatches=pp if microbatches is None else microbatches,
                                       virtual_stages=virtual_stages or r.virtual_stages,
                                       names=names)
            if problem:
                return problem
        return None

    def check_batch_probe(self, names: Mapping[str, str] | None = None) -> None:
        """Refuse probing the micro-batch size per rank (`find_executable_batch_size`) when
        the forward pass communicates: one rank running out of memory would strand the
        others in a collective."""
        found = self._forward_collective()
        if found:
            n, (key, value, why) = namer(names), found
            raise ValueError(f"{n('find_batch_size')}=true is not supported with {n(key)}="
                             f"{value}: {why} would leave the other ranks waiting when one runs "
                             f"out of memory; set {n('find_batch_size')}=false and size the "
                             "micro-batch yourself")

    # ------------------------------------------------------------------ the mesh
    # The mesh and its sub-meshes by axis name (`meshfit.parallel.mesh`), as methods.
    build_mesh = meshes.build_mesh
    dp_mesh = meshes.dp_mesh
    grad_mesh = meshes.grad_mesh
    shard_mesh = meshes.shard_mesh
    shard_axis = property(meshes.shard_axis)
    fsdp_mesh = meshes.fsdp_mesh
    expert_fsdp_mesh = meshes.expert_fsdp_mesh
    axis_mesh = meshes.axis_mesh

    # ------------------------------------------------------------------ enumeration
    @classmethod
    def candidates(cls, world_size: int, facts: ModelFacts, *, mixed_precision: str = "no",
                   zero_stages: tuple[int, ...] = ZERO_STAGES, offload: bool = True,
                   sequence_parallel: bool = True, local_world_size: int | None = None,
                   seq_len: int | None = None) -> Iterator[Candidate]:
        """Every layout of `world_size` processes for a model with `facts`: each split of
        the world into pp x dp_replicate x dp_shard x tp, for a mixture of experts each ep
        inside dp_shard that divides its experts, each ZeRO stage (and stage 3 with CPU
        offload), with and without sequence parallel when tp > 1. A refused layout comes
        with its reason (the first rule it breaks) and no `layout`."""
        for pp, dp_replicate, dp_shard, tp, ep, stage in _with_ep(
                _splits(world_size, 4), facts, zero_stages):
            for off in ("none", "cpu") if offload and stage == 3 else ("none",):
                for sp in (False, True) if sequence_parallel and tp > 1 else (False,):
                    request = LayoutRequest(pp=pp, dp_replicate=dp_replicate,
                                            dp_shard=dp_shard, tp=tp, ep=ep,
                                            zero_stage=stage, offload=off,
                                            sequence_parallel=sp)
                    out = cls._decide(request, world_size, distributed=True,
                                      mixed_precision=mixed_precision, ddp_kwargs=False,
                                      local_world_size=local_world_size, names=None)
                    if not isinstance(out, str):
                        out = out.model_problem(facts, seq_len=seq_len) or out
                    yield Candidate(request=request,
                                    layout=None if isinstance(out, str) else out,
                                    refused=out if isinstance(out, str) else None)


@dataclass(frozen=True)
class Candidate:
    """One layout `Layout.candidates` considered: `layout` when legal, else `refused`."""

    request: LayoutRequest
    layout: Layout | None
    refused: str | None

    @property
    def dims(self) -> ParallelDims:
        """The candidate's mesh sizes (all given: none is left to the remaining ranks)."""
        return self.request.dims()


def _with_ep(splits, facts: ModelFacts, zero_stages) -> Iterator[tuple[int, ...]]:
    """(pp, dp_replicate, dp_shard, tp, ep, stage) for each split and ZeRO stage: ep = 1,
    and for a mixture of experts every ep > 1 dividing dp_shard and its experts (expert
    parallel needs a sharding stage: none at stage 0)."""
    for pp, dp_replicate, dp_shard, tp in splits:
        for stage in zero_stages:
            yield pp, dp_replicate, dp_shard, tp, 1, stage
            for ep in range(2, dp_shard + 1) if facts.experts and stage > 0 else ():
                if dp_shard % ep == 0 and all(e % ep == 0 for e in facts.experts):
                    yield pp, dp_replicate, dp_shard, tp, ep, stage


def _splits(n: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every ordered factorisation of `n` into `parts` positive factors."""
    if parts == 1:
        yield (n,)
        return
    for d in (d for d in range(1, n + 1) if n % d == 0):
        for rest in _splits(n // d, parts - 1):
            yield (d, *rest)

