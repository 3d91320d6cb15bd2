"""`GPTConfig`: the shape of the reference decoder-only transformer, plus named presets.

The config is pure data: it can count parameters and FLOPs in closed form without building a
model, so estimators (memory, MFU) can run for a 70B model on a laptop. The closed forms here
are cross-checked against the built model in tests/models/test_models.py.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal, get_args

NormKind = Literal["layernorm", "rmsnorm"]
MlpKind = Literal["gelu", "swiglu"]
PosKind = Literal["learned", "rope"]
AttentionBackend = Literal["auto", "math", "flash", "efficient", "cudnn"]
RouterKind = Literal["softmax_topk", "sigmoid_topk"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape and initialisation of a decoder-only transformer (see `meshfit.models.GPT`)."""

    vocab_size: int = 256
    """Number of token ids; 256 = raw bytes, so the tiny model needs no tokenizer."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Number of query heads; must divide `d_model` (head_dim = d_model // n_head)."""
    n_kv_head: int | None = None
    """Number of key/value heads; None means `n_head` (plain multi-head attention). Smaller
    values give grouped-query attention (Ainslie et al. 2023); must divide `n_head`."""
    d_model: int = 128
    """Width of the residual stream."""
    d_ff: int = 512
    """Hidden width of the MLP (for SwiGLU: width of each of the gate and up projections)."""
    max_seq_len: int = 256
    """Longest sequence the model accepts (size of the learned position table / RoPE cache)."""
    norm: NormKind = "layernorm"
    """Normalisation layer: "layernorm" (GPT-2) or "rmsnorm" (Llama; weight only)."""
    mlp: MlpKind = "gelu"
    """MLP flavour: "gelu" (GPT-2, w_in/w_out) or "swiglu" (Llama, w1 gate / w3 up / w2 down)."""
    pos: PosKind = "learned"
    """Position encoding: "learned" absolute table (GPT-2) or "rope" (rotary, no parameters)."""
    bias: bool = True
    """Whether linear layers and LayerNorm carry biases (GPT-2 yes, Llama no)."""
    tie_embeddings: bool = True
    """Whether `lm_head.weight` is the same tensor as `tok_emb.weight` (GPT-2 yes, Llama no)."""
    dropout: float = 0.0
    """Dropout probability on embeddings, attention probabilities and residual branches."""
    norm_eps: float = 1e-5
    """Epsilon of every norm layer (1e-5 for both GPT-2 and Llama-2)."""
    rope_theta: float = 10000.0
    """RoPE base frequency (Su et al. 2021; 10000 in Llama-2). Ignored for learned positions."""
    init_std: float = 0.02
    """Std of the normal init of linears and embeddings (GPT-2 / nanoGPT use 0.02)."""
    attention_backend: AttentionBackend = "auto"
    """Kernel behind F.scaled_dot_product_attention: "auto" (PyTorch picks the fastest that
    fits), "math" (the reference formula), "flash" (FlashAttention-2; CUDA fp16/bf16, and
    PyTorch's CPU flash kernel), "efficient" (memory-efficient, xFormers' kernel; CUDA) or
    "cudnn" (cuDNN attention; recent NVIDIA GPUs). Not a shape: parameter counts ignore it."""

    # ---- mixture of experts (see `meshfit.models.moe.MoE`); n_experts=0 keeps the dense model
    n_experts: int = 0
    """Number of routed experts in each MoE block; 0 = dense model (every other MoE field is
    then ignored, and the model is exactly the dense one)."""
    top_k: int = 2
    """Experts each token is routed to (token choice); must be <= n_experts."""
    moe_every: int = 1
    """Block i is an MoE block when (i + 1) % moe_every == 0: 1 = every block (Mixtral),
    2 = blocks 1, 3, 5, ... (GShard / Switch alternate dense and MoE blocks)."""
    moe_d_ff: int | None = None
    """Hidden width of each expert (and of the shared expert); None means `d_ff`."""
    shared_experts: int = 0
    """0 or 1: a dense expert (an ordinary MLP of width moe_d_ff) every token passes through,
    added to the routed experts' output (DeepSeekMoE)."""
    router: RouterKind = "softmax_topk"
    """"softmax_topk": softmax over all experts, keep the top k, renormalise their weights to
    sum to 1 (Mixtral). "sigmoid_topk": independent sigmoid scores, keep the top k, normalise
    them to sum to 1 (DeepSeek-V3)."""
    capacity_factor: float | None = None
    """None = dropless. Otherwise each expert takes at most ceil(cf * tokens * top_k /
    n_experts) assignments per forward; the earliest tokens win, the rest are dropped (the
    token keeps only its residual and any other expert's output)."""
    aux_loss_coef: float = 0.01
    """Weight of the Switch/GShard load-balancing loss E * sum_e f_e * P_e."""
    router_z_loss_coef: float = 0.001
    """Weight of the ST-MoE router z-loss mean(logsumexp(logits)^2)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layer", "n_head", "d_model", "d_ff", "max_seq_len"):
            _check_positive_int(name, getattr(self, name))
        if self.n_kv_head is not None:
            _check_positive_int("n_kv_head", self.n_kv_head)
        for name, kind in (("norm", NormKind), ("mlp", MlpKind), ("pos", PosKind),
                           ("attention_backend", AttentionBackend), ("router", RouterKind)):
            value, allowed = getattr(self, name), get_args(kind)
            if value not in allowed:
                raise ValueError(f"GPTConfig.{name}={value!r} is not supported; use one of "
                                 f"{allowed}")
        for name in ("bias", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GPTConfig.{name}={getattr(self, name)!r} must be True or False")
        if self.d_model % self.n_head:
            raise ValueError(f"GPTConfig.n_head={self.n_head} must divide d_model={self.d_model}; "
                             "pick n_head among divisors of d_model")
        if self.n_head % self.kv_heads:
            raise ValueError(f"GPTConfig.n_kv_head={self.n_kv_head} must divide n_head="
                             f"{self.n_head}; pick n_kv_head among divisors of n_head (or None "
                             "for n_head)")
        if self.pos == "rope" and self.head_dim % 2:  # RoPE rotates pairs of channels
            raise ValueError(f"GPTConfig.pos='rope' needs an even head_dim, got d_model/n_head="
                             f"{self.d_model}/{self.n_head}={self.head_dim}; change n_head or "
                             "d_model")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout={self.dropout} must be in [0, 1); use 0.0 to "
                             "disable")
        for name in ("norm_eps", "rope_theta", "init_std"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"GPTConfig.{name}={value!r} must be a positive finite number")
        self._check_moe()

    def _check_moe(self) -> None:
        n_experts = self.n_experts
        if isinstance(n_experts, bool) or not isinstance(n_experts, int) or n_experts < 0:
            raise ValueError(f"GPTConfig.n_experts={self.n_experts!r} must be a non-negative "
                             "integer (0 = dense)")
        for name in ("top_k", "moe_every"):
            _check_positive_int(name, getattr(self, name))
        if self.moe_d_ff is not None:
            _check_positive_int("moe_d_ff", self.moe_d_ff)
        if self.shared_experts not in (0, 1) or isinstance(self.shared_experts, bool):
            raise ValueError(f"GPTConfig.shared_experts={self.shared_experts!r} must be 0 or 1")
        cf = self.capacity_factor
        if cf is not None and not (isinstance(cf, (int, float)) and not isinstance(cf, bool)
                                   and math.isfinite(cf) and cf > 0):
            raise ValueError(f"GPTConfig.capacity_factor={cf!r} must be a positive finite "
                             "number, or None for dropless routing")
        for name in ("aux_loss_coef", "router_z_loss_coef"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"GPTConfig.{name}={value!r} must be a finite number >= 0")
        if self.n_experts:
            if self.top_k > self.n_experts:
                raise ValueError(f"GPTConfig.top_k={self.top_k} must be <= n_experts="
                                 f"{self.n_experts}")
            if self.moe_every > self.n_layer:
                raise ValueError(f"GPTConfig.moe_every={self.moe_every} exceeds n_layer="
                                 f"{self.n_layer}, so no block would be MoE; use <= n_layer")

    # ----------------------------------------------------------------- derived sizes
    @property
    def kv_heads(self) -> int:
        """`n_kv_head` with None resolved to `n_head`."""
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def expert_d_ff(self) -> int:
        """Hidden width of each expert: `moe_d_ff` with None resolved to `d_ff`."""
        return self.d_ff if self.moe_d_ff is None else self.moe_d_ff

    def is_moe_layer(self, i: int) -> bool:
        """Whether block `i` (0-based) holds an MoE instead of a dense MLP."""
        return self.n_experts > 0 and (i + 1) % self.moe_every == 0

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layer))

    # ----------------------------------------------------------------- presets
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> GPTConfig:
        """A named shape (see `preset_names()`), optionally with some fields replaced."""
        if name not in _PRESETS:
            raise ValueError(f"unknown GPTConfig preset {name!r}; valid names: {list(_PRESETS)}")
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"GPTConfig.preset({name!r}) got unknown fields {unknown}; "
                             f"valid fields: {[f.name for f in dataclasses.fields(cls)]}")
        return cls(**{**_PRESETS[name], **overrides})

    @classmethod
    def preset_names(cls) -> tuple[str, ...]:
        return tuple(_PRESETS)

    # ----------------------------------------------------------------- closed forms
    def param_breakdown(self) -> dict[str, int]:
        """Unique parameter count per top-level part of `GPT`, without building it (a tied
        head counts 0 under "lm_head": its weight is counted under "tok_emb")."""
        d, f, b = self.d_model, self.d_ff, int(self.bias)
        norm = d * (2 if self.norm == "layernorm" and self.bias else 1)
        kv = self.kv_heads * self.head_dim
        attn = 2 * d * d + 2 * d * kv + b * (2 * d + 2 * kv)  # wq, wo + wk, wv (+ biases)
        mlp = self._mlp_params(f)
        n_moe = self.n_moe_layers
        layers = self.n_layer * (2 * norm + attn) + (self.n_layer - n_moe) * mlp
        if n_moe:
            layers += n_moe * self._moe_params(self.n_experts)
        return {
            "tok_emb": self.vocab_size * d,
            "pos_emb": self.max_seq_len * d if self.pos == "learned" else 0,
            "layers": layers,
            "norm": norm,
            "lm_head": 0 if self.tie_embeddings else self.vocab_size * d,
        }

    def _mlp_params(self, f: int) -> int:
        """A dense MLP (GeluMLP / SwiGLUMLP) of hidden width f, with biases if `bias`."""
        d, b = self.d_model, int(self.bias)
        return 2 * d * f + b * (f + d) if self.mlp == "gelu" else 3 * d * f + b * (2 * f + d)

    def _moe_params(self, experts: int) -> int:
        """One MoE block counting `experts` routed experts: router (d x E, no bias) +
        bias-free stacked expert weights + the optional shared expert (a dense MLP)."""
        d, f = self.d_model, self.expert_d_ff
        per_expert = (2 if self.mlp == "gelu" else 3) * d * f
        return d * self.n_experts + experts * per_expert + self.shared_experts * self._mlp_params(f)

    def num_active_params(self, exclude_embeddings: bool = False) -> int:
        """Parameters used per token: `num_params` with each MoE block counting only its
        top_k routed experts (router, shared expert and everything else in full). Equals
        `num_params` for a dense model."""
        n = self.num_params(exclude_embeddings)
        if self.n_experts:
            inactive = self._moe_params(self.n_experts) - self._moe_params(self.top_k)
            n -= self.n_moe_layers * inactive
        return n

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Closed-form count of unique parameters; equals `GPT(self).num_params(...)`.
        `exclude_embeddings` drops the lookup tables tok_emb and pos_emb (a tied head goes
        with them, being the same tensor); an untied lm_head stays counted."""
        parts = self.param_breakdown()
        if exclude_embeddings:
            parts["tok_emb"] = parts["pos_emb"] = 0
        return sum(parts.values())

    def flops_per_token(self, seq_len: int) -> int:
        """Training (forward + backward) matmul FLOPs per token at sequence length `seq_len`.

        PaLM (Chowdhery et al. 2022, appendix B): 6N + 12·L·H·Q·T, where 6N covers the
        weight matmuls (2N forward, 4N backward) and 12·L·H·Q·T the attention scores and
        weighted sum (H·Q = d_model; GQA does not shrink it, queries keep n_head heads).
        N counts parameters that take part in a matmul: the layers, the final norm and the
        output head (V·d, tied or not), but not embedding lookups, which cost no FLOPs.
        Like PaLM we count the full T×T score matrix, ignoring the causal mask's half.
        For a mixture of experts N counts active parameters (`num_active_params`): the
        top_k experts a token visits, not all of them; routing itself (sort, gather) is
        not a matmul and is not counted.
        """
        _check_positive_int("seq_len", seq_len, owner="flops_per_token")
        parts = self.param_breakdown()
        inactive = self.num_params() - self.num_active_params()
        n_matmul = parts["layers"] - inactive + parts["norm"] + self.vocab_size * self.d_model
        return 6 * n_matmul + 12 * self.n_layer * self.d_model * seq_len


def _check_positive_int(name: str, value: object, owner: str = "GPTConfig") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{owner}.{name}={value!r} must be a positive integer")


_GPT2_STYLE = dict(norm="layernorm", mlp="gelu", pos="learned", bias=True, tie_embeddings=True)
_LLAMA_STYLE = dict(norm="rmsnorm", mlp="swiglu", pos="rope", bias=False, tie_embeddings=False)

# Shapes copied from the published configs so the parameter counts match them exactly
# (tests pin the counts): GPT-2 small (Radford et al. 2019) = 124,439,808; TinyLlama-1.1B
# (Zhang et al. 2024) = 1,100,048,384; Llama-2-7B / 70B (Touvron et al. 2023) =
# 6,738,415,616 / 68,976,648,192. Mixtral-8x7B (Jiang et al. 2024) = 46,702,792,704 in
# all, 12,879,925,248 active per token (2 of 8 experts).
_PRESETS: dict[str, dict[str, Any]] = {
    # ~0.86M params, byte vocabulary: trains in seconds on a CPU, used by tests and examples.
    "tiny": dict(_GPT2_STYLE, vocab_size=256, n_layer=4, n_head=4, d_model=128, d_ff=512,
                 max_seq_len=256),
    "gpt2": dict(_GPT2_STYLE, vocab_size=50257, n_layer=12, n_head=12, d_model=768, d_ff=3072,
                 max_seq_len=1024),
    "llama-1b": dict(_LLAMA_STYLE, vocab_size=32000, n_layer=22, n_head=32, n_kv_head=4,
                     d_model=2048, d_ff=5632, max_seq_len=2048),
    "llama-7b": dict(_LLAMA_STYLE, vocab_size=32000, n_layer=32, n_head=32, d_model=4096,
                     d_ff=11008, max_seq_len=4096),
    "llama-70b": dict(_LLAMA_STYLE, vocab_size=32000, n_layer=80, n_head=64, n_kv_head=8,
                      d_model=8192, d_ff=28672, max_seq_len=4096),
    # Mixture of experts at the tiny width: 8 SwiGLU experts, top-2, in every block.
    "moe-tiny": dict(_LLAMA_STYLE, vocab_size=256, n_layer=4, n_head=4, d_model=128, d_ff=256,
                     max_seq_len=256, n_experts=8, top_k=2),
    "mixtral-8x7b": dict(_LLAMA_STYLE, vocab_size=32000, n_layer=32, n_head=32, n_kv_head=8,
                         d_model=4096, d_ff=14336, max_seq_len=32768, rope_theta=1e6,
                         n_experts=8, top_k=2),
}
