"""Batch size: one that fits (`find_executable_batch_size`), and shapes that suit the
hardware (`shape_advice`)."""

from __future__ import annotations

import functools
import gc
import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

_OOM_MESSAGES = (
    "out of memory",  # CUDA / XPU / MPS allocators
    "can't allocate memory",  # the CPU allocator
    "CUBLAS_STATUS_ALLOC_FAILED",
)


def is_out_of_memory(err: BaseException) -> bool:
    """Whether `err` is an allocator's out-of-memory error (of any device)."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and len(err.args) == 1 and any(
        m in str(err.args[0]) for m in _OOM_MESSAGES)


def release_memory() -> None:
    """Free what a failed attempt left behind: Python garbage, then the device caches."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def find_executable_batch_size(function: Callable | None = None, *, starting_batch_size: int = 128,
                               effective_batch_size: int | None = None,
                               min_batch_size: int = 1) -> Callable:
    """Decorator: call ``function(micro_batch_size, gradient_accumulation_steps, ...)`` and, on an
    out-of-memory error, call it again with half the micro-batch, as Accelerate's function of that
    name does, but keeping the *effective* batch: with ``effective_batch_size`` (samples per
    optimizer step on this rank) the accumulation passed in is ``effective_batch_size //
    micro_batch_size`` and the micro-batch only takes divisors of it, so the optimisation (and its
    learning-rate choice) is unchanged. Without it the accumulation is 1 and the effective batch
    shrinks with the micro-batch (Accelerate's behaviour). Each attempt should build its
    model/optimizer state afresh (or release the previous one), as with Accelerate. Raises
    RuntimeError when even ``min_batch_size`` does not fit; other errors propagate unchanged.

        @find_executable_batch_size(starting_batch_size=64, effective_batch_size=64)
        def train(micro_batch_size, gradient_accumulation_steps):
            ...
    """
    if function is None:
        return functools.partial(find_executable_batch_size,
                                 starting_batch_size=starting_batch_size,
                                 effective_batch_size=effective_batch_size,
                                 min_batch_size=min_batch_size)
    _check_sizes(function, starting_batch_size, effective_batch_size, min_batch_size)

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        batch = starting_batch_size
        while True:
            if batch < min_batch_size:
                raise RuntimeError(f"no micro-batch size >= {min_batch_size} fits in memory "
                                   f"(started at {starting_batch_size})")
            accumulation = effective_batch_size // batch if effective_batch_size else 1
            try:
                return function(batch, accumulation, *args, **kwargs)
            except Exception as err:
                if not is_out_of_memory(err):
                    raise
                del err  # drop the traceback's references to the failed attempt's tensors
                release_memory()
                smaller = batch // 2
                if effective_batch_size:
                    while smaller >= 1 and effective_batch_size % smaller:
                        smaller -= 1
                log.warning("out of memory at micro-batch %d; retrying with %d", batch, smaller)
                batch = smaller

    return wrapper


def _check_sizes(function: Callable, starting_batch_size: int,
                 effective_batch_size: int | None, min_batch_size: int) -> None:
    """`find_executable_batch_size`'s arguments, checked before the first attempt."""
    for name, value in (("starting_batch_size", starting_batch_size),
                        ("min_batch_size", min_batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an integer >= 1")
    if effective_batch_size is not None:
        if isinstance(effective_batch_size, bool) or not isinstance(effective_batch_size, int) \
                or effective_batch_size < 1:
            raise ValueError(f"effective_batch_size={effective_batch_size!r} must be an "
                             "integer >= 1")
        if effective_batch_size % starting_batch_size:
            raise ValueError(f"starting_batch_size={starting_batch_size} must divide "
                             f"effective_batch_size={effective_batch_size}; start at a divisor")
    params = list(inspect.signature(function).parameters)
    if len(params) < 2:
        raise TypeError(f"{function.__name__} must take (micro_batch_size, "
                        "gradient_accumulation_steps, ...) as its first two arguments")


def _tile(device: torch.device | None) -> int:
    """The multiple tensor cores want: 64 on A100-class and newer (compute capability >= 8.0),
    8 elsewhere (the guide's general rule for fp16/bf16)."""
    if device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available():
        major, _ = torch.cuda.get_device_capability(device)
        return 64 if major >= 8 else 8
    return 8


def shape_advice(*, device: torch.device | str | None = None, tile: int | None = None,
                 **sizes: int) -> list[str]:
    """The single-GPU guide's rule: tensor cores work on tiles, so batch size, hidden sizes and
    vocabulary should be multiples of the tile (`_tile`). One message per size that is not,
    with the padded size suggested.

        shape_advice(device="cuda", batch_size=30, d_model=768, vocab_size=50257)
        -> ['vocab_size=50257 is not a multiple of 64: pad it to 50304 ...']
    """
    tile = tile or _tile(torch.device(device) if device is not None else None)
    out = []
    for name, value in sizes.items():
        if value % tile:
            padded = -(-value // tile) * tile
            out.append(f"{name}={value} is not a multiple of {tile}: pad it to {padded} so that "
                       "tensor-core kernels run on full tiles")
    return out
