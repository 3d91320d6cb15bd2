"""Strategies: how a model is wrapped, how its gradients are kept from syncing, over which
group data-parallel results are gathered, what becomes of the optimizer. The accelerator picks
one by the layout's type and delegates to it; it never branches on a strategy name.

    Strategy         one process: the model is moved to the device and left alone.
    DDPStrategy      ZeRO stage 0: DDP over every data-parallel rank.
    ZeRO1Strategy    stage 1: DDP + ZeroRedundancyOptimizer over the ``dp_shard`` ranks.
    FSDPStrategy     stages 2 and 3: FSDP2 over ``dp_shard`` (or ``dp_replicate x dp_shard``:
                     HSDP), optionally offloading to host memory, mixed precision as FSDP's
                     policy.
    TPStrategy       tensor parallel alone (``tp`` > 1, no data-parallel axis): `apply_tp`
                     on ``mesh["tp"]`` and no data-parallel wrapper.

With a ``tp`` axis the model's parameters are DTensors, which DDP and ZeroRedundancyOptimizer
do not take; with a ``pp`` axis torch's schedules run a backward per micro-batch, which
DDP's bucket rebuilding miscounts (measured, torch 2.13: "rebuilt parameter indices size is
not same as original model parameters size" on the first step). So every data-parallel
layout with tp or pp runs on FSDP2 (the engine torch's own DTensor-aware ``replicate`` is
built on; torchtitan does the same), over the 2-D ``(dp_replicate, dp_shard)`` sub-mesh:

    stage 0 (DP+TP)    ``dp_shard`` = 1: replicate-only HSDP: each rank keeps whole (TP-local)
                       parameters and gradients are all-reduced over ``dp_replicate``, as DDP.
                       Cost over DDP (torch 2.13's FSDP2, read in _fsdp_param_group.py): with
                       a shard group of one it skips the all-gather but still copies the
                       parameters into an unsharded buffer, held from forward to the end of
                       backward — one more parameter copy than DDP during the step.
    stage 1 (ZeRO-1)   ``reshard_after_forward=False`` and gradients reduced on the last
                       micro-batch only (sync_each_batch must stay off): during the step a
                       rank holds what ZeRO-1 holds (whole parameters and gradients) and the
                       optimizer state is 1/dp_shard; the all-reduce + broadcast of ZeRO-1
                       become a reduce-scatter + all-gather of the same volume.
    stages 2 and 3     as without ``tp``.

Pipeline parallel (``pp``) cuts the model into stages (`meshfit.parallel.pp`); each stage
module goes through the same `place` -> `parallelize` -> model options -> `wrap_model` as a
whole model does (`Accelerator.prepare_pipeline`), so DP+PP, DP+PP+TP, ZeRO-1+PP+TP and
FSDP+PP are this module's wrappers applied per stage.

Data-parallel ranks are ``dp_replicate x dp_shard``: all of them see different data, so
gathering, reducing and dataloader sharding use the flattened group of both axes. The
``tp`` ranks of one data-parallel group see the same batch, so ``tp`` never enters them.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from meshfit.distributed import DistEnv, ParallelDims
from meshfit.parallel import apply_ddp, apply_fsdp, apply_zero1

# Axes whose strategies exist today; the others are planned (see the README's feature table).
AVAILABLE_AXES = ("pp", "dp_replicate", "dp_shard", "tp")
ZERO_STAGES = (0, 1, 2, 3)
OFFLOAD = ("none", "cpu")
# sync_each_batch="auto" accumulates unsharded gradients (no reduce-scatter between
# micro-batches) when they take at most this share of the free memory: the rest of the step
# (activations, gathered blocks, optimizer state created at the first step) needs the remainder.
AUTO_SYNC_FREE_FRACTION = 0.25
_DP_AXES = ("dp_replicate", "dp_shard")


def check_zero_options(zero_stage, offload, sync_each_batch, *, prefix: str = "") -> None:
    """One-line ValueErrors for values that are wrong whatever the layout."""
    if zero_stage is not None and (isinstance(zero_stage, bool) or zero_stage not in ZERO_STAGES):
        raise ValueError(f"{prefix}zero_stage={zero_stage!r} must be 0 (DDP), 1, 2 or 3 "
                         "(unset: 3 when dp_shard > 1, else 0)")
    if offload not in OFFLOAD:
        raise ValueError(f"{prefix}offload={offload!r} is not one of 'none', 'cpu'")
    if offload == "cpu" and zero_stage is not None and zero_stage < 3:
        raise ValueError(f"{prefix}offload='cpu' needs zero_stage=3 (FSDP2 offloads the "
                         f"sharded parameters and their state), got zero_stage={zero_stage}; "
                         "set zero_stage=3 or offload='none'")
    if not (sync_each_batch is True or sync_each_batch is False or sync_each_batch == "auto"):
        raise ValueError(f"{prefix}sync_each_batch={sync_each_batch!r} must be true, false or "
                         "'auto'")


def resolve_zero_stage(zero_stage: int | None, offload: str, dims: ParallelDims, *,
                       prefix: str = "") -> int:
    """The ZeRO stage of a resolved layout: `zero_stage`, or by default 3 when dp_shard > 1
    and 0 (DDP) otherwise; stages 1-3 shard over the dp_shard axis and need it > 1."""
    check_zero_options(zero_stage, offload, False, prefix=prefix)
    stage = zero_stage if zero_stage is not None else (3 if dims.dp_shard > 1 else 0)
    if stage > 0 and dims.dp_shard == 1:
        raise ValueError(f"{prefix}zero_stage={stage} shards over the dp_shard axis, which has "
                         "size 1; set dp_shard > 1 (e.g. ParallelDims(dp_shard=N)) or "
                         "zero_stage=0")
    if stage == 0 and dims.dp_shard > 1:
        raise ValueError(f"{prefix}zero_stage=0 (DDP) shards nothing, but dp_shard="
                         f"{dims.dp_shard}; use dp_replicate for plain data parallel, or "
                         "zero_stage 1, 2 or 3")
    if offload == "cpu" and stage < 3:
        raise ValueError(f"{prefix}offload='cpu' needs zero_stage=3, and this layout resolves "
                         f"to zero_stage={stage}; set dp_shard > 1 and zero_stage=3, or "
                         "offload='none'")
    return stage


def layout_warnings(dims: ParallelDims, zero_stage: int,
                    local_world_size: int | None = None) -> list[str]:
    """Layouts that work but that the guide advises against, each with the reason
    (`local_world_size`: processes per node, to check that tp stays inside one)."""
    out = []
    if local_world_size and dims.tp > 1 and (dims.tp > local_world_size
                                             or local_world_size % dims.tp):
        out.append(
            f"tp={dims.tp} with {local_world_size} processes per node: tensor-parallel groups "
            "cross nodes, so every block's all-reduces go over the slower inter-node link "
            "(Megatron-LM keeps tp within a node); use a tp that divides the processes per "
            "node and put the rest on pp or the data-parallel axes")
    if dims.pp > 1 and zero_stage >= 2:
        why = (f"zero_stage={zero_stage} with pp={dims.pp}: a pipeline runs a backward per "
               "micro-batch, so gradients sharded per micro-batch would cost a reduce-scatter "
               "each; torch's schedules keep whole gradients until the last micro-batch "
               "instead (DeepSpeed refuses ZeRO-2/3 with its pipeline engine for this reason)")
        if zero_stage == 2:
            out.append(why + ", which makes stage 2 the same as zero_stage=1 here")
        else:
            out.append(why + ", and stage 3 re-gathers every stage's parameters for each "
                       "micro-batch's forward and backward; prefer zero_stage=1")
    return out


class Strategy:
    """A single process: models are moved to the device and otherwise left alone."""

    mesh = None
    tp_mesh = None
    pp_mesh = None
    tp_options: dict = {}
    """Keyword arguments of `apply_tp` (sequence_parallel, loss_parallel)."""
    zero_stage = 0
    owns_mixed_precision = False
    """True when the wrapper computes in low precision itself (FSDP's MixedPrecisionPolicy),
    so the accelerator must not add autocast."""

    def __init__(self, env: DistEnv):
        self.env = env

    @property
    def dp_group(self):
        """Process group over which data-parallel ranks see different data (None: one rank)."""
        return None

    @property
    def dp_rank(self) -> int:
        return 0

    @property
    def dp_size(self) -> int:
        return 1

    def place(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move the materialised model to this rank's device (before the model options)."""
        return model.to(self.env.device)

    def parallelize(self, model: torch.nn.Module) -> torch.nn.Module:
        """Split the placed model across ``mesh["tp"]`` (in place), when the layout has one.
        Runs before activation checkpointing, compile and the data-parallel wrapper."""
        if self.tp_mesh is None:
            return model
        from meshfit.parallel.tp import apply_tp

        return apply_tp(model, self.tp_mesh, **self.tp_options)

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer to step (ZeRO-1: a ZeroRedundancyOptimizer over it)."""
        return optimizer

    def no_sync(self, model: torch.nn.Module):
        return contextlib.nullcontext()

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def auto_sync_each_batch(self, model: torch.nn.Module) -> tuple[bool, str]:
        """sync_each_batch="auto": whether to synchronise every micro-batch, and why."""
        return False, ("gradients are not sharded in this layout, so skipping their "
                       "synchronisation between micro-batches costs no memory")

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's state dict on CPU on global rank 0, {} elsewhere."""
        if self.env.rank != 0:
            return {}
        return {k: v.detach().cpu() for k, v in self.unwrap(model).state_dict().items()}


def _dp_mesh(mesh):
    """The 1-D mesh of all data-parallel ranks (dp_replicate x dp_shard flattened)."""
    axes = tuple(n for n in _DP_AXES if n in (mesh.mesh_dim_names or ()))
    if len(axes) == 1:
        return mesh[axes[0]]
    return mesh[axes]._flatten("dp")


class _DataParallel(Strategy):
    """The layout's mesh and its flattened data-parallel group."""

    def __init__(self, env: DistEnv, dims: ParallelDims):
        super().__init__(env)
        self.dims = dims
        self.mesh = dims.build_mesh(env.device.type)
        self.dp_mesh = _dp_mesh(self.mesh)
        if "tp" in self.mesh.mesh_dim_names:
            self.tp_mesh = self.mesh["tp"]
        if "pp" in self.mesh.mesh_dim_names:
            self.pp_mesh = self.mesh["pp"]

    @property
    def dp_group(self):
        return self.dp_mesh.get_group()

    @property
    def dp_rank(self) -> int:
        return self.dp_mesh.get_local_rank()

    @property
    def dp_size(self) -> int:
        return self.dp_mesh.size()


class DDPStrategy(_DataParallel):
    """Replicated data parallel over every data-parallel rank (ZeRO stage 0)."""

    def __init__(self, env: DistEnv, dims: ParallelDims, *, ddp_kwargs: dict | None = None):
        super().__init__(env, dims)
        self.ddp_kwargs = dict(ddp_kwargs or {})

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        if not any(p.requires_grad for p in model.parameters()):
            return model  # nothing to synchronise (e.g. an evaluation-only model)
        return apply_ddp(model, self.dp_mesh, device=self.env.device, **self.ddp_kwargs)

    def no_sync(self, model: torch.nn.Module):
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return model.no_sync()
        return contextlib.nullcontext()

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return model.module
        return model


class ZeRO1Strategy(DDPStrategy):
    """ZeRO stage 1: DDP over all data-parallel ranks, optimizer state partitioned over the
    ``dp_shard`` ranks by ZeroRedundancyOptimizer (whole parameters, greedily: see
    `meshfit.parallel.zero1`). With dp_replicate > 1 each replica group holds one copy of
    the state, partitioned inside the group."""

    zero_stage = 1

    def __init__(self, env: DistEnv, dims: ParallelDims, *, ddp_kwargs: dict | None = None):
        super().__init__(env, dims, ddp_kwargs=ddp_kwargs)
        self.shard_mesh = self.mesh["dp_shard"]

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        if isinstance(optimizer, ZeroRedundancyOptimizer):
            return optimizer
        return apply_zero1(optimizer, self.shard_mesh.get_group())


class FSDPStrategy(_DataParallel):
    """ZeRO stages 2 and 3 with FSDP2 over ``dp_shard`` (HSDP when dp_replicate > 1 too);
    see `meshfit.parallel.fsdp`. Over a tensor-parallel model also stages 0 (replicate-only:
    dp_shard = 1) and 1 (see the module docstring). Parameters become DTensors: optimizers
    built before `prepare` are re-pointed by the accelerator, by parameter name."""

    owns_mixed_precision = True

    def __init__(self, env: DistEnv, dims: ParallelDims, *, zero_stage: int, offload: bool,
                 param_dtype: torch.dtype | None):
        super().__init__(env, dims)
        self.zero_stage = zero_stage
        self.offload = offload
        self.param_dtype = param_dtype
        # FSDP2 shards over the last dim of its mesh and replicates over the first (HSDP);
        # replicate-only (dp_shard = 1) keeps the size-1 shard axis, a size-1 replicate axis
        # is dropped.
        one_axis = dims.dp_replicate == 1 and dims.dp_shard > 1
        self.fsdp_mesh = self.mesh["dp_shard"] if one_axis else self.mesh[_DP_AXES]

    @property
    def grads_whole_until_boundary(self) -> bool:
        """Stages 0 and 1 keep whole gradients during accumulation (no per-micro-batch
        reduction), which is what distinguishes them from stage 2."""
        return self.zero_stage < 2

    def place(self, model: torch.nn.Module) -> torch.nn.Module:
        # fully_shard moves each unit's parameters to the mesh's device as it shards it, so
        # the whole unsharded model never has to fit on one device.
        return model

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return apply_fsdp(model, self.fsdp_mesh, reshard_after_forward=self.zero_stage == 3,
                          param_dtype=self.param_dtype, offload=self.offload)

    def no_sync(self, model: torch.nn.Module):
        from torch.distributed.fsdp import FSDPModule

        if isinstance(model, FSDPModule):
            return _fsdp_no_sync(model)
        return contextlib.nullcontext()

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model  # fully_shard works in place: the user's module, its parameters DTensors

    def auto_sync_each_batch(self, model: torch.nn.Module) -> tuple[bool, str]:
        if self.grads_whole_until_boundary:
            return super().auto_sync_each_batch(model)
        from meshfit.parallel.fsdp import available_memory_bytes, unsharded_gradient_bytes

        need = unsharded_gradient_bytes(model)
        free = available_memory_bytes(self.env.device)
        fits = free is not None and need <= AUTO_SYNC_FREE_FRACTION * free
        flag = torch.tensor([1 if fits else 0], device=self.env.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # every rank must make the same choice
        fits_everywhere = bool(flag.item())
        where = "unknown" if free is None else f"{free / 2**30:.2f} GiB"
        reason = (f"unsharded gradients need {need / 2**20:.1f} MiB per rank between "
                  f"micro-batches; free memory on this rank {where}, limit "
                  f"{AUTO_SYNC_FREE_FRACTION:.0%} of the free memory on every rank")
        return not fits_everywhere, reason

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return _gathered_state_dict(model)


class TPStrategy(_DataParallel):
    """Model parallel alone (tp and/or pp, data-parallel degree 1): `apply_tp` on
    ``mesh["tp"]`` (see `parallelize`), no data-parallel wrapper (every rank sees the same
    batch). Parameters become DTensors under tp: optimizers built before `prepare` are
    re-pointed by the accelerator, by parameter name."""

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return _gathered_state_dict(model)


def _gathered_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # A collective: every rank all-gathers, rank 0 keeps the CPU copy (PITFALLS #8).
    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


@contextlib.contextmanager
def _fsdp_no_sync(model):
    """No reduce-scatter (nor HSDP all-reduce) in the enclosed backward: FSDP2 accumulates
    unsharded gradients, Ψ·4 bytes per rank until the next synchronised backward."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, *, counted=None,
                    across=None, device: torch.device | None = None) -> torch.Tensor:
    """Clip the gradients' total norm over all ranks; returns the norm (a plain tensor).

    Plain gradients (single process, DDP, ZeRO-1: already all-reduced) and DTensor gradients
    (FSDP2 shards, tensor parallel) both work. Gradients on different meshes (e.g. 2-D dp x
    tp) are grouped by mesh, each group's norm is completed across its mesh, and the norms
    are combined (PITFALLS #5: torch's clip_grad_norm_ fails on mixed meshes).
    `counted`: the parameters whose gradients make up the norm (default: all; a pipeline
    leaves out second copies of tied weights); `across`: a process group holding the other
    parts of the model (pipeline stages), over which the norm is completed — every rank of
    it must call, `device` giving where a rank with no gradients puts its zero.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = [p for p in parameters if p.grad is not None]
    counted = params if counted is None else [p for p in counted if p.grad is not None]
    if not params and across is None:
        return torch.tensor(0.0)
    device = params[0].grad.device if params else (device or torch.device("cpu"))
    total = _local_norm([p.grad for p in counted], norm_type, device)
    if across is not None:  # in float64 on every rank: ranks may hold different dtypes
        dtype, total = total.dtype, total.double()
        if math.isinf(norm_type):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=across)
        else:
            total = total.pow(norm_type)
            dist.all_reduce(total, group=across)
            total = total.pow(1.0 / norm_type)
        total = total.to(dtype)
    if params:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def _local_norm(grads, norm_type: float, device: torch.device) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    groups: dict = {}
    for g in grads:
        key = g.device_mesh if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.zeros((), device=device)
    norms = torch.stack([n.to(device) for n in norms])
    if math.isinf(norm_type):
        return norms.max()
    return norms.pow(norm_type).sum().pow(1.0 / norm_type)


def choose_strategy(env: DistEnv, dims: ParallelDims, *, zero_stage: int | None = None,
                    offload: str = "none", param_dtype: torch.dtype | None = None,
                    ddp_kwargs: dict | None = None) -> Strategy:
    """The strategy for a resolved layout; errors name the axes that are not available yet
    and ZeRO settings that do not fit the layout."""
    planned = [n for n in dims.enabled() if n not in AVAILABLE_AXES]
    if planned:
        sizes = ", ".join(f"{n}={getattr(dims, n)}" for n in planned)
        raise ValueError(f"ParallelDims({sizes}): this axis is not yet available in meshfit; "
                         "use the data-parallel axes (dp_replicate, dp_shard) and tp for now")
    stage = resolve_zero_stage(zero_stage, offload, dims)
    if (dims.tp > 1 or dims.pp > 1) and dims.dp == 1:
        if ddp_kwargs:
            raise ValueError(f"ddp_kwargs={ddp_kwargs!r} apply to DDP, which a layout without "
                             "a data-parallel axis does not use; drop them")
        return TPStrategy(env, dims)
    if not env.is_distributed:
        return Strategy(env)
    if dims.tp > 1 or dims.pp > 1 or stage >= 2:
        # DTensor parameters (tp) and pipeline stages leave FSDP2 as the data-parallel engine
        # (stages 0/1 too: see the module docstring); stages 2/3 are FSDP2 anyway.
        if ddp_kwargs:
            engine = "FSDP2 under tp/pp > 1" if dims.tp > 1 or dims.pp > 1 else \
                f"zero_stage={stage} (FSDP2)"
            raise ValueError(f"ddp_kwargs={ddp_kwargs!r} apply to DDP, not to {engine}; "
                             "drop them")
        return FSDPStrategy(env, dims, zero_stage=stage, offload=offload == "cpu",
                            param_dtype=param_dtype)
    if stage == 0:
        return DDPStrategy(env, dims, ddp_kwargs=ddp_kwargs)
    return ZeRO1Strategy(env, dims, ddp_kwargs=ddp_kwargs)
