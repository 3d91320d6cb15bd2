"""Per-rank memory: bytes measured on the live objects, and the ZeRO paper's formula.

    report = rank_report(model, optimizer)        # after a step: optimizer state is lazy
    print(report.format())
    expected = zero_formula(num_params, world=2, stage=3)   # {"params": ..., "total": ...}

`rank_report` counts what this rank's tensors hold, not what an allocator says (a CPU build
has no allocator statistics, and tracemalloc does not see tensors): parameters, gradients,
optimizer state and buffers, each storage once. Sharded layouts are read as they are at the
moment of the call:

    DDP                      full parameters, full gradients, full optimizer state.
    ZeroRedundancyOptimizer  full parameters and gradients; state of this rank's partition
                             only (its local optimizer, `.optim`).
    FSDP2 (fully_shard)      DTensor parameters and gradients: their local shard
                             (`to_local()`), and optimizer state built on those shards. A
                             module caught unsharded (between forward and backward with
                             reshard_after_forward=False) registers its gathered parameters,
                             and those are what is counted then.

Not counted: activations, DDP's gradient buckets (with gradient_as_bucket_view=False, one
more gradient-sized copy), FSDP's all-gather / reduce-scatter buffers in flight, and the
allocator's caching and fragmentation. On CUDA the allocator's current and peak figures are
reported beside the counts, and they include all of that.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile

from meshfit._quiet import quiet_stderr
from meshfit.distributed import is_initialized
from meshfit.distributed.tensors import local_tensor, storage_bytes
from meshfit.optim import state_bytes

__all__ = ["RankMemory", "net_peak_bytes", "rank_report", "zero_formula"]

_MIB = 2**20


@dataclass(frozen=True, kw_only=True)
class RankMemory:
    """Bytes one rank holds, measured on live tensors by `rank_report`."""

    rank: int
    """This process's rank in the default process group (0 without one)."""
    param_bytes: int
    """Parameters: the local shard of DTensor parameters, plain tensors whole; each storage
    once (tied weights count once)."""
    grad_bytes: int
    """`.grad` of those parameters, by the same rules; a None gradient counts 0."""
    optimizer_bytes: int
    """Optimizer state this rank holds (`meshfit.optim.state_bytes` of the local optimizer)."""
    buffer_bytes: int
    """Module buffers (running statistics, RoPE tables), each storage once."""
    host_bytes: int
    """The part of the four counts above that lives in host (CPU) memory."""
    device_bytes: int
    """The part that lives on an accelerator; host_bytes + device_bytes == total_bytes."""
    allocated_bytes: int | None = None
    """CUDA: `torch.cuda.memory_allocated` on the parameters' device; None elsewhere."""
    peak_allocated_bytes: int | None = None
    """CUDA: `torch.cuda.max_memory_allocated` (since the last reset_peak_memory_stats)."""

    @property
    def total_bytes(self) -> int:
        """Parameters + gradients + optimizer state + buffers."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.buffer_bytes

    def format(self) -> str:
        """One line in MiB, e.g. ``rank 0: params 1.254 + grads 1.254 + optimizer 2.508 +
        buffers 0.000 = 5.016 MiB (host 5.016, device 0.000)``."""
        line = (f"rank {self.rank}: params {self.param_bytes / _MIB:.3f} + grads "
                f"{self.grad_bytes / _MIB:.3f} + optimizer {self.optimizer_bytes / _MIB:.3f} + "
                f"buffers {self.buffer_bytes / _MIB:.3f} = {self.total_bytes / _MIB:.3f} MiB "
                f"(host {self.host_bytes / _MIB:.3f}, device {self.device_bytes / _MIB:.3f})")
        if self.allocated_bytes is not None:
            line += (f"; CUDA allocated {self.allocated_bytes / _MIB:.3f} MiB, "
                     f"peak {self.peak_allocated_bytes / _MIB:.3f} MiB")
        return line


def rank_report(model: nn.Module,
                optimizer: torch.optim.Optimizer | None = None) -> RankMemory:
    """Measure the bytes this rank holds in `model`'s parameters, gradients and buffers and in
    `optimizer`'s state (a torch optimizer, a meshfit PreparedOptimizer, or a
    ZeroRedundancyOptimizer). Call it after a step (state is created lazily) and before
    zero_grad if gradients are to be seen."""
    where = {"host": 0, "device": 0}
    params = list(model.parameters())
    param_bytes = _count(params, where)
    grad_bytes = _count((p.grad for p in params), where)
    buffer_bytes = _count(model.buffers(), where)
    optimizer_bytes = 0
    if optimizer is not None:
        local = _local_optimizer(optimizer)
        optimizer_bytes = state_bytes(local).total_bytes
        _count(_leaves(local.state), where)  # the same tensors, for the host/device split
    allocated = peak = None
    cuda = _cuda_device(model)
    if cuda is not None:
        allocated = torch.cuda.memory_allocated(cuda)
        peak = torch.cuda.max_memory_allocated(cuda)
    distributed = is_initialized()
    return RankMemory(rank=dist.get_rank() if distributed else 0, param_bytes=param_bytes,
                      grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes,
                      buffer_bytes=buffer_bytes, host_bytes=where["host"],
                      device_bytes=where["device"], allocated_bytes=allocated,
                      peak_allocated_bytes=peak)


def _count(tensors: Iterable[torch.Tensor | None], where: dict[str, int]) -> int:
    """Bytes of `tensors`, each storage once (`storage_bytes` opens DTensor and
    torchao subclasses), added to `where` by the device the storage lives on."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for t in tensors:
        kind = None if t is None else local_tensor(t).device.type
        if kind is None or kind == "meta":  # meta tensors hold no memory
            continue
        nbytes = storage_bytes(t, seen)
        where["host" if kind == "cpu" else "device"] += nbytes
        total += nbytes
    return total


def _leaves(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _leaves(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _leaves(v)
    elif isinstance(obj, torch.Tensor):
        yield obj


def _local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose `.state` is this rank's: unwrap meshfit's PreparedOptimizer, and
    take ZeroRedundancyOptimizer's local optimizer. ZeRO's own `.state` is empty after steps;
    after load_state_dict it has an entry per parameter, empty for other ranks' and the very
    same tensors as `.optim.state` for this rank's (measured on torch 2.13). `.optim` holds
    the partition's state at all times, and its param_groups only the partition's
    parameters."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    # Looked up, not imported: a ZeRO optimizer implies its module is loaded, and importing
    # it otherwise would JIT-script torch's functional optimizers for nothing.
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    if zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer):
        return optimizer.optim
    return optimizer


def _cuda_device(model: nn.Module) -> torch.device | None:
    """The CUDA device the model computes on: where a parameter or buffer lives, or, for
    DTensors offloaded to host memory (FSDP2's CPUOffloadPolicy), their mesh's device type."""
    for t in itertools.chain(model.parameters(), model.buffers()):
        if t.device.type == "cuda":
            return t.device
        mesh = getattr(t, "device_mesh", None)
        if mesh is not None and mesh.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
    return None


def zero_formula(num_params: int, world: int, stage: int, *, param_bytes: float = 4,
                 grad_bytes: float = 4, optim_bytes: float = 8,
                 fsdp2: bool = False) -> dict[str, float]:
    """Expected bytes per rank of parameters, gradients and optimizer state under ZeRO.

    ZeRO (Rajbhandari et al. 2020, Fig. 1) for Ψ = `num_params` parameters on N = `world`
    data-parallel ranks:

        stage 0  DDP                 params Ψ·p     grads Ψ·g     optimizer Ψ·K
        stage 1  P_os                params Ψ·p     grads Ψ·g     optimizer Ψ·K / N
        stage 2  P_os+g              params Ψ·p     grads Ψ·g / N optimizer Ψ·K / N
        stage 3  P_os+g+p            params Ψ·p / N grads Ψ·g / N optimizer Ψ·K / N

    with p = `param_bytes`, g = `grad_bytes`, K = `optim_bytes` per parameter. Two cases:

        fp32 AdamW (the defaults, what the tests train)   p=4, g=4, K=8 (exp_avg + exp_avg_sq;
            the parameters are their own master copy): 16Ψ in all for DDP.
        mixed-precision Adam (the paper)   p=2, g=2 (fp16/bf16), K=12 (fp32 master parameters,
            momentum and variance, the master copy counted as optimizer state): also 16Ψ;
            Ψ=7.5e9, N=64 gives 120, 31.4, 16.6 and 1.9 GB for stages 0-3.

    `fsdp2=True` gives what FSDP2's stage 2 holds at rest: its parameters sharded as in stage 3
    (`meshfit.parallel.fsdp` says why). The formula ignores AdamW's scalar `step` tensors (4 B
    per parameter tensor) and FSDP2's padding of a dim 0 that does not divide by N (each shard
    is ceil). Returns {"params", "grads", "optimizer", "total"} in bytes (floats: Ψ/N need not
    be whole).
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage!r} must be 0 (DDP), 1, 2 or 3")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world={world!r} must be an int >= 1 (the data-parallel ranks)")
    if num_params < 0:
        raise ValueError(f"num_params={num_params!r} must be >= 0")
    shard_params = stage == 3 or (stage == 2 and fsdp2)
    out = {"params": num_params * param_bytes / (world if shard_params else 1),
           "grads": num_params * grad_bytes / (world if stage >= 2 else 1),
           "optimizer": num_params * optim_bytes / (world if stage >= 1 else 1)}
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def net_peak_bytes(fn) -> int:
    """The largest net allocation (bytes) while ``fn()`` runs: the profiler's allocation and
    free events (every thread's) in time order, summed as they come. On a CPU build, which
    keeps no allocator statistics, this is what a step's activations and temporaries peak
    at beyond the memory held before it."""
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with quiet_stderr():  # the profiler's own start and stop lines
        prof.start()
    try:
        fn()
    finally:
        with quiet_stderr():
            prof.stop()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    running = peak = 0
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
    return peak
