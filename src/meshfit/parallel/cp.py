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
later), causal (the same chunk) or whole (earlier keys). Partial results are merged in fp32
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
device, any dtype). The communication is torch.distributed's P2P on the cp group
(gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist

from meshfit._compat import ops as aten_ops
from meshfit._compat import transformers as hf_internals
from meshfit.models.gpt import GPT, Attention
from meshfit.models.plans import adapted_model

__all__ = ["HF_FAMILIES", "SequenceShard", "apply_cp", "check_hf_config", "chunk_ids", "ring_attention", "sequence_positions",
           "shard_sequence", "unshard_sequence"]


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


def _scores(q, k, scale: float, causal: bool, acc: torch.dtype) -> torch.Tensor:
    """q [B, Hkv, G, Tq, D] x k [B, Hkv, 1, Tk, D] -> scaled scores [B, Hkv, G, Tq, Tk] in
    `acc`, future keys at -inf where `causal` (Tq == Tk, the same chunk)."""
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    if causal:
        t = s.shape[-1]
        future = torch.ones(t, t, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    return s


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


def _probe(name: str, like: torch.Tensor) -> bool:
    """Whether kernel `name` gives the matmul form's block forward and backward."""
    forward, backward = _KERNELS[name]
    g = torch.Generator(device=like.device).manual_seed(0)
    q, k, v, dout = (torch.randn(1, 2, 64, like.shape[-1], device=like.device,
                                 dtype=like.dtype, generator=g) for _ in range(4))
    scale = like.shape[-1] ** -0.5
    try:
        for causal in (True, False):
            out, lse = forward(q, k, v, causal, scale)
            dq, dk, dv = backward(dout, q, k, v, out, lse, causal, scale)
            acc = torch.float32
            grouped = [t.unsqueeze(2) for t in (q, k, v, dout)]
            ref_out, ref_lse = _matmul_forward(*grouped[:3], scale, causal, acc)
            delta = (grouped[3].to(acc) * ref_out).sum(-1)
            ref = _matmul_backward(grouped[3].to(acc), *grouped[:3], ref_lse, delta, scale,
                                   causal, acc)
            tol = 1e-2 if like.dtype != torch.float32 else 1e-4
            pairs = [(out, ref_out), (lse, ref_lse), (dq, ref[0]), (dk, ref[1]), (dv, ref[2])]
            if not all(torch.allclose(a.float().reshape(b.shape), b.float(), rtol=tol, atol=tol)
                       for a, b in pairs):
                return False
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return False
    return True


def _block_forward(q, k, v, scale: float, causal: bool, acc: torch.dtype):
    name = _kernel(q)
    if name is not None:
        B, hkv, G, T, D = q.shape
        out, lse = _KERNELS[name][0](_heads(q, G), _heads(k, G), _heads(v, G), causal, scale)
        return out.view(B, hkv, G, T, D).to(acc), lse.view(B, hkv, G, T).to(acc)
    return _matmul_forward(q, k, v, scale, causal, acc)


def _matmul_forward(q, k, v, scale: float, causal: bool, acc: torch.dtype):
    s = _scores(q, k, scale, causal, acc)
    lse = torch.logsumexp(s, dim=-1)  # [B, Hkv, G, Tq]
    p = torch.exp(s - lse.unsqueeze(-1))
    return torch.matmul(p, v.to(acc)), lse


def _merge(out, lse, block_out, block_lse):
    """(out, lse) of the union of two key sets, from each one's (log-sum-exp stable)."""
    if out is None:
        return block_out, block_lse
    new = torch.logaddexp(lse, block_lse)
    return (out * torch.exp(lse - new).unsqueeze(-1)
            + block_out * torch.exp(block_lse - new).unsqueeze(-1)), new


def _block_backward(dout, q, k, v, lse, rows, scale: float, causal: bool, acc: torch.dtype):
    """(dq, dk, dv) of one (query chunk, key chunk) block, given the final lse and the query
    chunk's `_Rows` (rowsum(dO * O) for the matmul form, the final output for a kernel); dk,
    dv summed over the query heads of each kv head."""
    name = _kernel(q)
    if name is None:
        return _matmul_backward(dout, q, k, v, lse, rows.delta, scale, causal, acc)
    B, hkv, G, T, D = q.shape
    Tk, dt = k.shape[-2], q.dtype
    dq, dk, dv = _KERNELS[name][1](
        _heads(dout.to(dt), G), _heads(q, G), _heads(k, G), _heads(v, G),
        _heads(rows.out.to(dt), G),
        lse.reshape(B, hkv * G, T).to(torch.float64 if dt == torch.float64 else torch.float32)
        .contiguous(), causal, scale)
    return (dq.view(B, hkv, G, T, D).to(acc),
            dk.view(B, hkv, G, Tk, D).sum(dim=2, keepdim=True).to(acc),
            dv.view(B, hkv, G, Tk, D).sum(dim=2, keepdim=True).to(acc))


def _matmul_backward(dout, q, k, v, lse, delta, scale: float, causal: bool, acc: torch.dtype):
    s = _scores(q, k, scale, causal, acc)
    p = torch.exp(s - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), dout).sum(dim=2, keepdim=True)
    dp = torch.matmul(dout, v.to(acc).transpose(-1, -2))
    ds = p * (dp - delta.unsqueeze(-1))
    dq = torch.matmul(ds, k.to(acc)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.to(acc)).sum(dim=2, keepdim=True) * scale
    return dq, dk, dv


class _Rows:
    """A query chunk's rowsum(dO * O) (the matmul backward's) and final output (the kernel's)."""

    __slots__ = ("delta", "out")

    def __init__(self, delta: torch.Tensor, out: torch.Tensor) -> None:
        self.delta, self.out = delta, out


def _pairs(mine: tuple[int, ...], theirs: tuple[int, ...]):
    """(query chunk index, key chunk index, causal) of the blocks that are not all masked."""
    for i, a in enumerate(mine):
        for j, b in enumerate(theirs):
            if a >= b:
                yield i, j, a == b


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
    def forward(ctx, q, k, v, group, balanced: bool, scale: float):
        ring = _Ring(group)
        cp, rank = ring.size, ring.rank
        acc = _acc_dtype(q.dtype)
        B, H, T, D = q.shape
        hkv = k.shape[1]
        qg = q.view(B, hkv, H // hkv, T, D)
        mine = chunk_ids(cp, rank, balanced)
        n = len(mine)
        c = T // n
        outs: list = [None] * n
        lses: list = [None] * n
        kv = torch.stack([k, v]).unsqueeze(3)  # [2, B, Hkv, 1, T, D]: one message
        for step in range(cp):
            works = None
            if step < cp - 1:
                nxt, works = ring.start([kv])
            theirs = chunk_ids(cp, (rank - step) % cp, balanced)
            for i, j, causal in _pairs(mine, theirs):
                o, lse = _block_forward(qg[..., i * c:(i + 1) * c, :],
                                        kv[0][..., j * c:(j + 1) * c, :],
                                        kv[1][..., j * c:(j + 1) * c, :], scale, causal, acc)
                outs[i], lses[i] = _merge(outs[i], lses[i], o, lse)
            if works is not None:
                ring.wait(works)
                kv = nxt[0]
        out = torch.cat(outs, dim=-2)  # every query chunk sees at least its own diagonal
        lse = torch.cat(lses, dim=-1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.balanced, ctx.scale = group, balanced, scale
        return out.view(B, H, T, D).to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.group)
        cp, rank, scale = ring.size, ring.rank, ctx.scale
        acc = _acc_dtype(q.dtype)
        B, H, T, D = q.shape
        hkv = k.shape[1]
        qg = q.view(B, hkv, H // hkv, T, D)
        do = dout.reshape(B, hkv, H // hkv, T, D).to(acc)
        delta = (do * out).sum(dim=-1)  # [B, Hkv, G, T] (the matmul form's)
        mine = chunk_ids(cp, rank, ctx.balanced)
        n = len(mine)
        c = T // n
        dq = torch.zeros_like(do)
        kv = torch.stack([k, v]).unsqueeze(3)
        dkv = torch.zeros((2, B, hkv, 1, T, D), dtype=acc, device=q.device)
        for step in range(cp):
            theirs = chunk_ids(cp, (rank - step) % cp, ctx.balanced)
            kv_works = None
            if step < cp - 1:  # the keys and values move on while this block computes
                kv_next, kv_works = ring.start([kv])
            for i, j, causal in _pairs(mine, theirs):
                qs, ks = slice(i * c, (i + 1) * c), slice(j * c, (j + 1) * c)
                rows = _Rows(delta[..., qs], out[..., qs, :])
                bq, bk, bv = _block_backward(do[..., qs, :], qg[..., qs, :], kv[0][..., ks, :],
                                             kv[1][..., ks, :], lse[..., qs], rows,
                                             scale, causal, acc)
                dq[..., qs, :] += bq
                dkv[0][..., ks, :] += bk
                dkv[1][..., ks, :] += bv
            # the accumulators follow their keys: after cp moves they are home
            dkv_next, dkv_works = ring.start([dkv])
            if kv_works is not None:
                ring.wait(kv_works)
                kv = kv_next[0]
            ring.wait(dkv_works)
            dkv = dkv_next[0]
        dq = dq.view(B, H, T, D).to(q.dtype)
        dk = dkv[0].squeeze(2).to(k.dtype)
        dv = dkv[1].squeeze(2).to(v.dtype)
        return dq, dk, dv, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, *,
                   balanced: bool = True, scale: float | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence's keys and values,
    each cp rank holding its part (`shard_sequence`) of all three: q [B, H, T/cp, D], k and v
    [B, Hkv, T/cp, D] (Hkv divides H: grouped-query attention). Returns this rank's output
    [B, H, T/cp, D], equal to that part of causal attention over the whole sequence;
    differentiable. `group`: the cp ranks (a process group); `balanced` must be how the
    sequence was sharded. A collective: every rank of `group` calls it."""
    if q.dim() != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] \
            or k.shape[2:] != q.shape[2:] or q.shape[1] % k.shape[1]:
        raise ValueError(f"ring_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v "
                         f"{tuple(v.shape)} must be [B, H, T, D] and [B, Hkv, T, D] with Hkv "
                         "dividing H")
    n = 2 if balanced else 1
    if q.shape[2] % n:
        raise ValueError(f"ring_attention: {q.shape[2]} local tokens do not hold {n} equal "
                         "chunks; shard the sequence with shard_sequence(balanced=...)")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _RingAttention.apply(q, k, v, group, balanced, scale)


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

    def attend(self, q, k, v) -> torch.Tensor:
        return ring_attention(q, k, v, self.group, balanced=self.balanced)


HF_FAMILIES = ("llama", "qwen2", "mistral", "mixtral", "qwen2_moe")
"""transformers model types whose attention `apply_cp` runs as the ring (causal, RoPE from
position ids, grouped-query attention; no sliding window)."""
_HF_IMPLEMENTATION = "meshfit_ring"


def apply_cp(model: torch.nn.Module, cp_mesh, *, balanced: bool = True) -> SequenceShard:
    """Make `model` take this rank's part of each sequence: its attention becomes the ring
    over `cp_mesh`, its positions the tokens' global ones. The reference GPT (dense or
    mixture of experts), and transformers' Llama, Qwen2, Mistral and the mixtures of experts
    built on their attention, Mixtral and Qwen2-MoE (their attention swapped through
    transformers' attention interface, their position ids filled in), LoRA-adapted or not.
    Returns the
    `SequenceShard` (the inputs and targets fed to the model must be cut by its `shard`)."""
    base = adapted_model(model)
    hf = sys.modules.get("transformers")
    if hf is not None and isinstance(base, hf.PreTrainedModel):
        shard = SequenceShard(cp_mesh.get_group(), balanced)
        _apply_cp_hf(base, shard)
        return shard
    if not isinstance(base, GPT):
        raise ValueError(f"context parallel (cp > 1) runs the attention of the reference GPT "
                         f"and of transformers' {', '.join(HF_FAMILIES)} models as a ring; "
                         f"{type(base).__name__} is not yet supported")
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
    """Why a transformers model of `config` cannot run under context parallel, or None."""
    kind = getattr(config, "model_type", None)
    if kind not in HF_FAMILIES:
        return (f"model_type {kind!r} is not yet supported (the ring replaces the attention "
                f"of transformers' {', '.join(HF_FAMILIES)} models); use cp=1 with it")
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) and (
            seq_len is None or window < seq_len):
        return (f"its sliding-window attention (sliding_window={window}) is not available: "
                "the ring attends to the whole sequence; use a model or a sequence length "
                "without the window")
    if getattr(config, "attention_dropout", 0.0):
        return (f"attention_dropout={config.attention_dropout} is not available: the ring "
                "computes attention exactly; set it to 0")
    return None


def _hf_ring(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-interface function: the ring over `module.sequence_shard`
    (query [B, H, T, D], key/value [B, Hkv, T, D]; the causal mask is the ring's own)."""
    shard = module.sequence_shard
    out = ring_attention(query, key, value, shard.group, balanced=shard.balanced,
                         scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs):
    return None  # the ring masks causally itself: no [T, T] mask is ever built


def _apply_cp_hf(model, shard: SequenceShard) -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    problem = check_hf_config(model.config)
    if problem:
        raise ValueError(f"context parallel (cp > 1): {problem}")
    AttentionInterface.register(_HF_IMPLEMENTATION, _hf_ring)
    AttentionMaskInterface.register(_HF_IMPLEMENTATION, _no_mask)
    layers = [m for m in model.modules() if type(m).__name__.endswith("Attention")
              and hasattr(m, "o_proj")]
    if not layers:
        raise ValueError(f"context parallel: found no attention layer in "
                         f"{type(model).__name__}")
    for layer in layers:
        layer.sequence_shard = shard
    hf_internals.set_attention(model, _HF_IMPLEMENTATION)

    def place(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs["inputs_embeds"]
        if kwargs.get("attention_mask") is not None:
            raise ValueError("context parallel: an attention_mask (padding) is not "
                             "available; the ring attends causally over whole sequences")
        if kwargs.get("position_ids") is None:
            kwargs["position_ids"] = shard.positions(ids.shape[1], ids.device).expand(
                ids.shape[0], -1)
        return args, kwargs

    model.register_forward_pre_hook(place, with_kwargs=True)
