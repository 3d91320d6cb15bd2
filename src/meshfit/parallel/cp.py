"""Context parallelism: each sequence split over the ``cp`` ranks, causal attention computed
as a ring (Liu et al. 2023, "Ring Attention with Blockwise Transformers for Near-Infinite
Context"), with head-tail load balancing (Brandon et al. 2023, "Striped Attention"; the
"zigzag" split of Megatron-LM and torchtitan).

**Sharding.** A sequence of T tokens is cut into 2·cp chunks of T / (2·cp). With load
balancing (the default) rank r holds chunks r and 2·cp-1-r: under a causal mask the late
chunks see more keys than the early ones, and each rank then holds one of each, so every
rank does the same work. Without it rank r holds the r-th of cp contiguous pieces (rank
cp-1 does cp times the work of rank 0). `shard_sequence` cuts a [B, T, ...] tensor (tokens,
targets, position ids) the same way; `sequence_positions` gives the global positions of a
rank's tokens, which RoPE and learned position embeddings need.

**The ring, forward.** Rank r holds q, k, v of its tokens. At step s = 0 .. cp-1 it attends
its queries to the keys and values that started on rank (r - s) mod cp while the next block
travels to it (one `batch_isend_irecv` to rank r+1 and from rank r-1 of the cp group, started
before the step's compute). Each (query chunk, key chunk) pair is skipped (the keys come
later, or lie wholly outside a sliding window), causal (the same chunk), whole (earlier keys
inside the window) or banded (a window cuts it: an explicit mask of the chunks' global
positions). Scores may be capped before the softmax (softcap·tanh(s/softcap), Gemma 2's
attention logit softcapping), and values may be narrower than keys (DeepSeek's multi-head
latent attention): keys and values travel as one message. Partial results are merged in fp32
(fp64 for fp64 inputs) by their log-sum-exps: lse = logaddexp(lse₁, lse₂),
out = out₁·e^(lse₁-lse) + out₂·e^(lse₂-lse).

**The ring, backward.** The standard attention backward per block, with the final lse
(P = e^(S - lse)) and D = rowsum(dO ∘ O): dq accumulates on its rank; the keys and values
travel the ring again with their dk/dv accumulators, which are back on their owner after cp
steps. Grouped-query attention keeps the kv heads unrepeated (each kv head's dk/dv sums
over its query heads).

Each block runs on a fused attention kernel that returns the log-sum-exp where one exists
(`_kernel`: torch's flash kernel on the CPU, about 5x the matmul form on a 1024-token block
on this project's CPU machine; SDPA's flash or memory-efficient kernel on CUDA, each
accepted by a probe against the matmul form first), else as matmuls and a log-sum-exp (any
device, any dtype; banded and softcapped blocks, and values narrower than keys, always: the
kernels mask causally or not at all and cap nothing). The communication is
torch.distributed's P2P on the cp group (gloo on CPU, NCCL on CUDA). transformers' models
reach the ring through transformers' attention interface (`meshfit.parallel.cp_hf`).
"""

from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist

from meshfit._compat import ops as aten_ops
from meshfit.models.gpt import GPT, Attention
from meshfit.models.plans import adapted_model
from meshfit.parallel.cp_hf import apply_cp_hf, cp_problem

__all__ = ["HF_FAMILIES", "SequenceShard", "apply_cp", "check_hf_config", "chunk_ids",
           "cp_problem", "ring_attention", "sequence_positions", "shard_sequence",
           "unshard_sequence"]


# ---------------------------------------------------------------------------- sharding
def chunk_ids(cp: int, rank: int, balanced: bool = True) -> tuple[int, ...]:
    """The chunks of a sequence cut into 2·cp (balanced) or cp pieces that `rank` holds."""
    return (rank, 2 * cp - 1 - rank) if balanced else (rank,)


def _pieces(cp: int, balanced: bool) -> int:
    return 2 * cp if balanced else cp


def shard_sequence(t: torch.Tensor, dim: int, cp: int, rank: int,
                   balanced: bool = True) -> torch.Tensor:
    """`rank`'s part of `t` along its sequence dimension `dim` (a copy, contiguous)."""
    n = _pieces(cp, balanced)
    if t.shape[dim] % n:
        raise ValueError(f"context parallel: a sequence of {t.shape[dim]} tokens does not "
                         f"split into {n} equal chunks (cp={cp}"
                         f"{', load-balanced: 2 x cp chunks' if balanced else ''}); use a "
                         f"sequence length divisible by {n}")
    chunks = t.chunk(n, dim=dim)
    return torch.cat([chunks[i] for i in chunk_ids(cp, rank, balanced)], dim=dim).contiguous()


def unshard_sequence(parts: list[torch.Tensor], dim: int, balanced: bool = True) -> torch.Tensor:
    """The whole sequence from every rank's part (`shard_sequence`'s inverse), in rank order."""
    cp = len(parts)
    n = _pieces(cp, balanced)
    chunks: list[torch.Tensor | None] = [None] * n
    for rank, part in enumerate(parts):
        ids = chunk_ids(cp, rank, balanced)
        for i, piece in zip(ids, part.chunk(len(ids), dim=dim)):
            chunks[i] = piece
    return torch.cat(chunks, dim=dim)


def sequence_positions(seq_len: int, cp: int, rank: int, balanced: bool = True,
                       device=None) -> torch.Tensor:
    """The global positions (int64, [seq_len / cp]) of the tokens `rank` holds."""
    return shard_sequence(torch.arange(seq_len, device=device), 0, cp, rank, balanced)


# ---------------------------------------------------------------------------- blocks
def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _band(tq: int, tk: int, band: tuple[int, int | None], device) -> torch.Tensor:
    """[Tq, Tk] bool: key j is seen by query i where 0 <= offset + i - j < window (the
    distance of their global positions; window None: no upper bound)."""
    offset, window = band
    d = offset + torch.arange(tq, device=device).unsqueeze(1) - torch.arange(tk, device=device)
    keep = d >= 0
    return keep if window is None else keep & (d < window)


def _scores(q, k, scale: float, band, softcap: float | None, acc: torch.dtype):
    """q [B, Hkv, G, Tq, D] x k [B, Hkv, 1, Tk, D] -> (scores [B, Hkv, G, Tq, Tk] in `acc`,
    the softcap's derivative or None). Scores are scaled, capped as softcap·tanh(s/softcap)
    where `softcap` (Gemma 2's attention logit softcapping), and -inf outside `band`
    (`_band`; None: every key)."""
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    slope = None
    if softcap is not None:
        t = torch.tanh(s / softcap)
        s, slope = t * softcap, 1 - t * t
    if band is not None:
        s = s.masked_fill(~_band(s.shape[-2], s.shape[-1], band, s.device), float("-inf"))
    return s, slope


def _heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hkv, 1 or G, T, D] -> [B, Hkv x G, T, D] (kv heads repeated for their queries)."""
    B, hkv, _, T, D = t.shape
    return t.expand(B, hkv, groups, T, D).reshape(B, hkv * groups, T, D).contiguous()


# Fused kernels that return the log-sum-exp, by name (SDPA's private kernels, called through
# `meshfit._compat.ops`): forward(q, k, v, causal, scale) -> (out, lse [B, H, T] in fp32,
# fp64 for fp64 inputs) and backward(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv),
# all [B, H, T, D] in the inputs' dtype.
_KERNELS = {"cpu_flash": (aten_ops.cpu_flash_forward, aten_ops.cpu_flash_backward),
            "cuda_flash": (aten_ops.cuda_flash_forward, aten_ops.cuda_flash_backward),
            "cuda_efficient": (aten_ops.cuda_efficient_forward,
                               aten_ops.cuda_efficient_backward)}
_CHOSEN: dict[tuple[str, torch.dtype, int], str | None] = {}
"""(device type, dtype, head dim) -> the kernel the probe accepted there (None: matmuls)."""


def _kernel(q: torch.Tensor) -> str | None:
    """The fused kernel a block on `q`'s device and dtype runs on (None: the matmul form).
    On the CPU, torch's flash kernel (about 5x the matmul form's speed on a 1024-token
    block on this project's CPU machine). On CUDA, SDPA's flash kernel (fp16/bf16) or its
    memory-efficient one (fp32), each used only after a probe found its forward and
    backward equal to the matmul form on a small block (once per device type, dtype and
    head size): the private ops' signatures move between torch releases."""
    key = (q.device.type, q.dtype, q.shape[-1])
    if key not in _CHOSEN:
        if q.device.type == "cpu":
            ok = q.dtype in (torch.float32, torch.float64, torch.bfloat16) and \
                aten_ops.has_cpu_flash()
            _CHOSEN[key] = "cpu_flash" if ok else None
        elif q.device.type == "cuda" and q.dtype != torch.float64:
            name = "cuda_efficient" if q.dtype == torch.float32 else "cuda_flash"
            _CHOSEN[key] = name if _probe(name, q) else None
        else:
            _CHOSEN[key] = None
    return _CHOSEN[key]


CAUSAL = (0, None)
"""The band of a chunk with itself: causal, no window (what the fused kernels mask)."""


def _probe(name: str, like: torch.Tensor) -> bool:
    """Whether kernel `name` gives the matmul form's block forward and backward."""
    forward, backward = _KERNELS[name]
    g = torch.Generator(device=like.device).manual_seed(0)
    q, k, v, dout = (torch.randn(1, 2, 64, like.shape[-1], device=like.device,
                                 dtype=like.dtype, generator=g) for _ in range(4))
    scale = like.shape[-1] ** -0.5
    try:
        for causal in (True, False):
            band = CAUSAL if causal else None
            out, lse = forward(q, k, v, causal, scale)
            dq, dk, dv = backward(dout, q, k, v, out, lse, causal, scale)
            acc = torch.float32
            grouped = [t.unsqueeze(2) for t in (q, k, v, dout)]
            ref_out, ref_lse = _matmul_forward(*grouped[:3], scale, band, None, acc)
            delta = (grouped[3].to(acc) * ref_out).sum(-1)
            ref = _matmul_backward(grouped[3].to(acc), *grouped[:3], ref_lse, delta, scale,
                                   band, None, acc)
            tol = 1e-2 if like.dtype != torch.float32 else 1e-4
            pairs = [(out, ref_out), (lse, ref_lse), (dq, ref[0]), (dk, ref[1]), (dv, ref[2])]
            if not all(torch.allclose(a.float().reshape(b.shape), b.float(), rtol=tol, atol=tol)
                       for a, b in pairs):
                return False
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return False
    return True


def _fused(q, v, band, softcap) -> str | None:
    """The fused kernel for a block (None: the matmul form). The kernels mask causally or
    not at all, take one head size and cannot cap the scores before their softmax: a block
    cut by a sliding window, a softcapped one or one whose values are narrower than its
    keys (DeepSeek's MLA) runs as matmuls."""
    if band not in (None, CAUSAL) or softcap is not None or v.shape[-1] != q.shape[-1]:
        return None
    return _kernel(q)


def _block_forward(q, k, v, scale: float, band, softcap, acc: torch.dtype):
    name = _fused(q, v, band, softcap)
    if name is not None:
        B, hkv, G, T, D = q.shape
        out, lse = _KERNELS[name][0](_heads(q, G), _heads(k, G), _heads(v, G),
                                     band is not None, scale)
        return out.view(B, hkv, G, T, D).to(acc), lse.view(B, hkv, G, T).to(acc)
    return _matmul_forward(q, k, v, scale, band, softcap, acc)


def _matmul_forward(q, k, v, scale: float, band, softcap, acc: torch.dtype):
    s, _ = _scores(q, k, scale, band, softcap, acc)
    lse = torch.logsumexp(s, dim=-1)  # [B, Hkv, G, Tq]; -inf where a window hides every key
    p = torch.exp(s - lse.masked_fill(lse == float("-inf"), 0).unsqueeze(-1))
    return torch.matmul(p, v.to(acc)), lse


def _merge(out, lse, block_out, block_lse):
    """(out, lse) of the union of two key sets, from each one's (log-sum-exp stable; a row
    that sees no key in either keeps lse -inf and output 0)."""
    if out is None:
        return block_out, block_lse
    new = torch.logaddexp(lse, block_lse)
    ref = new.masked_fill(new == float("-inf"), 0)
    return (out * torch.exp(lse - ref).unsqueeze(-1)
            + block_out * torch.exp(block_lse - ref).unsqueeze(-1)), new


def _block_backward(dout, q, k, v, lse, rows, scale: float, band, softcap, acc: torch.dtype):
    """(dq, dk, dv) of one (query chunk, key chunk) block, given the final lse and the query
    chunk's `_Rows` (rowsum(dO * O) for the matmul form, the final output for a kernel); dk,
    dv summed over the query heads of each kv head."""
    name = _fused(q, v, band, softcap)
    if name is None:
        return _matmul_backward(dout, q, k, v, lse, rows.delta, scale, band, softcap, acc)
    B, hkv, G, T, D = q.shape
    Tk, dt = k.shape[-2], q.dtype
    dq, dk, dv = _KERNELS[name][1](
        _heads(dout.to(dt), G), _heads(q, G), _heads(k, G), _heads(v, G),
        _heads(rows.out.to(dt), G),
        lse.reshape(B, hkv * G, T).to(torch.float64 if dt == torch.float64 else torch.float32)
        .contiguous(), band is not None, scale)
    return (dq.view(B, hkv, G, T, D).to(acc),
            dk.view(B, hkv, G, Tk, D).sum(dim=2, keepdim=True).to(acc),
            dv.view(B, hkv, G, Tk, D).sum(dim=2, keepdim=True).to(acc))


def _matmul_backward(dout, q, k, v, lse, delta, scale: float, band, softcap,
                     acc: torch.dtype):
    s, slope = _scores(q, k, scale, band, softcap, acc)
    p = torch.exp(s - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), dout).sum(dim=2, keepdim=True)
    dp = torch.matmul(dout, v.to(acc).transpose(-1, -2))
    ds = p * (dp - delta.unsqueeze(-1))
    if slope is not None:  # d(softcap·tanh(s/softcap))/ds = 1 - tanh²
        ds = ds * slope
    dq = torch.matmul(ds, k.to(acc)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.to(acc)).sum(dim=2, keepdim=True) * scale
    return dq, dk, dv


class _Rows:
    """A query chunk's rowsum(dO * O) (the matmul backward's) and final output (the kernel's)."""

    __slots__ = ("delta", "out")

    def __init__(self, delta: torch.Tensor, out: torch.Tensor) -> None:
        self.delta, self.out = delta, out


def _band_of(off: int, n: int, window: int | None):
    """A block of n queries over n keys that start `off` positions before them: "skip"
    (the keys come later, or lie wholly `window` or more positions back), None (every key
    seen) or `_band`'s (offset, window)."""
    if off < 0 or (window is not None and off > 0 and off - n + 1 >= window):
        return "skip"
    whole = window is None or off + n - 1 < window
    return None if off > 0 and whole else (off, None if whole else window)


_MIN_SUB = 32
"""The narrowest block a chunk pair cut by a window is split into (narrower ones cost more
in per-block overhead than their masked matmuls save). Blocks of about an eighth of the
window: on this project's (shared, noisy) 2-core CPU machine, the ring over 8,192 tokens on
2 ranks with a window of 1,024 took 0.3-0.45x the time of the full causal ring, forward and
backward (blocks as wide as the window: ~0.9x; chunk pairs left whole: ~2.3x, the masked
matmul form being ~5x slower than the fused kernel)."""


def _pairs(mine: tuple[int, ...], theirs: tuple[int, ...], c: int, window: int | None):
    """(query rows, key rows, band) of the blocks that are not all masked, for chunks of `c`
    tokens: a key chunk after the query chunk, or wholly outside the window, is skipped;
    band None where every key is seen, else `_band`'s (offset, window). A chunk pair the
    window cuts is cut again into blocks of the largest divisor of c no wider than an eighth
    of the window (or `_MIN_SUB`), so that only the blocks the window's edge crosses run as
    masked matmuls; the others run whole or causal, on the fused kernel, or are skipped."""
    sub = c if window is None else max(
        d for d in range(1, min(c, max(window // 8, _MIN_SUB)) + 1) if c % d == 0)
    for i, a in enumerate(mine):
        for j, b in enumerate(theirs):
            band = _band_of((a - b) * c, c, window)
            if band == "skip":
                continue
            if band is None or band[1] is None or sub == c:
                yield slice(i * c, (i + 1) * c), slice(j * c, (j + 1) * c), band
                continue
            for q0 in range(0, c, sub):  # key blocks from window + sub - 1 back to q0
                first = max(0, (a - b) * c + q0 - window - sub + 1)
                for k0 in range(first - first % sub, min(c, (a - b) * c + q0 + 1), sub):
                    part = _band_of((a - b) * c + q0 - k0, sub, window)
                    if part != "skip":
                        yield (slice(i * c + q0, i * c + q0 + sub),
                               slice(j * c + k0, j * c + k0 + sub), part)


# ---------------------------------------------------------------------------- the ring
class _Ring:
    """Sends to the next rank of the cp group and receives from the previous one."""

    def __init__(self, group) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, tensors: list[torch.Tensor]):
        """Send `tensors` on and receive the previous rank's; returns (received, works)."""
        received = [torch.empty_like(t) for t in tensors]
        ops = []
        for t, r in zip(tensors, received):
            ops.append(dist.P2POp(dist.isend, t, self.next, self.group))
            ops.append(dist.P2POp(dist.irecv, r, self.prev, self.group))
        return received, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(works) -> None:
        for w in works:
            w.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, group, balanced: bool, scale: float, window, softcap):
        ring = _Ring(group)
        cp, rank = ring.size, ring.rank
        acc = _acc_dtype(q.dtype)
        B, H, T, D = q.shape
        hkv = k.shape[1]
        qg = q.view(B, hkv, H // hkv, T, D)
        mine = chunk_ids(cp, rank, balanced)
        n = len(mine)
        c = T // n
        out = torch.zeros((B, hkv, H // hkv, T, v.shape[-1]), dtype=acc, device=q.device)
        lse = torch.full((B, hkv, H // hkv, T), float("-inf"), dtype=acc, device=q.device)
        kv = torch.cat([k, v], dim=-1).unsqueeze(2)  # [B, Hkv, 1, T, D + Dv]: one message
        for step in range(cp):
            works = None
            if step < cp - 1:
                nxt, works = ring.start([kv])
            theirs = chunk_ids(cp, (rank - step) % cp, balanced)
            for qs, ks, band in _pairs(mine, theirs, c, window):
                o, block_lse = _block_forward(qg[..., qs, :], kv[..., ks, :D],
                                              kv[..., ks, D:], scale, band, softcap, acc)
                out[..., qs, :], lse[..., qs] = _merge(out[..., qs, :], lse[..., qs], o,
                                                       block_lse)
            if works is not None:
                ring.wait(works)
                kv = nxt[0]
        # (every query sees at least itself: no row is left at -inf)
        if sinks is not None:  # one more logit per head in each row's softmax, value 0
            out, lse = _merge(out, lse, torch.zeros_like(out),
                              sinks.to(acc).view(1, hkv, H // hkv, 1).expand_as(lse))
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.group, ctx.balanced, ctx.scale = group, balanced, scale
        ctx.window, ctx.softcap = window, softcap
        return out.view(B, H, T, v.shape[-1]).to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        ring = _Ring(ctx.group)
        cp, rank, scale = ring.size, ring.rank, ctx.scale
        acc = _acc_dtype(q.dtype)
        B, H, T, D = q.shape
        hkv, Dv = k.shape[1], v.shape[-1]
        qg = q.view(B, hkv, H // hkv, T, D)
        do = dout.reshape(B, hkv, H // hkv, T, Dv).to(acc)
        delta = (do * out).sum(dim=-1)  # [B, Hkv, G, T] (the matmul form's)
        mine = chunk_ids(cp, rank, ctx.balanced)
        n = len(mine)
        c = T // n
        dq = torch.zeros(qg.shape, dtype=acc, device=q.device)
        kv = torch.cat([k, v], dim=-1).unsqueeze(2)
        dkv = torch.zeros((B, hkv, 1, T, D + Dv), dtype=acc, device=q.device)
        for step in range(cp):
            theirs = chunk_ids(cp, (rank - step) % cp, ctx.balanced)
            kv_works = None
            if step < cp - 1:  # the keys and values move on while this block computes
                kv_next, kv_works = ring.start([kv])
            for qs, ks, band in _pairs(mine, theirs, c, ctx.window):
                rows = _Rows(delta[..., qs], out[..., qs, :])
                bq, bk, bv = _block_backward(do[..., qs, :], qg[..., qs, :], kv[..., ks, :D],
                                             kv[..., ks, D:], lse[..., qs], rows,
                                             scale, band, ctx.softcap, acc)
                dq[..., qs, :] += bq
                dkv[..., ks, :D] += bk
                dkv[..., ks, D:] += bv
            # the accumulators follow their keys: after cp moves they are home
            dkv_next, dkv_works = ring.start([dkv])
            if kv_works is not None:
                ring.wait(kv_works)
                kv = kv_next[0]
            ring.wait(dkv_works)
            dkv = dkv_next[0]
        dq = dq.view(B, H, T, D).to(q.dtype)
        dk = dkv[..., :D].squeeze(2).to(k.dtype)
        dv = dkv[..., D:].squeeze(2).to(v.dtype)
        dsinks = None
        if sinks is not None:  # a sink's score s: dL/ds = -sum of P_sink x rowsum(dO * O)
            p_sink = torch.exp(sinks.to(acc).view(1, hkv, H // hkv, 1) - lse)
            dsinks = -(p_sink * delta).sum(dim=(0, 3)).reshape(H).to(sinks.dtype)
        return dq, dk, dv, dsinks, None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, *,
                   balanced: bool = True, scale: float | None = None,
                   window: int | None = None, softcap: float | None = None,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence's keys and values,
    each cp rank holding its part (`shard_sequence`) of all three: q [B, H, T/cp, D], k
    [B, Hkv, T/cp, D] and v [B, Hkv, T/cp, Dv] (Hkv divides H: grouped-query attention; Dv
    may differ from D, as in DeepSeek's multi-head latent attention). Returns this rank's
    output [B, H, T/cp, Dv], equal to that part of causal attention over the whole
    sequence; differentiable. `window`: a sliding window, each query seeing the keys less
    than `window` positions back (transformers' sliding_window); `softcap`: scores capped as
    softcap·tanh(s/softcap) before the softmax (Gemma 2); `sinks` [H]: one more logit per
    head in every row's softmax, attending to nothing (GPT-OSS's attention sinks).
    `group`: the cp ranks (a process group); `balanced` must be how the sequence was
    sharded. A collective: every rank of `group` calls it."""
    if q.dim() != 4 or k.dim() != 4 or k.shape[:3] != v.shape[:3] or k.shape[0] != q.shape[0] \
            or k.shape[2:] != q.shape[2:] or q.shape[1] % k.shape[1]:
        raise ValueError(f"ring_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v "
                         f"{tuple(v.shape)} must be [B, H, T, D], [B, Hkv, T, D] and "
                         "[B, Hkv, T, Dv] with Hkv dividing H")
    n = 2 if balanced else 1
    if q.shape[2] % n:
        raise ValueError(f"ring_attention: {q.shape[2]} local tokens do not hold {n} equal "
                         "chunks; shard the sequence with shard_sequence(balanced=...)")
    for name, value in (("window", window), ("softcap", softcap)):
        if value is not None and not value > 0:
            raise ValueError(f"ring_attention: {name}={value!r} must be positive, or None")
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise ValueError(f"ring_attention: sinks {tuple(sinks.shape)} must hold one value per "
                         f"query head ({q.shape[1]})")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _RingAttention.apply(q, k, v, sinks, group, balanced, scale, window, softcap)


# ---------------------------------------------------------------------------- models
class SequenceShard:
    """What a model under context parallel knows of its input: this rank's part of each
    sequence (`shard_sequence`), how to place it (`positions`) and how to attend (`attend`,
    the ring over the cp group). Set on the model (and its attention modules) by `apply_cp`;
    the models call it without importing this module."""

    def __init__(self, group, balanced: bool = True) -> None:
        self.group, self.balanced = group, balanced
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def positions(self, local_len: int, device=None) -> torch.Tensor:
        """The global positions of the `local_len` tokens this rank holds."""
        return sequence_positions(local_len * self.size, self.size, self.rank, self.balanced,
                                  device=device)

    def shard(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        return shard_sequence(t, dim, self.size, self.rank, self.balanced)

    def attend(self, q, k, v, *, scale: float | None = None, window: int | None = None,
               softcap: float | None = None, sinks=None) -> torch.Tensor:
        """`ring_attention` over this shard's group."""
        return ring_attention(q, k, v, self.group, balanced=self.balanced, scale=scale,
                              window=window, softcap=softcap, sinks=sinks)


HF_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "mixtral", "gemma2",
               "gemma3_text", "phi3", "olmo2", "gpt_neox", "granite", "smollm3", "glm4_moe",
               "deepseek_v3", "qwen2_moe")
"""transformers model types tested under context parallel (`meshfit.models.families`): the
ring runs every model class whose attention goes through transformers' attention interface
(`meshfit.parallel.cp_hf`), these and others."""


def apply_cp(model: torch.nn.Module, cp_mesh, *, balanced: bool = True) -> SequenceShard:
    """Make `model` take this rank's part of each sequence: its attention becomes the ring
    over `cp_mesh`, its positions the tokens' global ones. The reference GPT (dense or
    mixture of experts), and every transformers decoder whose attention goes through
    transformers' attention interface (`meshfit.parallel.cp_hf`: sliding windows,
    softcapping, scalings and position ids as the model has them), LoRA-adapted or not.
    Returns the `SequenceShard` (the inputs and targets fed to the model must be cut by its
    `shard`)."""
    base = adapted_model(model)
    hf = sys.modules.get("transformers")
    if hf is not None and isinstance(base, hf.PreTrainedModel):
        shard = SequenceShard(cp_mesh.get_group(), balanced)
        apply_cp_hf(base, shard)
        return shard
    if not isinstance(base, GPT):
        raise ValueError(f"context parallel (cp > 1) runs the attention of the reference GPT "
                         f"and of transformers decoders whose attention goes through "
                         f"transformers' attention interface as a ring; "
                         f"{type(base).__name__} is neither; use cp=1 with it")
    if base.config.dropout > 0:
        raise ValueError(f"context parallel (cp > 1) with attention dropout "
                         f"(dropout={base.config.dropout}) is not available: the ring computes "
                         "exact attention; set the model's dropout to 0")
    shard = SequenceShard(cp_mesh.get_group(), balanced)
    base.sequence_shard = shard
    for module in base.modules():
        if isinstance(module, Attention):
            module.sequence_shard = shard
    return shard


def check_hf_config(config, seq_len: int | None = None) -> str | None:
    """Why a transformers model of `config` cannot run under context parallel, or None
    (`meshfit.parallel.cp_hf.cp_problem` with cp=2 and no length check: its successor)."""
    return cp_problem(config, 2)
