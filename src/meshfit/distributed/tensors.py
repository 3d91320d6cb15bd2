"""Tensors that may be distributed: this rank's part of a DTensor, bytes held per storage, and
the names a shared (tied) parameter goes by."""

from __future__ import annotations

from typing import Any

import torch

from meshfit._compat.ops import is_traceable_wrapper_subclass

__all__ = ["local_tensor", "names_by_parameter", "storage_bytes"]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (`to_local()`); any other tensor as it is."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def names_by_parameter(module: torch.nn.Module) -> list[list[str]]:
    """Every parameter's names in `module`, one list per tensor: a tied one has several."""
    by_id: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return list(by_id.values())


def storage_bytes(obj: Any, seen: set[tuple[str, int]]) -> int:
    """Bytes of the storages behind the tensors in a nest of dicts, lists and tuples, each
    storage counted once across calls sharing `seen` ((device, data pointer) pairs).

    Wrapper subclasses are opened to the tensors they hold (`__tensor_flatten__`): a DTensor
    to its local shard, torchao's 8-bit optimizer state to its uint8 codes, fp32 block scales
    and quantisation map."""
    if isinstance(obj, dict):
        return sum(storage_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(storage_bytes(v, seen) for v in obj)
    if not isinstance(obj, torch.Tensor):
        return 0
    if is_traceable_wrapper_subclass(obj):
        # DTensor flattens to ["_local_tensor"], OptimState8bit to ["codes", "scale", "qmap"].
        inner, _ = obj.__tensor_flatten__()
        return sum(storage_bytes(getattr(obj, attr), seen) for attr in inner)
    storage = obj.untyped_storage()
    key = (str(obj.device), storage.data_ptr())
    if storage.data_ptr() != 0:  # 0: meta or empty, nothing to share
        if key in seen:
            return 0
        seen.add(key)
    return storage.nbytes()
