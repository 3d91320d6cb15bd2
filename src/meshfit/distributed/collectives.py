"""Gather and reduce nested structures of tensors over one process group.

Thin wrappers over torch.distributed's collectives; `group=None` with no process group means a
single process, where every operation returns its input.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from meshfit.distributed.env import is_initialized


def apply_to_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """Apply `fn` to every tensor in a nest of lists, tuples, dicts and named tuples."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(apply_to_tensors(fn, o) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(apply_to_tensors(fn, o) for o in obj)
    if isinstance(obj, dict):
        items = {k: apply_to_tensors(fn, v) for k, v in obj.items()}
        try:
            return type(obj)(**items) if type(obj) is not dict else items
        except TypeError:
            return type(obj)(items)
    return obj


# torch 2.13 renamed all_gather_into_tensor (and warns on the old name); older releases have
# only the old one.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _active(group) -> bool:
    return is_initialized() and dist.get_world_size(group) > 1


def gather(obj: Any, group=None) -> Any:
    """Concatenate each tensor along dim 0 across the ranks of `group`, in rank order.

    Tensors may differ in their first dimension between ranks (an uneven last batch): sizes
    are exchanged first, tensors padded to the largest, gathered, and the padding removed.
    """
    if not _active(group):
        return obj
    return apply_to_tensors(lambda t: _gather_tensor(t, group), obj)


def _gather_tensor(tensor: torch.Tensor, group) -> torch.Tensor:
    if tensor.dim() == 0:
        tensor = tensor.unsqueeze(0)
    world = dist.get_world_size(group)
    size = torch.tensor([tensor.shape[0]], device=tensor.device, dtype=torch.long)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    sizes = [int(s.item()) for s in sizes]
    biggest = max(sizes)
    if tensor.shape[0] < biggest:
        pad = tensor.new_zeros((biggest - tensor.shape[0], *tensor.shape[1:]))
        tensor = torch.cat([tensor, pad])
    out = tensor.new_empty((world * biggest, *tensor.shape[1:]))
    _all_gather_single(out, tensor.contiguous(), group=group)
    if all(s == biggest for s in sizes):
        return out
    return torch.cat([out[r * biggest: r * biggest + s] for r, s in enumerate(sizes)])


_REDUCE_OPS = {"sum": "SUM", "mean": "SUM", "min": "MIN", "max": "MAX"}


def reduce(obj: Any, reduction: str = "sum", group=None) -> Any:
    """All-reduce each tensor across `group` (``"sum"``, ``"mean"``, ``"min"`` or ``"max"``);
    returns new tensors."""
    if reduction not in _REDUCE_OPS:
        raise ValueError(f"reduction={reduction!r} is not supported; use one of "
                         f"{', '.join(_REDUCE_OPS)}")
    if not _active(group):
        return apply_to_tensors(lambda t: t.clone(), obj)

    def _reduce(t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        dist.all_reduce(out, op=getattr(dist.ReduceOp, _REDUCE_OPS[reduction]), group=group)
        if reduction == "mean":
            out = out / dist.get_world_size(group)
        return out

    return apply_to_tensors(_reduce, obj)


def gather_object(obj: Any, group=None) -> list:
    """A list of each rank's (picklable) object, in rank order; flattens lists."""
    if not _active(group):
        return list(obj) if isinstance(obj, list) else [obj]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    if all(isinstance(o, list) for o in out):
        return [x for o in out for x in o]
    return out
