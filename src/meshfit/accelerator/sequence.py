"""A batch under context parallel: each cp rank of a data-parallel rank is fed the same batch
and keeps its part of every sequence (`Accelerator.shard_sequence`), or has the tensors a
model reads cut to that part in place for one batch (`Accelerator.maybe_context_parallel`,
Accelerate's context manager). The cut is `meshfit.parallel.cp.shard_sequence`'s, the one
the model's ring attention expects (load-balanced: each rank holds an early and a late chunk).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch

from meshfit.parallel.cp import shard_sequence

__all__ = ["cut_in_place", "shard"]


def shard(tensors: tuple[torch.Tensor, ...], dim: int, cp_mesh, *, load_balance: bool
          ) -> tuple[torch.Tensor, ...]:
    """This rank's part of each tensor's sequence dimension `dim` over `cp_mesh` (the
    context-parallel ranks; None: no cp, the tensors as they are)."""
    if cp_mesh is None:
        return tensors
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    return tuple(shard_sequence(t, dim, cp, rank, load_balance) for t in tensors)


@contextlib.contextmanager
def cut_in_place(buffers: Iterable[torch.Tensor] | None, dims: Iterable[int] | None,
                 no_restore: Iterable[torch.Tensor] | None, *,
                 cut: Callable[..., torch.Tensor] | None):
    """Each of `buffers` resized and filled with ``cut(buffer, dim=d)`` (its `dims` entry) for
    the enclosed block, and put back after unless it is in `no_restore` (`cut` None: no
    context parallel, nothing changes; the arguments are checked all the same)."""
    buffers = list(buffers or [])
    dims = list(dims or [])
    if len(dims) != len(buffers):
        raise ValueError(f"maybe_context_parallel: {len(buffers)} buffers but "
                         f"{len(dims)} buffer_seq_dims; give one sequence dimension per "
                         "buffer")
    keep = {id(b) for b in (no_restore or ())}
    if keep - {id(b) for b in buffers}:
        raise ValueError("maybe_context_parallel: no_restore_buffers must be a subset "
                         "of buffers")
    if cut is None:
        yield
        return
    saved = []
    for buffer, dim in zip(buffers, dims):
        part = cut(buffer, dim=dim)
        if id(buffer) not in keep:
            saved.append((buffer, buffer.clone()))
        with torch.no_grad():
            buffer.resize_(part.shape)
            buffer.copy_(part)
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, whole in saved:
                buffer.resize_(whole.shape)
                buffer.copy_(whole)
