"""Accelerate's helpers for seeds, device memory and batch sizes."""

from __future__ import annotations

import functools
import gc
import inspect
import random
from typing import Callable, Optional

import torch
import torch.distributed as dist

__all__ = ["clear_device_cache", "find_executable_batch_size", "release_memory", "set_seed",
           "should_reduce_batch_size"]


def _process_index() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed Python's `random`, NumPy and torch (every device); ``device_specific``: plus the
    rank; ``deterministic``: ``torch.use_deterministic_algorithms``."""
    if device_specific:
        seed += _process_index()
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
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
    if isinstance(exception, RuntimeError) and len(exception.args) == 1:
        return any(m in str(exception.args[0]) for m in _OOM_MESSAGES)
    return False


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
