"""Making each Muon matrix whole for its Newton-Schulz iteration, under sharding.

Muon's update is a function of the *whole* matrix (its orthogonalisation is not elementwise),
so a matrix sharded by FSDP2 (ZeRO-2/3: ``Shard(0)``) or by tensor parallelism (``Shard(0)``
or ``Shard(1)``) must be assembled before it. Two ways, both computing the same numbers as
one process (the same iteration on the same whole matrix):

    gather  every rank all-gathers every matrix (`DTensor.redistribute` to ``Replicate``),
            orthogonalises all of them, and keeps its own slice: simple, works for every
            placement, but each rank does the whole model's Newton-Schulz work.
    owner   each matrix gets an owner rank in its sharding group (balanced by elements,
            largest first); the shards are gathered to the owner only, the owner
            orthogonalises, and the result is scattered back (`dist.gather` / `dist.scatter`,
            all issued asynchronously, so the owners compute at the same time): the
            Newton-Schulz work is divided by the group size. Placements with one ``Shard``
            over one mesh dimension (FSDP2, HSDP, TP); other placements (FSDP2 x TP on a 2-D
            mesh) fall back to `gather`.

The default, `owner`, was chosen by `benchmarks/muon_step.py` (docs/single-device.md has the
figures). A 3-D parameter (a mixture of experts' stacked expert weights) is one matrix per
expert; when only its expert dimension (0) is sharded (expert parallelism), every expert is
whole on its rank already and nothing is communicated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshfit.distributed.tensors import local_tensor

__all__ = ["WHOLE", "orthogonalize"]

WHOLE = ("owner", "gather")

Ortho = Callable[[torch.Tensor], torch.Tensor]
"""Newton-Schulz on one whole 2-D or 3-D (per leading index) tensor."""


def _is_dtensor(t: torch.Tensor) -> bool:
    return callable(getattr(t, "to_local", None)) and hasattr(t, "placements")


def _locally_whole(update: torch.Tensor) -> bool:
    """Every matrix of `update` is whole on this rank: a plain tensor, a replicated DTensor,
    or a 3-D one sharded on its expert dimension only."""
    if not _is_dtensor(update):
        return True
    shards = [p for p in update.placements if p.is_shard()]
    return all(p.dim == 0 for p in shards) and (not shards or update.ndim == 3)


@dataclass
class _Owned:
    """One matrix under the owner strategy: where it goes, and its buffers."""

    index: int  # into the step's list of updates
    group: object  # the process group its Shard runs over
    dim: int  # the sharded dimension
    owner: int  # the owner's rank inside `group`
    shape: tuple[int, ...]  # the whole tensor's
    send: torch.Tensor | None = None
    parts: list[torch.Tensor] | None = None


def orthogonalize(updates: list[torch.Tensor], ortho: Ortho, whole: str,
                  load: dict | None = None) -> list[torch.Tensor]:
    """The orthogonalised updates, each as this rank's part of it (a plain tensor shaped as
    the local shard of the corresponding entry of `updates`). `load`: elements owned so
    far per rank of each group, carried from one bucket to the next of the same step so
    that the owners stay balanced over the step."""
    out: list[torch.Tensor | None] = [None] * len(updates)
    owned: list[_Owned] = []
    for i, update in enumerate(updates):
        if _locally_whole(update):
            out[i] = ortho(local_tensor(update))
        elif whole == "owner" and _single_shard(update) is not None:
            group, dim = _single_shard(update)
            owned.append(_Owned(index=i, group=group, dim=dim, owner=-1,
                                shape=tuple(update.shape)))
        else:
            out[i] = _gathered(update, ortho)
    if owned:
        _assign_owners(owned, {} if load is None else load)
        for item, result in zip(owned, _by_owner(owned, updates, ortho)):
            out[item.index] = result
    return out  # type: ignore[return-value]


def _gathered(update: torch.Tensor, ortho: Ortho) -> torch.Tensor:
    """`gather`: the whole tensor on this rank, orthogonalised, this rank's part kept
    (``Replicate`` -> the original placements is a local split, no communication)."""
    from torch.distributed.tensor import DTensor, Replicate

    mesh, placements = update.device_mesh, update.placements
    replicated = [Replicate()] * mesh.ndim
    full = update.redistribute(mesh, replicated).to_local()
    result = DTensor.from_local(ortho(full), mesh, replicated, run_check=False)
    return result.redistribute(mesh, placements).to_local()


def _single_shard(update: torch.Tensor):
    """(process group, dim) where `update` is sharded over one mesh dimension only."""
    shards = [(i, p) for i, p in enumerate(update.placements) if p.is_shard()]
    if len(shards) != 1 or any(not (p.is_shard() or p.is_replicate())
                               for p in update.placements):
        return None
    mesh_dim, placement = shards[0]
    return update.device_mesh.get_group(mesh_dim), placement.dim


def _assign_owners(owned: list[_Owned], load: dict) -> None:
    """Largest matrix first, each to the least-loaded rank of its group (elements so far);
    every rank computes the same assignment from the same shapes in the same order."""
    for item in sorted(owned, key=lambda o: -_numel(o.shape)):
        counts = load.setdefault(id(item.group), [0] * dist.get_world_size(item.group))
        item.owner = min(range(len(counts)), key=counts.__getitem__)
        counts[item.owner] += _numel(item.shape)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _chunk_sizes(size: int, n: int) -> list[int]:
    """torch.chunk's (and DTensor's ``Shard``) split of `size` in `n`: ceil(size / n) each,
    the last ones shorter or empty."""
    step = -(-size // n)
    return [max(0, min(step, size - r * step)) for r in range(n)]


def _by_owner(owned: list[_Owned], updates: list[torch.Tensor], ortho: Ortho
              ) -> list[torch.Tensor]:
    """`owner`: gather every matrix to its owner (all at once), orthogonalise the owned
    ones, scatter the results back (all at once). Buffers are padded to the largest shard
    (gloo's gather and scatter take equal sizes)."""
    works = []
    for item in owned:
        local = local_tensor(updates[item.index])
        n, me = dist.get_world_size(item.group), dist.get_rank(item.group)
        pad = _padded_numel(item.shape, item.dim, n)
        item.send = torch.zeros(pad, dtype=local.dtype, device=local.device)
        item.send[:local.numel()] = local.reshape(-1)
        item.parts = [torch.empty_like(item.send) for _ in range(n)] if me == item.owner \
            else None
        works.append(dist.gather(item.send, item.parts, group=item.group,
                                 group_dst=item.owner, async_op=True))
    for work in works:
        work.wait()
    works, received = [], []
    for item in owned:
        n, me = dist.get_world_size(item.group), dist.get_rank(item.group)
        pieces = None
        if me == item.owner:
            pieces = _owner_result(item, ortho, n)
        recv = torch.empty_like(item.send)
        works.append(dist.scatter(recv, pieces, group=item.group, group_src=item.owner,
                                  async_op=True))
        received.append(recv)
    for work in works:
        work.wait()
    return [_unpad(recv, updates[item.index]) for item, recv in zip(owned, received)]


def _padded_numel(shape: tuple[int, ...], dim: int, n: int) -> int:
    return -(-shape[dim] // n) * (_numel(shape) // shape[dim] if shape[dim] else 0)


def _shard_shape(shape: tuple[int, ...], dim: int, size: int) -> tuple[int, ...]:
    return tuple(size if d == dim else s for d, s in enumerate(shape))


def _owner_result(item: _Owned, ortho: Ortho, n: int) -> list[torch.Tensor]:
    """On the owner: the whole tensor from the gathered shards, orthogonalised, cut into
    the padded pieces each rank receives."""
    sizes = _chunk_sizes(item.shape[item.dim], n)
    shards = [part[:_numel(_shard_shape(item.shape, item.dim, s))].view(
        _shard_shape(item.shape, item.dim, s)) for part, s in zip(item.parts, sizes)]
    result = ortho(torch.cat(shards, dim=item.dim))
    pieces = []
    for piece in torch.split(result, sizes, dim=item.dim):
        buf = torch.zeros_like(item.send)
        buf[:piece.numel()] = piece.reshape(-1)
        pieces.append(buf)
    return pieces


def _unpad(recv: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    local = local_tensor(update)
    return recv[:local.numel()].view(local.shape)
