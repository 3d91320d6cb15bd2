"""Reference decoder-only transformer: GPT-2 and Llama shapes from one `GPTConfig`.

Module layout follows torchtitan so parallel plans can address modules by name:

    tok_emb, pos_emb, drop, layers["0".."L-1"], norm, lm_head
    layers[i]: attn_norm, attn.{wq, wk, wv, wo}, mlp_norm, mlp.{w_in, w_out} | mlp.{w1, w2, w3}
    MoE block (GPTConfig.n_experts > 0, see meshfit.models.moe): mlp.router, mlp.shared,
               mlp.experts.{w_in, w_out} | mlp.experts.{w1, w2, w3} as stacked [E, ...] tensors

q/k/v are separate linears (not one fused qkv) so a tensor-parallel plan can shard each
column-wise; attention infers the local head count from the projection width, so it runs
unchanged when wq/wk/wv hold only a shard of the heads (Megatron-LM, Shoeybi et al. 2019).

A pipeline stage is the same class with parts removed: `tok_emb`, `pos_emb`, `norm`,
`lm_head` may be None and `layers` may miss keys. Keys keep their global index, so
parameter names (and hence checkpoints and `init_weights` values) match the full model.

Incremental decoding (`GPT.new_cache` + `GPT.forward_cached`) keeps each layer's keys and
values in a `KVCache`, so each new token costs one position's work instead of a forward over
the whole sequence. It is a separate path: `forward` (training) is not touched by it.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import warnings
from typing import get_args

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from meshfit._compat.nn import has_forward_hooks
from meshfit.models.config import AttentionBackend, GPTConfig
from meshfit.models.loss import linear_cross_entropy, plain_cross_entropy
from meshfit.models.mlp import GeluMLP, SwiGLUMLP
from meshfit.models.moe import Experts, MoE

__all__ = ["GPT", "GPTConfig", "Block", "Attention", "GeluMLP", "SwiGLUMLP", "KVCache",
           "count_params", "check_attention_backend"]

# torch's name of each `AttentionBackend` but "auto" (which leaves SDPA free to choose).
_SDPA_BACKENDS = {"math": "MATH", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                  "cudnn": "CUDNN_ATTENTION"}


def _sdpa_context(backend: str):
    """A context that restricts SDPA to `backend` (a no-op for "auto")."""
    if backend == "auto":
        return contextlib.nullcontext()
    return sdpa_kernel(getattr(SDPBackend, _SDPA_BACKENDS[backend]))


def check_attention_backend(backend: str, device: torch.device | str, dtype: torch.dtype,
                            head_dim: int = 64) -> None:
    """Raise a one-line ValueError if SDPA cannot run `backend` on `device` in `dtype`.

    Runs one tiny causal attention (forward and backward) under that backend, so the answer is
    the kernel's own, not a guess from the hardware's name.
    """
    if backend == "auto":
        return
    if backend not in get_args(AttentionBackend):
        raise ValueError(f"attention_backend={backend!r} is not one of "
                         f"{', '.join(get_args(AttentionBackend))}")
    q = torch.randn(1, 2, 16, head_dim, device=device, dtype=dtype, requires_grad=True)
    try:
        with _sdpa_context(backend), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the reasons SDPA prints before giving up
            F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    except RuntimeError:
        hint = ("; 'efficient' and 'cudnn' need a CUDA GPU, 'flash' on CUDA needs fp16/bf16"
                if torch.device(device).type != "cuda" or dtype == torch.float32 else "")
        raise ValueError(f"attention_backend={backend!r} is not available on "
                         f"{torch.device(device)} with {str(dtype).removeprefix('torch.')} "
                         f"(head_dim={head_dim}); use 'auto' or 'math'{hint}") from None


def count_params(module: nn.Module) -> int:
    """Number of unique parameter elements; a tied weight is counted once (`parameters()`
    de-duplicates by identity, which also holds on the meta device, where every data_ptr is 0).
    """
    return sum(p.numel() for p in module.parameters())


def _norm(cfg: GPTConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)


def document_causal_mask(positions: torch.Tensor) -> torch.Tensor:
    """A boolean [B, 1, T, T] attention mask, causal and block-diagonal by document, from
    each token's position in its document ([B, T], 0 where a document begins)."""
    doc = (positions == 0).cumsum(-1)
    T = positions.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=positions.device).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE (Su et al. 2021) to x [B, H, T, hd] with cos/sin [T, hd/2].

    Uses the "rotate half" channel pairing (channel i with i + hd/2) of the Hugging Face
    Llama port, so HF checkpoints load without permuting wq/wk. The rotation runs in
    float32, as in Meta's Llama reference, so bf16 activations keep position precision.
    """
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.type_as(x)


class KVCache:
    """Keys and values of the positions decoded so far, per layer, for `GPT.forward_cached`.

    ``k[name]`` / ``v[name]``: [B, n_kv_head, max_len, head_dim], preallocated; keys are
    stored after RoPE and before grouped-query heads are repeated. ``length`` positions are
    filled; the next tokens sit at positions ``length, length + 1, ...``. Make one with
    `GPT.new_cache`.
    """

    def __init__(self, layers: list[str], batch_size: int, kv_heads: int, head_dim: int,
                 max_len: int, *, device: torch.device | str, dtype: torch.dtype) -> None:
        shape = (batch_size, kv_heads, max_len, head_dim)
        self.k = {n: torch.zeros(shape, device=device, dtype=dtype) for n in layers}
        self.v = {n: torch.zeros(shape, device=device, dtype=dtype) for n in layers}
        self.batch_size, self.max_len, self.length = batch_size, max_len, 0

    def reset(self) -> None:
        """Forget every position (the buffers are kept and overwritten)."""
        self.length = 0


class Attention(nn.Module):
    """Causal self-attention with optional grouped-query attention (Ainslie et al. 2023).

    In/out: [B, T, d_model]. wq/wo are d->d, wk/wv are d->n_kv_head*head_dim.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d, kv = cfg.d_model, cfg.kv_heads * cfg.head_dim
        self.head_dim = cfg.head_dim
        self.dropout = cfg.dropout
        self.backend = cfg.attention_backend
        self.wq = nn.Linear(d, d, bias=cfg.bias)
        self.wk = nn.Linear(d, kv, bias=cfg.bias)
        self.wv = nn.Linear(d, kv, bias=cfg.bias)
        self.wo = nn.Linear(d, d, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)
        self.sequence_shard = None
        """Under context parallel (`meshfit.parallel.cp.apply_cp`): attention is
        ``sequence_shard.attend(q, k, v)``, a ring over the ranks holding the sequence."""

    def _qkv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None):
        """q, k, v as [B, heads, T, head_dim], RoPE applied to q and k. -1 heads: under
        tensor parallelism each rank holds only its shard of the heads."""
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = _rotate(q, *rope), _rotate(k, *rope)
        return q, k, v

    @staticmethod
    def _repeat_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """k and v with each kv head repeated for its query heads: GQA by hand rather than
        sdpa(enable_gqa=True), which older torch lacks. repeat_interleave keeps query heads
        h*g..h*g+g-1 on kv head h, the Llama layout."""
        if k.shape[1] == q.shape[1]:
            return k, v
        groups = q.shape[1] // k.shape[1]
        return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """`mask`: a boolean [B, 1, T, T] attention mask (`document_causal_mask`) in place of
        the plain causal one."""
        B, T, _ = x.shape
        q, k, v = self._qkv(x, rope)
        if self.sequence_shard is not None:  # causal, exact: no mask, no dropout
            y = self.sequence_shard.attend(q, k, v).transpose(1, 2).reshape(B, T, -1)
            return self.resid_drop(self.wo(y))
        k, v = self._repeat_kv(q, k, v)
        try:
            with _sdpa_context(self.backend):
                y = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
                    is_causal=mask is None)
        except RuntimeError as err:
            if self.backend == "auto":
                raise
            raise RuntimeError(
                f"attention_backend={self.backend!r} cannot run on {q.device} with {q.dtype} "
                f"(head_dim={q.shape[-1]}); use 'auto' or 'math' (GPTConfig.attention_backend)"
            ) from err
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.resid_drop(self.wo(y))

    def forward_cached(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                       cache: KVCache, name: str) -> torch.Tensor:
        """`forward` for T new positions after the cache's `length`: appends their keys and
        values to layer `name` of `cache` and attends over all cached ones. `rope` holds the
        rows of the new positions. Does not advance `cache.length` (the model does)."""
        B, T, _ = x.shape
        q, k, v = self._qkv(x, rope)
        start, end = cache.length, cache.length + T
        cache.k[name][:B, :, start:end] = k
        cache.v[name][:B, :, start:end] = v
        k, v = self._repeat_kv(q, cache.k[name][:B, :, :end], cache.v[name][:B, :, :end])
        # New query i sits at position start + i and sees keys 0..start + i. One query sees
        # every cached key, so it needs no mask.
        mask = (None if T == 1
                else torch.ones(T, end, dtype=torch.bool, device=x.device).tril(start))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.resid_drop(self.wo(y))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)).

    `moe=True` puts a mixture of experts (`MoE`) where the dense MLP would be; `GPT` sets it
    for the blocks `GPTConfig.is_moe_layer` names.
    """

    def __init__(self, cfg: GPTConfig, moe: bool = False) -> None:
        super().__init__()
        self.attn_norm = _norm(cfg)
        self.attn = Attention(cfg)
        self.mlp_norm = _norm(cfg)
        if moe:
            self.mlp: nn.Module = MoE(cfg)
        else:
            self.mlp = GeluMLP(cfg) if cfg.mlp == "gelu" else SwiGLUMLP(cfg)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        # (mask only when given: tensor-parallel plans lay out attention's inputs (x, rope))
        h = self.attn_norm(x)
        x = x + (self.attn(h, rope) if mask is None else self.attn(h, rope, mask))
        return x + self.mlp(self.mlp_norm(x))

    def forward_cached(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                       cache: KVCache, name: str) -> torch.Tensor:
        x = x + self.attn.forward_cached(self.attn_norm(x), rope, cache, name)
        return x + self.mlp(self.mlp_norm(x))


# Output projections that write into the residual stream; their init is scaled down.
_RESIDUAL_OUT = ("wo", "w_out", "w2")


class GPT(nn.Module):
    """Decoder-only language model.

    forward(idx [B, T] long) -> logits [B, T, vocab] float; with targets [B, T] -> mean
    cross-entropy (scalar, ignore_index -100). As a pipeline stage: without tok_emb the input
    is hidden states [B, T, d_model]; without lm_head the output is hidden states.

    With MoE blocks (`GPTConfig.n_experts > 0`) the loss returned with targets adds the
    blocks' auxiliary losses (`aux_loss`; see `meshfit.models.moe`).

    With targets, the loss skips the whole [B, T, vocab] float32 logits when they would be
    large (`fused_loss` "auto": at least `FUSED_LOSS_MIN_BYTES`; "on": always; "off":
    never): `meshfit.models.loss.linear_cross_entropy` forms them `loss_chunk_tokens`
    tokens at a time. Same loss and gradients up to rounding; used only where the head is a
    plain bias-free ``nn.Linear`` with a local weight (not tensor parallel's DTensor, not a
    LoRA-wrapped head, no hooks on it).
    """

    fused_loss: str = "auto"
    loss_chunk_tokens: int = 1024
    FUSED_LOSS_MIN_BYTES = 64 * 2**20

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb: nn.Embedding | None = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb: nn.Embedding | None = (
            nn.Embedding(config.max_seq_len, config.d_model) if config.pos == "learned" else None)
        self.drop = nn.Dropout(config.dropout)
        self.layers = nn.ModuleDict(
            {str(i): Block(config, moe=config.is_moe_layer(i)) for i in range(config.n_layer)})
        self.norm: nn.Module | None = _norm(config)
        # GPT-2 has no output bias; neither has Llama.
        self.lm_head: nn.Linear | None = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            # Press & Wolf 2017: sharing input and output embeddings, as GPT-2 does.
            self.lm_head.weight = self.tok_emb.weight
        # Non-persistent: RoPE has no parameters, and the cache is recomputed by init_weights
        # (it is garbage after meta-device construction + to_empty, like any buffer).
        if config.pos == "rope":
            for name in ("rope_cos", "rope_sin"):
                self.register_buffer(name, torch.empty(config.max_seq_len, config.head_dim // 2),
                                     persistent=False)
        else:
            self.rope_cos = self.rope_sin = None
        self.sequence_shard = None
        """Under context parallel (`meshfit.parallel.cp.apply_cp`): the model takes this
        rank's part of each sequence and places it at ``sequence_shard.positions``."""
        if self.tok_emb.weight.device.type != "meta":
            self.init_weights()

    # ------------------------------------------------------------------ init
    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Deterministic init; also (re)computes the RoPE cache. Draws one base seed from
        `generator` (the global CPU RNG when None), then fills each parameter from its own
        generator seeded by (base seed, parameter name). The values of a parameter therefore
        depend only on the seed and its name, not on which other parts the module holds: a
        pipeline stage initialised with the same seed gets exactly the full model's weights
        for its slice. Meta tensors are skipped.

        Linears/embeddings ~ N(0, init_std); biases 0; norm weights 1. Residual output
        projections (wo, w_out, w2) use init_std / sqrt(2 * n_layer): GPT-2 (Radford et al.
        2019, sec. 2.3) scales residual-layer weights by 1/sqrt(N), N = number of residual
        layers, two per block; nanoGPT does the same. MoE blocks follow the same rules: the
        router and the stacked expert weights are normal(init_std), the experts' down
        projections (w2 / w_out) and the shared expert's use the residual scaling.
        """
        device = "cpu" if generator is None else generator.device
        base = int(torch.randint(0, 2**62, (1,), generator=generator, device=device).item())
        self._init_rope()
        cfg, seen = self.config, set()
        for mod_name, module in self.named_modules():
            for p_name, p in module.named_parameters(recurse=False):
                if id(p) in seen or p.is_meta:
                    continue
                seen.add(id(p))
                name = f"{mod_name}.{p_name}" if mod_name else p_name
                if name == "lm_head.weight" and cfg.tie_embeddings:
                    name = "tok_emb.weight"  # a stage holding only the tied head: same values
                if p_name == "bias":
                    p.zero_()
                elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                    p.fill_(1.0)
                else:
                    std = cfg.init_std
                    if mod_name.rsplit(".", 1)[-1] in _RESIDUAL_OUT or (
                            isinstance(module, Experts) and p_name in _RESIDUAL_OUT):
                        std /= math.sqrt(2 * cfg.n_layer)
                    p.normal_(0.0, std, generator=_param_generator(base, name, p.device))

    def _init_rope(self) -> None:
        if self.rope_cos is None or self.rope_cos.is_meta:
            return
        cfg, device = self.config, self.rope_cos.device
        inv_freq = cfg.rope_theta ** (
            -torch.arange(0, cfg.head_dim, 2, device=device, dtype=torch.float32) / cfg.head_dim)
        positions = torch.arange(cfg.max_seq_len, device=device, dtype=torch.float32)
        angles = torch.outer(positions, inv_freq)
        self.rope_cos.copy_(angles.cos())
        self.rope_sin.copy_(angles.sin())

    # ------------------------------------------------------------------ forward
    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """`positions` [B, T]: each token's position in its own document (restarting at 0
        where one begins: packed examples, documents kept apart); attention then stays
        inside each document (`document_causal_mask`). Not as a pipeline stage."""
        T = idx.shape[1]
        shard = self.sequence_shard
        if shard is not None:  # this rank's part of each sequence, at its global positions
            if positions is not None:
                raise ValueError("positions= (documents kept apart) with context parallel is "
                                 "not available yet: the ring attends causally over the whole "
                                 "sequence")
            if T * shard.size > self.config.max_seq_len:
                raise ValueError(
                    f"sequence length {T * shard.size} ({T} tokens on each of {shard.size} "
                    f"context-parallel ranks) exceeds GPTConfig.max_seq_len="
                    f"{self.config.max_seq_len}; shorten the input or raise max_seq_len")
            placed = shard.positions(T, idx.device)
        elif T > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {T} exceeds GPTConfig.max_seq_len={self.config.max_seq_len}; "
                "shorten the input or raise max_seq_len")
        if self.tok_emb is not None:
            h = self.tok_emb(idx)
            # Positions go in with the tokens only: a later stage's input already has them.
            if self.pos_emb is not None:
                h = h + self.pos_emb(placed if shard is not None else
                                     torch.arange(T, device=idx.device) if positions is None
                                     else positions)
            h = self.drop(h)
        else:
            h = idx
        # Positions come from the sequence, not from the layer index, so a stage starting
        # at layer k rotates exactly as the full model does.
        rope = None if self.rope_cos is None else (self.rope_cos[:T], self.rope_sin[:T])
        if shard is not None and self.rope_cos is not None:
            rope = (self.rope_cos[placed], self.rope_sin[placed])
        mask = None
        if positions is not None:
            mask = document_causal_mask(positions)
            if self.rope_cos is not None:  # [B, 1, T, hd/2]: each row its own positions
                rope = (self.rope_cos[positions][:, None], self.rope_sin[positions][:, None])
        for layer in self.layers.values():
            h = layer(h, rope) if mask is None else layer(h, rope, mask)
        if self.norm is not None:
            h = self.norm(h)
        if self.lm_head is None:
            return h
        if targets is not None and self._chunked_loss(h):
            loss = torch.compiler.disable(linear_cross_entropy)(
                h, self.lm_head.weight, targets, chunk_tokens=self.loss_chunk_tokens)
        else:
            logits = self.lm_head(h)
            if targets is None:
                return logits
            loss = plain_cross_entropy(logits, targets)
        aux = self.aux_loss()
        return loss if aux is None else loss + aux

    def _chunked_loss(self, h: torch.Tensor) -> bool:
        """Whether the loss goes through `linear_cross_entropy` (see the class docstring)."""
        if self.fused_loss not in ("auto", "on", "off"):
            raise ValueError(f"GPT.fused_loss={self.fused_loss!r} must be 'auto', 'on' or 'off'")
        if self.fused_loss == "off":
            return False
        head = self.lm_head
        if type(head) is not nn.Linear or head.bias is not None or has_forward_hooks(head) \
                or type(head.weight) not in (torch.Tensor,
                                                                        nn.Parameter):
            return False
        if self.fused_loss == "on":
            return True
        logits_bytes = h.numel() // h.shape[-1] * head.out_features * 4
        return logits_bytes >= self.FUSED_LOSS_MIN_BYTES

    # ------------------------------------------------------------------ mixture of experts
    def moe_layers(self) -> dict[str, MoE]:
        """The MoE modules of this model (or stage), by block name."""
        return {n: b.mlp for n, b in self.layers.items() if isinstance(b.mlp, MoE)}

    def aux_loss(self) -> torch.Tensor | None:
        """Sum of the MoE blocks' auxiliary losses from the last forward; None if dense."""
        losses = [m.last_aux_loss for m in self.moe_layers().values()
                  if m.last_aux_loss is not None]
        if not losses:
            return None
        dtype = torch.promote_types(losses[0].dtype, torch.float32)  # fp32 at least; fp64 kept
        return torch.stack([a.to(dtype) for a in losses]).sum()

    @torch.no_grad()
    def moe_stats(self) -> dict[str, float | int]:
        """Routing statistics of the last forward, aggregated over MoE blocks ({} if dense).

        tokens_per_expert_min / _max: fewest / most assignments any expert got in any block;
        tokens_per_expert_cv: coefficient of variation (std / mean) of the assignments per
        expert, averaged over blocks (0 = perfectly balanced); dropped_fraction: dropped /
        total assignments (0 when dropless); aux_loss: the summed auxiliary loss; layers:
        number of MoE blocks. Reading it synchronises with the device.
        """
        stats = [m.last_stats for m in self.moe_layers().values() if m.last_stats is not None]
        if not stats:
            return {}
        counts = torch.stack([s["tokens_per_expert"].double() for s in stats])
        cv = counts.std(dim=1, unbiased=False) / counts.mean(dim=1).clamp_min(1e-12)
        assignments = max(1, sum(s["assignments"] for s in stats))
        return {"layers": len(stats), "tokens_per_expert_min": int(counts.min()),
                "tokens_per_expert_max": int(counts.max()),
                "tokens_per_expert_cv": float(cv.mean()),
                "dropped_fraction": sum(s["dropped"] for s in stats) / assignments,
                "aux_loss": float(sum(float(s["aux_loss"]) for s in stats))}

    # ------------------------------------------------------------------ incremental decoding
    def new_cache(self, batch_size: int = 1, max_len: int | None = None, *,
                  device: torch.device | str | None = None,
                  dtype: torch.dtype | None = None) -> KVCache:
        """An empty `KVCache` for `forward_cached`: up to `max_len` positions (default and at
        most `max_seq_len`), on the model's device and in its dtype unless given."""
        if (self.tok_emb is None or self.lm_head is None
                or len(self.layers) != self.config.n_layer):
            raise ValueError("incremental decoding needs the whole model (tok_emb, every "
                             "layer, lm_head), not a pipeline stage")
        max_len = self.config.max_seq_len if max_len is None else max_len
        if not 1 <= max_len <= self.config.max_seq_len:
            raise ValueError(f"KVCache max_len={max_len} must be in 1..GPTConfig.max_seq_len="
                             f"{self.config.max_seq_len}")
        weight = self.tok_emb.weight
        wk = next(iter(self.layers.values())).attn.wk
        head_dim = self.config.head_dim
        return KVCache(list(self.layers), batch_size, wk.out_features // head_dim, head_dim,
                       max_len, device=device or weight.device, dtype=dtype or weight.dtype)

    def forward_cached(self, idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits [B, T, vocab] of tokens idx [B, T] placed after the `cache.length`
        positions already in `cache`, whose keys and values it appends (advancing
        `cache.length` by T). With an empty cache this equals ``forward(idx)``; feeding a
        sequence in pieces gives the logits of one forward over it. Call in eval mode
        (dropout would make the pieces differ) and under ``torch.no_grad()``."""
        B, T = idx.shape
        start = cache.length
        if start + T > cache.max_len:
            raise ValueError(f"{T} new token(s) after {start} cached exceed the cache's "
                             f"max_len={cache.max_len} (max_seq_len={self.config.max_seq_len}); "
                             "start a new cache from the last tokens")
        if B > cache.batch_size:
            raise ValueError(f"batch of {B} exceeds the cache's batch_size={cache.batch_size}")
        h = self.tok_emb(idx)
        if self.pos_emb is not None:
            h = h + self.pos_emb(torch.arange(start, start + T, device=idx.device))
        h = self.drop(h)
        rope = (None if self.rope_cos is None
                else (self.rope_cos[start:start + T], self.rope_sin[start:start + T]))
        for name, layer in self.layers.items():
            h = layer.forward_cached(h, rope, cache, name)
        cache.length = start + T
        if self.norm is not None:
            h = self.norm(h)
        return self.lm_head(h)

    # ------------------------------------------------------------------ accounting
    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Unique parameters held by this module (a stage counts only its slice); for a full
        model, equal to `GPTConfig.num_params(exclude_embeddings)`."""
        n = count_params(self)
        if exclude_embeddings:
            for emb in (self.tok_emb, self.pos_emb):
                if emb is not None:
                    n -= emb.weight.numel()
        return n


def _param_generator(base: int, name: str, device: torch.device) -> torch.Generator:
    # sha256, not hash(): Python's str hash is salted per process and would break
    # cross-process determinism.
    digest = hashlib.sha256(f"{base}/{name}".encode()).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)
