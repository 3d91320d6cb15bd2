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

Tensor parallel (``tp``) composes with ``dp_shard`` (FSDP+TP, zero_stage 2/3: the TP'd
model is fully_shard-ed over ``mesh["dp_shard"]``, a 2-D layout). Every strategy with a
``tp`` axis splits the model in `parallelize`, which `Accelerator.prepare` calls first.
DP+TP (``dp_replicate`` with ``tp``) and ZeRO-1 with ``tp`` are not available yet: DDP does
not take DTensor parameters.

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
AVAILABLE_AXES = ("dp_replicate", "dp_shard", "tp")
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


class Strategy:
    """A single process: models are moved to the device and otherwise left alone."""

    mesh = None
    tp_mesh = None
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

        return apply_tp(model, self.tp_mesh)

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
    see `meshfit.parallel.fsdp`. Parameters become DTensors: optimizers built before
    `prepare` are re-pointed by the accelerator, by parameter name."""

    owns_mixed_precision = True

    def __init__(self, env: DistEnv, dims: ParallelDims, *, zero_stage: int, offload: bool,
                 param_dtype: torch.dtype | None):
        super().__init__(env, dims)
        self.zero_stage = zero_stage
        self.offload = offload
        self.param_dtype = param_dtype
        axes = tuple(n for n in _DP_AXES if n in self.mesh.mesh_dim_names)
        # FSDP2 shards over the last dim of its mesh and replicates over the first (HSDP).
        self.fsdp_mesh = self.mesh[axes] if len(axes) > 1 else self.mesh[axes[0]]

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
    """Tensor parallel alone: `apply_tp` on ``mesh["tp"]`` (see `parallelize`), no
    data-parallel wrapper (the mesh's data-parallel axis has size 1, so every rank sees the
    same batch). Parameters become DTensors: optimizers built before `prepare` are
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


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients' total norm over all ranks; returns the norm (a plain tensor).

    Plain gradients (single process, DDP, ZeRO-1: already all-reduced) and DTensor gradients
    (FSDP2 shards) both work. Gradients on different meshes (e.g. 2-D dp x tp) are grouped
    by mesh, each group's norm is completed across its mesh, and the norms are combined
    (PITFALLS #5: torch's clip_grad_norm_ fails on mixed meshes)."""
    from torch.distributed.tensor import DTensor

    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.tensor(0.0)
    groups: dict = {}
    for p in params:
        key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
        groups.setdefault(key, []).append(p.grad)
    norms = []
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    device = norms[0].device
    norms = torch.stack([n.to(device) for n in norms])
    if math.isinf(norm_type):
        total = norms.max()
    else:
        total = norms.pow(norm_type).sum().pow(1.0 / norm_type)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


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
    if dims.tp > 1:
        if dims.dp_replicate > 1:
            raise ValueError(f"ParallelDims(dp_replicate={dims.dp_replicate}, tp={dims.tp}): "
                             "data-parallel replicas with tensor parallel (DP+TP) are not yet "
                             "available in meshfit; use dp_shard with tp (FSDP+TP) or tp alone")
        if stage == 1:
            raise ValueError("zero_stage=1 with tp > 1 is not yet available in meshfit (DDP "
                             "does not take tensor-parallel parameters); use zero_stage 2 or 3")
        if ddp_kwargs:
            raise ValueError(f"ddp_kwargs={ddp_kwargs!r} apply to DDP, which a layout with "
                             "tp > 1 does not use; drop them")
        if stage == 0:
            return TPStrategy(env, dims)
    if not env.is_distributed:
        return Strategy(env)
    if stage == 0:
        return DDPStrategy(env, dims, ddp_kwargs=ddp_kwargs)
    if stage == 1:
        return ZeRO1Strategy(env, dims, ddp_kwargs=ddp_kwargs)
    if ddp_kwargs:
        raise ValueError(f"ddp_kwargs={ddp_kwargs!r} apply to DDP (zero_stage 0 and 1), not to "
                         f"zero_stage={stage} (FSDP2); drop them")
    return FSDPStrategy(env, dims, zero_stage=stage, offload=offload == "cpu",
                        param_dtype=param_dtype)
