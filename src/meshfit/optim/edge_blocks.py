"""Quantized moments of a dim-0 shard that cuts the whole tensor's blocks, equal to one
process's.

torchao's 8-bit and 4-bit states scale each block of `block` consecutive elements of the
flattened tensor by its largest magnitude (Dettmers et al. 2022; Li et al. 2023). FSDP2
(ZeRO-2/3) gives each rank a contiguous range of the flattened tensor (`Shard(0)`); when a
range's length is not a multiple of the block size, its first and last blocks are also
partly another rank's, and a block's scale -- the largest magnitude over the whole block --
is known to no rank alone. torchao's subclass cannot hold such a range (its blocks are its
own), so these moments are kept in fp32 on every rank of that tensor, and after each step
each rank replaces its values by exactly what one process's quantized state dequantizes
to:

    scale of block k = max |x| over the whole block, clipped at 1e-12 (torchao's
        `scale_tensor`): the maxima of this rank's part of each block, with the two edge
        blocks' completed by one all-gather per tensor and step of every rank's edge maxima
        (6 numbers per rank: the edge blocks' indices, and their maxima for each moment);
    x <- qmap[quantize(x / scale)] * scale   (torchao's quantize and dequantize helpers).

A maximum is exact and the rest is element-wise, so the values equal one process's bit for
bit (with the same inputs), and the next step reads them as one process reads its
dequantized state. The moments cost fp32's 8 B/param for those tensors (as before: they are
listed by `meshfit.optim.states.unaligned`) and the step one small collective each, and the
requantization runs eagerly (compile=True or not): measured on 2 CPU ranks, 73 ms for a
105,600-element shard (1056 x 200 over 2), against 31-56 ms for torchao's eager step on a
shard of the same size that holds whole blocks and 0.6 ms with plain fp32 moments. With a
row length that is a multiple of the block size (GPT-2's 768, Llama's 4096) no dim-0 shard
cuts a block; the cases are 1-D tensors of >= 4096 elements sharded over many ranks (e.g.
Llama-3-8B's 4096-element norm weights over 64 ranks: 64 elements each) and small matrices
over many ranks.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

__all__ = ["cuts_blocks", "requantize_"]


def _shard_dim(p: torch.Tensor) -> int | None:
    """The mesh dimension of `p`'s one `Shard(0)` placement (all others replicated), or None
    for any other placement (and for a plain tensor)."""
    placements = getattr(p, "placements", None)
    if placements is None:
        return None
    sharded = [i for i, pl in enumerate(placements) if not pl.is_replicate()]
    if len(sharded) != 1 or not placements[sharded[0]].is_shard(0):
        return None
    return sharded[0]


def _ranges(p: torch.Tensor, dim: int) -> list[tuple[int, int]]:
    """Each rank's (start, length) in the flattened `p` along mesh dimension `dim`: torch's
    chunking of dim 0 (FSDP2's: ceil(rows / world) rows each, the last ranks fewer or none)."""
    world = p.device_mesh.size(dim)
    rows = p.shape[0]
    row = math.prod(p.shape[1:])
    chunk = -(-rows // world)
    out = []
    for rank in range(world):
        start = min(rank * chunk, rows)
        out.append((start * row, (min(start + chunk, rows) - start) * row))
    return out


def cuts_blocks(p: torch.Tensor, block: int) -> bool:
    """Whether `p` is sharded on dim 0 alone and some rank's range is not made of whole
    blocks (the same answer on every rank: all of them then take this module's path)."""
    dim = _shard_dim(p)
    return dim is not None and any(n % block for _, n in _ranges(p, dim))


def requantize_(p: torch.Tensor, moments: list[tuple[torch.Tensor, torch.Tensor]], block: int,
                bits: int) -> None:
    """Replace each (fp32 local moment, its quantization map) of `p`'s shard by the values one
    process's `bits`-bit state of the whole tensor dequantizes to (module docstring). The
    maps are the ones torchao's states hold (taken from a state it builds: the same in every
    torchao release). A collective: every rank of `p`'s shard group calls it for the same
    tensors in the same order."""
    from torchao.optim import quant_utils

    quantize = (quant_utils.quantize_8bit_with_qmap if bits == 8
                else quant_utils.quantize_4bit_with_qmap)
    dim = _shard_dim(p)
    start, n = _ranges(p, dim)[p.device_mesh.get_local_rank(dim)]
    device = moments[0][0].device
    first, last = start // block, (start + n - 1) // block
    index = (torch.arange(start, start + n, device=device) // block) - first
    amaxes = [torch.zeros(last - first + 1 if n else 0, device=device)
              .scatter_reduce_(0, index, m.reshape(-1).abs(), "amax") for m, _ in moments]
    _complete_edges(amaxes, (first, last) if n else (-1, -1), p.device_mesh, dim)
    for (m, qmap), amax in zip(moments, amaxes):
        qmap = qmap.to(device)
        scale = amax.clip(1e-12)[index]
        codes = quantize(m.reshape(-1) / scale, qmap)
        m.copy_((qmap[codes.int()] * scale).view(m.shape))


def _complete_edges(amaxes: list[torch.Tensor], edges: tuple[int, int], mesh,
                    dim: int) -> None:
    """Each rank's first and last block maxima (per moment) made the whole block's: one
    all-gather of (first, last, then each moment's two edge maxima) from every rank, in
    float64 (exact for fp32 maxima and block indices below 2^53), on the mesh's device (the
    moments may be on the CPU: FSDP2's offload)."""
    comm = torch.device(mesh.device_type)
    mine = [torch.tensor([float(edges[0]), float(edges[1])], dtype=torch.float64)]
    for amax in amaxes:
        mine.append(amax[[0, -1]].double().cpu() if amax.numel() else torch.zeros(2).double())
    mine = torch.cat(mine).to(comm)
    gathered = [torch.zeros_like(mine) for _ in range(mesh.size(dim))]
    dist.all_gather(gathered, mine, group=mesh.get_group(dim))
    rows = torch.stack(gathered).cpu()
    if not amaxes or not amaxes[0].numel():
        return
    for k, amax in enumerate(amaxes):
        for position, block in ((0, edges[0]), (-1, edges[1])):
            seen = torch.cat([rows[rows[:, 0] == block, 2 + 2 * k],
                              rows[rows[:, 1] == block, 3 + 2 * k]])
            amax[position] = seen.max().to(amax.dtype)
