"""What each data-parallel engine does while a loop runs, after `parallelize` has applied it:
over which group data-parallel results are gathered (`dp_group`), how gradients are kept from
syncing (`no_sync`), what becomes of the optimizer, what the user's module is under the
wrapper, and how the whole model's state dict is collected. The `Layout` decides the engine
once; `runtime_for` picks the runtime by that enum (never by matching strings).

With ``offload="disk"`` the runtime also puts what the engine keeps on the disk
(`meshfit.parallel.disk`): each optimizer's state in files it streams through every step
(under ZeRO-1 the local optimizer of this rank's partition), and with ``offload_params``
each model's parameter shards in memory-mapped files. It made them, so it removes them
(`release`, at the Accelerator's ``free_memory``).
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from meshfit.distributed.env import DistEnv
from meshfit.models.plans.regroup import canonical_state, regrouped_params
from meshfit.parallel.disk import DiskOffload, ParameterFiles, check_free_space
from meshfit.parallel.layout import Engine, Layout
from meshfit.parallel.zero1 import apply_zero1

__all__ = ["AUTO_SYNC_FREE_FRACTION", "DDPRuntime", "FSDPRuntime", "Runtime", "ZeRO1Runtime",
           "runtime_for"]

# sync_each_batch="auto" accumulates unsharded gradients (no reduce-scatter between
# micro-batches) when they take at most this share of the free memory: the rest of the step
# (activations, gathered blocks, optimizer state created at the first step) needs the remainder.
AUTO_SYNC_FREE_FRACTION = 0.25
_DDP = torch.nn.parallel.DistributedDataParallel


class Runtime:
    """No data-parallel wrapper (one process, or tensor/pipeline parallel alone): models are
    left as `parallelize` made them, nothing to synchronise."""

    def __init__(self, layout: Layout, env: DistEnv, mesh=None, *,
                 offload_dir: str | os.PathLike | None = None):
        self.layout, self.env, self.mesh = layout, env, mesh
        self.dp_mesh = layout.dp_mesh(mesh) if mesh is not None else None
        disk = layout.request.offload == "disk"
        if disk != (offload_dir is not None):
            raise ValueError(f"offload={layout.request.offload!r} with offload_dir="
                             f"{offload_dir!r}: a folder goes with offload='disk', and only "
                             "with it; give both or neither")
        self.offload_dir = Path(offload_dir) if disk else None
        """offload="disk": the folder of this job's files (None: nothing on the disk)."""
        self.offload_params = layout.request.offload_params
        self.parameter_files: list[ParameterFiles] = []
        """offload_params: each prepared model's parameter shards in files, in order."""
        self._state_files: list[DiskOffload] = []  # offload="disk": each optimizer's state

    dp_group = property(lambda self: None if self.dp_mesh is None else self.dp_mesh.get_group(),
                        doc="Process group of the data-parallel ranks (None: one rank).")
    dp_rank = property(lambda self: 0 if self.dp_mesh is None else self.dp_mesh.get_local_rank())
    dp_size = property(lambda self: 1 if self.dp_mesh is None else self.dp_mesh.size())

    @property
    def reduce_group(self):
        """The ranks whose values `Accelerator.reduce` combines: the data-parallel ranks, and
        under context parallel their cp ranks too (each holds a part of every sequence, so a
        loss is the mean of theirs); None: one rank."""
        if self.mesh is None:
            return None
        return self.layout.grad_mesh(self.mesh).get_group()

    @property
    def cp_mesh(self):
        """The context-parallel ranks' mesh (None without cp)."""
        return self.layout.axis_mesh(self.mesh, "cp")

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """`model`, laid out (and loaded), as the engine keeps it: with ``offload_params`` its
        parameter shards move into files of their own."""
        if self.offload_params:
            n = len(self.parameter_files)
            name = f"rank-{self.env.rank}-params" + (f"-{n}" if n else "")
            self.parameter_files.append(ParameterFiles(model, self.offload_dir / name))
        return model

    def check_files(self) -> None:
        """offload_params: the parameter files as this run last wrote them, or one line naming
        the file that changed (before a checkpoint or an export reads them)."""
        for files in self.parameter_files:
            files.check()

    def files_written(self, *, step: bool) -> None:
        """The run has just written the parameters (`step`: an optimizer step, else a
        checkpoint load): their files' digests taken anew."""
        for files in self.parameter_files:
            files.after_step() if step else files.seal()

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer to step: the engine's (ZeRO-1: a ZeroRedundancyOptimizer over it),
        with offload="disk" its state in files (`DiskOffload`)."""
        optimizer = self._engine_optimizer(optimizer)
        return optimizer if self.offload_dir is None else self._state_on_disk(optimizer)

    def _engine_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer

    def _state_on_disk(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        # ZeRO-1: the local optimizer over this rank's partition goes to disk; the
        # ZeroRedundancyOptimizer around it broadcasts the updated parameters as before.
        zero = _zero_redundancy(optimizer)
        local = optimizer if zero is None else zero.optim
        folder = self.offload_dir / f"rank-{self.env.rank}"
        check_free_space(local, folder, sharing=self.env.local_world_size
                         if self.env.is_distributed else 1)  # (the ranks of a node share it)
        offloaded = DiskOffload(local, folder)
        self._state_files.append(offloaded)
        if zero is None:
            return offloaded
        zero.optim = offloaded
        return zero

    def release(self) -> None:
        """Remove the files `prepare_optimizer` and `prepare_model` made (the optimizers'
        state, then the parameter shards'); the runtime is as new for the next models."""
        for made in (*self._state_files, *self.parameter_files):
            made.close()
        self._state_files.clear()
        self.parameter_files.clear()

    def no_sync(self, model: torch.nn.Module):
        return contextlib.nullcontext()

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def auto_sync_each_batch(self, model: torch.nn.Module) -> tuple[bool, str]:
        """sync_each_batch="auto": whether to synchronise every micro-batch, and why."""
        return False, ("gradients are not sharded in this layout, so skipping their "
                       "synchronisation between micro-batches costs no memory")

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's state dict on CPU on global rank 0, {} elsewhere (with a mesh, a
        collective: tensor-parallel parameters are gathered)."""
        if self.mesh is not None:
            return _gathered_state_dict(self.unwrap(model))
        return _cpu_state_dict(self.unwrap(model))


class DDPRuntime(Runtime):
    """Replicated data parallel over every data-parallel rank (ZeRO stage 0): `no_sync` is
    DDP's own, the user's module is `.module`."""

    def no_sync(self, model: torch.nn.Module):
        return model.no_sync() if isinstance(model, _DDP) else contextlib.nullcontext()

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.module if isinstance(model, _DDP) else model

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        if self.env.rank != 0:  # every replica holds the same weights
            return {}
        return _cpu_state_dict(self.unwrap(model))


class ZeRO1Runtime(DDPRuntime):
    """ZeRO stage 1: DDP over all data-parallel ranks, optimizer state partitioned over the
    ``dp_shard`` ranks by ZeroRedundancyOptimizer (whole parameters, greedily: see
    `meshfit.parallel.zero1`). With dp_replicate > 1 each replica group holds one copy of
    the state, partitioned inside the group."""

    def _engine_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if _zero_redundancy(optimizer) is not None:
            return optimizer
        # over dp_shard (dp_shard x cp under context parallel)
        return apply_zero1(optimizer, self.layout.shard_mesh(self.mesh).get_group())


class FSDPRuntime(Runtime):
    """FSDP2 over ``dp_shard`` (HSDP with ``dp_replicate``), or replicate-only under tp/pp
    (`meshfit.parallel.fsdp`): `no_sync` turns off the reduce-scatter, ``sync_each_batch=
    "auto"`` is decided from free memory, the full state dict is all-gathered."""

    # Lazy imports here: FSDP2 takes most of a second to import, and only this runtime needs
    # it (`parallelize` has loaded it by then).
    def no_sync(self, model: torch.nn.Module):
        from torch.distributed.fsdp import FSDPModule

        return _fsdp_no_sync(model) if isinstance(model, FSDPModule) else contextlib.nullcontext()

    def auto_sync_each_batch(self, model: torch.nn.Module) -> tuple[bool, str]:
        if self.layout.costs.whole_grads_until_boundary:
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


_RUNTIMES: dict[Engine, type[Runtime]] = {
    Engine.NONE: Runtime, Engine.DDP: DDPRuntime, Engine.ZERO1: ZeRO1Runtime,
    Engine.FSDP2: FSDPRuntime, Engine.FSDP2_REPLICATE: FSDPRuntime}


def runtime_for(layout: Layout, env: DistEnv, mesh=None, *,
                offload_dir: str | os.PathLike | None = None) -> Runtime:
    """The runtime of `layout`'s engine (`mesh`: None for one process without a group;
    `offload_dir`: the folder of the layout's offload="disk")."""
    return _RUNTIMES[layout.engine](layout, env, mesh, offload_dir=offload_dir)


def _zero_redundancy(optimizer: torch.optim.Optimizer):
    """`optimizer` if it is a ZeroRedundancyOptimizer (ZeRO-1), else None. Asked of the loaded
    modules: torch.distributed.optim takes most of a second to import, and while it is not
    loaded no ZeroRedundancyOptimizer exists."""
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    if zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer):
        return optimizer
    return None


def _plain(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with a 4-bit base's weights (QLoRA) dequantized: what the forward used."""
    peft = sys.modules.get("meshfit.peft")  # imported wherever a model went through qlora
    if peft is None:
        return state
    return {k: peft.dequantized(v) for k, v in state.items()}


def _cpu_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return _plain({k: v.detach().cpu() for k, v in model.state_dict().items()})


def _gathered_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # Lazy: DCP's state-dict helpers take about a second to import; they serve a model being
    # saved.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # A collective: every rank all-gathers; with cpu_offload=True torch fills the result on
    # rank 0 only and returns an empty dict elsewhere. Fused q|k|v weights split head-grouped
    # by tensor parallel (GPT-2's c_attn) are put back in the model's own layout: the dict
    # loads into a plain single-device model.
    state = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return canonical_state(_plain(state), regrouped_params(model))


@contextlib.contextmanager
def _fsdp_no_sync(model):
    """No reduce-scatter (nor HSDP all-reduce) in the enclosed backward: FSDP2 accumulates
    unsharded gradients, Ψ·4 bytes per rank until the next synchronised backward."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
