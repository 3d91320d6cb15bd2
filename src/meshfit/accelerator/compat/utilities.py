"""Accelerate's helper functions: seeds, device memory and batch sizes, and the collective
helpers of ``accelerate.utils.operations`` over the default process group (Accelerate's
``PartialState``; without a process group they return their input, as Accelerate's do).
`Accelerator.gather` & co. act over the data-parallel group instead (`processes`).
"""

from __future__ import annotations

import functools
import gc
import inspect
import random
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from meshfit import distributed as mdist
from meshfit.distributed import collectives as ops

__all__ = ["DistributedOperationException", "broadcast", "broadcast_object_list",
           "clear_device_cache", "copy_tensor_to_devices",
           "find_executable_batch_size", "gather", "gather_object", "is_all_tensors",
           "pad_across_processes", "reduce", "release_memory", "send_to_device", "set_seed",
           "should_reduce_batch_size"]


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed Python's `random`, NumPy and torch (every device); ``device_specific``: plus the
    rank; ``deterministic``: ``torch.use_deterministic_algorithms``."""
    if device_specific:
        seed += dist.get_rank() if mdist.is_initialized() else 0
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        torch.xpu.manual_seed_all(seed)
    else:
        torch.cuda.manual_seed_all(seed)  # safe without CUDA
    if deterministic:
        torch.use_deterministic_algorithms(True)


def clear_device_cache(garbage_collection: bool = False) -> None:
    """Return the device allocator's cached blocks (and collect garbage first if asked)."""
    if garbage_collection:
        gc.collect()
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        torch.xpu.empty_cache()
    elif torch.backends.mps.is_available():
        torch.mps.empty_cache()
    elif torch.cuda.is_available():
        torch.cuda.empty_cache()


def release_memory(*objects) -> list:
    """``[None] * len(objects)`` after collecting garbage and emptying the device cache:
    ``a, b = release_memory(a, b)``."""
    objects = [None for _ in objects]
    clear_device_cache(garbage_collection=True)
    return objects


_OOM_MESSAGES = (" out of memory.", "MPS backend out of memory",
                 "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
                 "DefaultCPUAllocator: can't allocate memory",
                 "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed")


def should_reduce_batch_size(exception: Exception) -> bool:
    """Whether `exception` is an out-of-memory error (CUDA, XPU, MPS, CPU) or cuDNN's
    not-supported error, after which a smaller batch may run."""
    return isinstance(exception, RuntimeError) and len(exception.args) == 1 and any(
        m in str(exception.args[0]) for m in _OOM_MESSAGES)


def find_executable_batch_size(function: Optional[Callable] = None, starting_batch_size: int = 128,
                               reduce_batch_size_fn: Optional[Callable] = None):
    """Decorator: call ``function(batch_size, ...)`` from `starting_batch_size`, after each
    out-of-memory error with ``int(batch_size * 0.9)`` (or ``reduce_batch_size_fn()``);
    RuntimeError at 0. (Keeping the effective batch: `meshfit.train.batch_size`'s.)"""
    if function is None:
        return functools.partial(find_executable_batch_size,
                                 starting_batch_size=starting_batch_size,
                                 reduce_batch_size_fn=reduce_batch_size_fn)
    batch_size = starting_batch_size
    if reduce_batch_size_fn is None:
        def reduce_batch_size_fn():
            nonlocal batch_size
            batch_size = int(batch_size * 0.9)
            return batch_size

    @functools.wraps(function)
    def decorator(*args, **kwargs):
        nonlocal batch_size
        clear_device_cache(garbage_collection=True)
        params = list(inspect.signature(function).parameters)
        if len(params) < len(args) + 1:
            given = ", ".join(f"{p}={v}" for p, v in zip(params[1:], args[1:]))
            raise TypeError(f"Batch size was passed into `{function.__name__}` as the first "
                            "argument when called. Remove this as the decorator already does "
                            f"so: `{function.__name__}({given})`")
        while True:
            if batch_size == 0:
                raise RuntimeError("No executable batch size found, reached zero.")
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as err:  # noqa: BLE001 - only out-of-memory is retried
                if not should_reduce_batch_size(err):
                    raise
                clear_device_cache(garbage_collection=True)
                batch_size = reduce_batch_size_fn()

    return decorator


# ----------------------------------------------------------------------------- collectives
def _distributed() -> bool:
    return mdist.is_initialized() and dist.get_world_size() > 1


def is_all_tensors(obj: Any) -> bool:
    """Whether every leaf of a nest of lists, tuples and dicts is a tensor."""
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return all(is_all_tensors(o) for o in obj)
    return isinstance(obj, torch.Tensor)


def check_tensors(obj: Any, what: str, hint: str = "") -> None:
    """Refuse data other than tensors (a nest of them) for the collective `what`."""
    if not is_all_tensors(obj):
        raise TypeError(f"{what}: unsupported types in the data; it takes tensors or nested "
                        f"lists/tuples/dicts of tensors{hint}")


class DistributedOperationException(Exception):
    """A collective was called with tensors of different shapes on different processes (found
    in debug mode: ``PartialState().debug = True`` or ``ACCELERATE_DEBUG_MODE=1``)."""


# Debug mode (`verify_operation`): ``PartialState().debug`` reads and sets this switch.
DEBUG_MODE = {"on": False}


def _debug() -> bool:
    return DEBUG_MODE["on"]


def verify_operation(what: str, tensor: Any, group=None) -> None:
    """In debug mode, before a collective: every process must pass tensors of the same
    shapes, else DistributedOperationException names them (instead of a hang or a wrong
    result). A collective itself (an exchange of the shapes)."""
    if not _debug() or not _distributed():
        return
    shapes = ops.apply_to_tensors(lambda t: list(t.shape), tensor)
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, shapes, group=group)
    if any(s != everyone[0] for s in everyone):
        listed = "\n  - ".join(f"Process {i}: {s}" for i, s in enumerate(everyone))
        raise DistributedOperationException(
            f"Cannot apply desired operation due to shape mismatches. All shapes across "
            f"devices must be valid.\n\nOperation: `{what}`\nInput shapes:\n  - {listed}")


def gather(tensor: Any, group=None) -> Any:
    """Concatenate tensors (a nest of them) from every process along dim 0, in rank order
    (0-dim tensors become one row each), as plain values (no autograd through it)."""
    check_tensors(tensor, "gather")
    if not _distributed():
        return tensor
    verify_operation("gather", tensor, group)
    return ops.gather(ops.apply_to_tensors(lambda t: t.detach(), tensor), group)


def gather_object(obj: Any, group=None) -> Any:
    """Every process's picklable `obj` (an iterable, as in Accelerate; else one item),
    concatenated in rank order; one process: `obj` itself."""
    if not _distributed():
        return obj
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    flat = []
    for part in out:
        try:
            flat.extend(part)
        except TypeError:
            flat.append(part)
    return flat


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Tensors (a nest of them) of process `from_process`, in place on every process."""
    check_tensors(tensor, "broadcast")
    if not _distributed():
        return tensor
    verify_operation("broadcast", tensor)

    def one(t: torch.Tensor) -> torch.Tensor:
        dist.broadcast(t, src=from_process)
        return t

    return ops.apply_to_tensors(one, tensor)


def broadcast_object_list(object_list: list, from_process: int = 0) -> list:
    """Fill `object_list` (in place, and return it) with process `from_process`'s items."""
    if _distributed():
        dist.broadcast_object_list(object_list, src=from_process)
    return object_list


def reduce(tensor: Any, reduction: str = "mean", scale: float = 1.0, group=None) -> Any:
    """All-reduce tensors (a nest of them) into new ones: "sum", "mean", "max" or "none";
    `scale` is applied by Accelerate on TPUs only, and ignored here likewise."""
    check_tensors(tensor, "reduce")
    if reduction not in ("sum", "mean", "max", "none"):
        raise ValueError(f"reduction={reduction!r} is not supported; use 'sum', 'mean', 'max' "
                         "or 'none'")
    world = dist.get_world_size(group) if _distributed() else 1
    verify_operation("reduce", tensor, group)

    def one(t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        if world == 1 or reduction == "none":
            return out
        dist.all_reduce(out, op=dist.ReduceOp.MAX if reduction == "max" else dist.ReduceOp.SUM,
                        group=group)
        if reduction == "mean":
            out /= world
        return out

    return ops.apply_to_tensors(one, tensor)


def pad_across_processes(tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False,
                         group=None) -> Any:
    """Pad each tensor along `dim` to the largest size any process has (with `pad_index`, at
    the end or, with `pad_first`, at the start) so that they can be gathered."""
    check_tensors(tensor, "pad_across_processes")
    verify_operation("pad_across_processes", tensor, group)

    def one(t: torch.Tensor) -> torch.Tensor:
        if not -t.dim() <= dim < t.dim() or not _distributed():
            return t
        d = dim % t.dim()
        size = torch.tensor([t.shape[d]], device=t.device, dtype=torch.long)
        sizes = [torch.empty_like(size) for _ in range(dist.get_world_size(group))]
        dist.all_gather(sizes, size, group=group)
        biggest = max(int(s.item()) for s in sizes)
        if biggest == t.shape[d]:
            return t
        shape = list(t.shape)
        shape[d] = biggest
        out = t.new_zeros(shape) + pad_index
        start = biggest - t.shape[d] if pad_first else 0
        index = [slice(None)] * t.dim()
        index[d] = slice(start, start + t.shape[d])
        out[tuple(index)] = t
        return out

    return ops.apply_to_tensors(one, tensor)


def copy_tensor_to_devices(tensor: torch.Tensor | None = None) -> torch.Tensor:
    """The main process's `tensor` on every process (the others pass None), on each one's
    device."""
    if not _distributed():
        return tensor
    device = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend() == "nccl" else torch.device("cpu")
    held = [tensor.cpu() if tensor is not None else None]
    dist.broadcast_object_list(held, src=0)
    return held[0].to(device)


def send_to_device(tensor: Any, device, non_blocking: bool = False, skip_keys=None) -> Any:
    """Move tensors (and objects with ``.to``) in a nest of lists, tuples and dicts to
    `device`; dict entries under `skip_keys` stay where they are."""
    if isinstance(skip_keys, str):
        skip_keys = [skip_keys]
    skip = set(skip_keys or ())
    if isinstance(tensor, torch.Tensor) or (hasattr(tensor, "to") and not isinstance(
            tensor, (list, tuple, dict))):
        try:
            return tensor.to(device, non_blocking=non_blocking)
        except TypeError:
            return tensor.to(device)
    if isinstance(tensor, tuple) and hasattr(tensor, "_fields"):
        return type(tensor)(*(send_to_device(t, device, non_blocking) for t in tensor))
    if isinstance(tensor, (list, tuple)):
        return type(tensor)(send_to_device(t, device, non_blocking, skip_keys) for t in tensor)
    if isinstance(tensor, dict):
        out = {k: v if k in skip else send_to_device(v, device, non_blocking, skip_keys)
               for k, v in tensor.items()}
        return out if type(tensor) is dict else type(tensor)(out)
    return tensor
