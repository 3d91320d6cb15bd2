"""torch.distributed.checkpoint (DCP) and torch.serialization: the private names meshfit's
checkpoints (`meshfit.checkpoint`) still need, each with why and the public API that would
replace it. Nothing is imported at load (DCP costs 0.3 s of imports per process, which
`meshfit train` pays at its first save, not at its start).

Replaced by public APIs, and so no longer here: DCP's process-based checkpointer
(`_async_process_executor`: a writer process of meshfit's own, `meshfit.checkpoint.
_writer_process`), `_traverse.set_element`, `default_planner._EmptyStateDictLoadPlanner` and
`state_dict_loader._load_state_dict` (the template filled by the public `dcp.load` is built
from the index), `torch._C.PyTorchFileReader` (the standard library's `zipfile` reads
`torch.save`'s documented zip layout), a DTensor's ``_local_tensor`` (`to_local()`) and an
`nn.Module`'s ``_parameters`` (`register_parameter`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["INDEX_PRIVATE_GLOBALS", "crc32_skipped", "local_shape_and_offset", "missing",
           "stager_copies_classes"]

INDEX_PRIVATE_GLOBALS = frozenset({("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                                   ("torch.serialization", "_get_layout")})
"""Private globals a DCP index (``.metadata``, a pickle) names: where each item lies in which
file (`_StorageInfo`) and a tensor's layout (`torch.layout` pickles as a call of
`_get_layout`). meshfit's restricted unpickler builds these and DCP's public metadata classes,
nothing else (a crafted index must not run code). Replaced the day DCP's index is written in
a format that is not a pickle (or names only public classes)."""


def local_shape_and_offset(tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, offset) of this rank's part of DTensor `tensor` in the global tensor, through
    `torch.distributed.tensor._utils.compute_local_shape_and_global_offset`: loading a
    pretrained folder reads only that block of each weight from its safetensors file.
    `to_local()` gives the shape but not the offset, and DTensor has no public method for it
    (DCP's own planner calls the same private function). Replaced by a public DTensor API for
    a shard's offset."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh,
                                                          tensor.placements)
    return tuple(shape), tuple(offset)


def stager_copies_classes(stager) -> None:
    """Make DCP's `DefaultStager` copy a class in a state dict as the class itself, as
    `copy.deepcopy` does. torch 2.11's staging copier (``StateDictStager``, whose copy table
    is ``_deepcopy_dispatch``) has no entry for `type`, so a state holding a class object
    fails every process-mode save with ``KeyError: <class 'type'>``. This was seen on an H200
    with torch 2.11 (`benchmarks/cuda_paths.py`'s async_checkpoint_process), and torch 2.13
    has the entry. The entry is added where it is missing; where the staging copier is laid
    out otherwise (another torch), nothing is changed. Replaced once the supported torch
    range starts at a version with the entry."""
    table = getattr(getattr(stager, "_state_dict_stager", None), "_deepcopy_dispatch", None)
    if not isinstance(table, dict) or type in table:
        return

    def _deepcopy_atomic(x, _memo):  # (the name DCP's copier checks for atomic copiers)
        return x

    table[type] = _deepcopy_atomic


_SKIPPING = threading.local()  # .on: this thread writes a file whose every block is hashed


@contextmanager
def crc32_skipped() -> Iterator[None]:
    """Inside: this thread's `torch.save` calls write no CRC-32 per record.

    DCP's file-system writer writes each tensor with `torch.save`, which computes a CRC-32 of
    every record by default (about 1.6 GB/s on one core, as slow as a fast disk) that
    `torch.load` never checks; a checkpoint's files are hashed as they are written (XXH3-128 per
    block, checked before any byte is used), which replaces it. The public switch
    (`torch.serialization.set_crc32_options`) is global to the process: it would also drop the
    CRC-32 of the training thread's own `torch.save` calls while a writer thread saves. So
    `torch.serialization.get_crc32_options`, which `torch.save` reads at each call (an
    implementation detail), is wrapped to answer False in such a thread only. Replaced by a
    per-call option of `torch.save` passed on by DCP's writer (or by DCP's writer not
    computing it). Without the function (another torch), files keep their CRC-32s: slower,
    never wrong."""
    _install_crc32_switch()
    was = getattr(_SKIPPING, "on", False)
    _SKIPPING.on = True
    try:
        yield
    finally:
        _SKIPPING.on = was


def _install_crc32_switch() -> None:
    from torch import serialization

    original = getattr(serialization, "get_crc32_options", None)
    if original is None or getattr(original, "_meshfit", False):
        return

    def get_crc32_options() -> bool:
        return False if getattr(_SKIPPING, "on", False) else original()

    get_crc32_options.__doc__, get_crc32_options._meshfit = original.__doc__, True
    serialization.get_crc32_options = get_crc32_options


_USED = (("torch.serialization", "get_crc32_options"),
         ("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset"),
         *sorted(INDEX_PRIVATE_GLOBALS))


def missing() -> list[str]:
    """The names above that the installed torch does not have, one line each."""
    import importlib

    import torch

    out = []
    for module, name in _USED:
        try:
            found = hasattr(importlib.import_module(module), name)
        except ImportError:
            found = False
        if not found:
            out.append(f"torch {torch.__version__}: {module}.{name}")
    return out
