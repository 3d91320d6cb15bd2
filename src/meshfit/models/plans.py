"""Tensor-parallel plans as data: module-name pattern -> PyTorch parallel style.

Megatron-LM layout (Shoeybi et al. 2019): attention q/k/v and MLP up/gate column-parallel,
attention output and MLP down row-parallel, so each block needs one all-reduce forward and
one backward per sub-layer; embedding and head vocabulary-parallel. With
`sequence_parallel=True` (Korthikanti et al. 2022) the all-reduces become reduce-scatter /
all-gather pairs and the norms and dropouts between them run on a sequence shard.

Plans exist for meshfit's reference `GPT` (GELU or SwiGLU, learned or rotary positions,
GQA, tied or untied head) and for Hugging Face `LlamaForCausalLM` and `GPT2LMHeadModel`.
`meshfit.parallel.tp.apply_tp` applies them; `plan_for(model)` picks one by type.

Choices worth knowing:
- Tied embeddings (GPT-2, `GPTConfig.tie_embeddings`): the embedding (RowwiseParallel) and
  the head (ColwiseParallel) both shard the one [V, d] weight as Shard(0), so they keep
  sharing one DTensor parameter (`apply_tp` re-ties it and refuses plans that would not).
- GPT-2's fused `c_attn` (q|k|v in one Conv1D) is re-laid out so that each rank holds q, k
  and v of its own heads (`Conv1DColwiseParallel(fused=3)`); the global view of that weight
  is then head-grouped, and `meshfit.parallel.tp.unfuse_columns` restores the HF layout.
- Position tables and norms outside sequence parallel are replicated DTensors; under
  sequence parallel the learned position table is replicated and sliced on the sequence dim
  (no T divisibility of max_seq_len needed); RoPE tables are plain buffers used on the full
  sequence inside attention (after the all-gather), so they need nothing.
- Hugging Face models under sequence parallel keep the residual stream as a DTensor
  (`use_local_output=False`): their forward reads the sequence length from the embedding
  output to build positions and masks, which must be the global length.
- Hugging Face ships its own string-based TP plans (`config.base_model_tp_plan`,
  `model._tp_plan`, applied by `from_pretrained(tp_plan="auto")`); they replace module
  forwards, gather the full logits ("colwise_gather_output") and have no sequence parallel
  for Llama, so meshfit uses PyTorch's styles with the same module split instead.
- Dropout modules appear in sequence-parallel plans only when their probability is > 0.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, \
    PrepareModuleInput, RowwiseParallel

from meshfit.models.gpt import GPT
from meshfit.parallel.tp import Conv1DColwiseParallel, Conv1DRowwiseParallel, ReplicateParallel, \
    SequenceParallelBroadcast as SP

__all__ = ["TPPlan", "plan_for", "gpt_plan", "hf_llama_plan", "hf_gpt2_plan"]


@dataclass(frozen=True, kw_only=True)
class TPPlan:
    """A tensor-parallel plan and the facts `apply_tp` checks before applying it."""

    styles: Mapping[str, ParallelStyle]
    """Module-name pattern ("layers.*.attn.wq", fnmatch per dotted atom) -> style, applied in
    order by `parallelize_module`."""
    divisible: tuple[tuple[str, int, str], ...] = ()
    """(field, size, kind) that must divide by the TP degree; kind is "heads", "width" or
    "vocab" and picks the advice in the error."""
    local_attrs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Module pattern -> attributes holding a global head count or width that the module's
    forward uses; `apply_tp` divides them by the TP degree (absent attributes are skipped)."""
    input_kwarg: str = "input_ids"
    """Keyword of the token ids (else the first positional argument): checked under sequence
    parallel for a length that divides by the TP degree."""
    targets_arg: tuple[int, str] | None = None
    """(position, keyword) of the argument from which the model computes its own mean
    cross-entropy on its logits as returned (GPT's `targets`); under loss_parallel,
    `apply_tp` computes that loss with `tp_cross_entropy` instead."""
    labels_kwarg: str | None = None
    """Keyword of a loss argument that cannot work on vocabulary-sharded logits (HF's
    `labels`, shifted inside the model); refused with advice under loss_parallel."""

    def check_divisible(self, tp: int) -> None:
        """One-line ValueError listing every size that does not divide by `tp`, with a fix."""
        problems = [_advice(name, size, kind, tp) for name, size, kind in self.divisible
                    if size % tp]
        if problems:
            raise ValueError(f"tensor parallel tp={tp} does not fit the model: "
                             + "; ".join(problems))


def _advice(name: str, size: int, kind: str, tp: int) -> str:
    up = -(-size // tp) * tp
    if kind == "vocab":
        m = math.lcm(64, tp)  # 64: tensor-core friendly, as nanoGPT's 50304
        return (f"{name}={size} does not divide by tp={tp}; pad it to {up} "
                f"(or {-(-size // m) * m} for tensor cores)")
    if kind == "heads":
        divisors = [d for d in range(2, size + 1) if size % d == 0]
        return (f"{name}={size} does not divide by tp={tp} (each rank holds whole heads); use "
                f"tp in {divisors or [1]} or a model with {name.rsplit('.', 1)[-1]}={up}")
    return f"{name}={size} does not divide by tp={tp}; pad it to {up}"


def _head(loss_parallel: bool, **kw) -> ColwiseParallel:
    # Vocabulary-parallel output: logits sharded on V for loss_parallel, else gathered.
    return ColwiseParallel(output_layouts=Shard(-1) if loss_parallel else Replicate(),
                           use_local_output=not loss_parallel, **kw)


# ---------------------------------------------------------------------------- reference GPT
def gpt_plan(model: GPT, *, sequence_parallel: bool = False,
             loss_parallel: bool = False) -> TPPlan:
    """Plan for `meshfit.models.GPT` (any of its variants; a pipeline stage too: modules it
    lacks are left out). The residual stream is a local tensor, as in torchtitan: replicated
    [B, T, d], or [B, T/T_tp, d] under sequence parallel."""
    cfg, sp = model.config, sequence_parallel
    mlp = {"w_in": "col", "w_out": "row"} if cfg.mlp == "gelu" else \
        {"w1": "col", "w3": "col", "w2": "row"}
    drop = cfg.dropout > 0
    styles: dict[str, ParallelStyle] = {}
    if model.tok_emb is not None:
        styles["tok_emb"] = RowwiseParallel(input_layouts=Replicate(),
                                            output_layouts=Shard(1) if sp else Replicate())
    if model.pos_emb is not None:
        # forward adds pos_emb(arange(T)) [T, d] to the embedding: under SP each rank takes
        # its rows, which are the positions of its sequence shard.
        styles["pos_emb"] = ReplicateParallel(output_layouts=Shard(0) if sp else Replicate())
    if sp and drop:
        styles["drop"] = SP(use_local_output=True)
    blocks = (("attn", {"wq": "col", "wk": "col", "wv": "col", "wo": "row"}, "resid_drop"),
              ("mlp", mlp, "drop"))
    for part, linears, out_drop in blocks if len(model.layers) else ():
        norm = f"layers.*.{part}_norm"
        styles[norm] = SP() if sp else ReplicateParallel()
        if sp:
            # attn(x, rope): x sequence-sharded -> all-gathered; rope tables pass through.
            ins = (Shard(1), None) if part == "attn" else (Shard(1),)
            outs = (Replicate(), None) if part == "attn" else (Replicate(),)
            styles[f"layers.*.{part}"] = PrepareModuleInput(input_layouts=ins,
                                                            desired_input_layouts=outs)
        for name, kind in linears.items():
            styles[f"layers.*.{part}.{name}"] = ColwiseParallel() if kind == "col" else \
                RowwiseParallel(output_layouts=Shard(1) if sp else Replicate())
        if sp and drop:
            styles[f"layers.*.{part}.{out_drop}"] = SP(use_local_output=True)
    if model.norm is not None:
        styles["norm"] = SP() if sp else ReplicateParallel()
    if model.lm_head is not None:
        styles["lm_head"] = _head(loss_parallel, input_layouts=Shard(1) if sp else Replicate())
    divisible = [("GPTConfig.n_head", cfg.n_head, "heads")]
    if cfg.kv_heads != cfg.n_head:
        divisible.append(("GPTConfig.n_kv_head", cfg.kv_heads, "heads"))
    divisible += [("GPTConfig.d_model", cfg.d_model, "width"),
                  ("GPTConfig.d_ff", cfg.d_ff, "width"),
                  ("GPTConfig.vocab_size", cfg.vocab_size, "vocab")]
    return TPPlan(styles=styles, divisible=tuple(divisible), input_kwarg="idx",
                  targets_arg=(1, "targets"))


# ---------------------------------------------------------------------------- Hugging Face
def _hf_block(prefix: str, attn: str, mlp: str, norms: tuple[str, str], linears: dict,
              *, sp: bool, attn_kwarg: bool, drops: dict[str, float]) -> dict:
    """One decoder layer: norms, the two PrepareModuleInputs, the linears, the dropouts."""
    styles: dict[str, ParallelStyle] = {}
    for norm in norms:
        styles[f"{prefix}.{norm}"] = SP() if sp else ReplicateParallel()
    if sp:
        styles[f"{prefix}.{attn}"] = PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
        ) if attn_kwarg else PrepareModuleInput(input_layouts=(Shard(1),),
                                                desired_input_layouts=(Replicate(),))
        styles[f"{prefix}.{mlp}"] = PrepareModuleInput(input_layouts=(Shard(1),),
                                                       desired_input_layouts=(Replicate(),))
    for name, style in linears.items():
        if isinstance(style, RowwiseParallel) and sp:
            style = type(style)(output_layouts=Shard(1), use_local_output=False)
        styles[f"{prefix}.{name}"] = style
    for name, p in drops.items():
        if sp and p > 0:
            styles[f"{prefix}.{name}"] = SP()
    return styles


def _hf_sizes(config, heads: str, kv: str | None, width: str, width_value: int) -> tuple:
    cls = type(config).__name__
    out = [(f"{cls}.{heads}", getattr(config, heads), "heads")]
    if kv and getattr(config, kv, None) not in (None, getattr(config, heads)):
        out.append((f"{cls}.{kv}", getattr(config, kv), "heads"))
    out += [(f"{cls}.{width}", width_value, "width"),
            (f"{cls}.vocab_size", config.vocab_size, "vocab")]
    return tuple(out)


def hf_llama_plan(model: nn.Module, *, sequence_parallel: bool = False,
                  loss_parallel: bool = False) -> TPPlan:
    """Plan for Hugging Face `LlamaForCausalLM` (transformers 5.x module names). Its
    attention reads the local head count from the projection widths (`view(..., -1, hd)`)
    and the q/kv ratio is unchanged by the split; older versions' `num_heads` /
    `num_key_value_heads` attributes are divided when present."""
    sp = sequence_parallel
    styles: dict[str, ParallelStyle] = {"model.embed_tokens": RowwiseParallel(
        input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate(),
        use_local_output=not sp)}
    linears = {f"self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")}
    linears |= {"self_attn.o_proj": RowwiseParallel(), "mlp.gate_proj": ColwiseParallel(),
                "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    styles |= _hf_block("model.layers.*", "self_attn", "mlp",
                        ("input_layernorm", "post_attention_layernorm"), linears, sp=sp,
                        attn_kwarg=True, drops={})
    styles["model.norm"] = SP() if sp else ReplicateParallel()
    styles["lm_head"] = _head(loss_parallel, input_layouts=Shard(1) if sp else Replicate())
    cfg = model.config
    return TPPlan(
        styles=styles, labels_kwarg="labels",
        local_attrs={"model.layers.*.self_attn": ("num_heads", "num_key_value_heads")},
        divisible=_hf_sizes(cfg, "num_attention_heads", "num_key_value_heads",
                            "intermediate_size", cfg.intermediate_size))


def hf_gpt2_plan(model: nn.Module, *, sequence_parallel: bool = False,
                 loss_parallel: bool = False) -> TPPlan:
    """Plan for Hugging Face `GPT2LMHeadModel` (Conv1D layers, fused q|k|v, tied head).
    Cross-attention (`add_cross_attention=True`) is not covered."""
    cfg, sp = model.config, sequence_parallel
    if getattr(cfg, "add_cross_attention", False):
        raise ValueError("hf_gpt2_plan does not cover GPT2Config.add_cross_attention=True; "
                         "write a plan that also splits the crossattention modules")
    styles: dict[str, ParallelStyle] = {
        "transformer.wte": RowwiseParallel(input_layouts=Replicate(),
                                           output_layouts=Shard(1) if sp else Replicate(),
                                           use_local_output=not sp),
        "transformer.wpe": ReplicateParallel(output_layouts=Shard(1) if sp else Replicate(),
                                             use_local_output=not sp)}
    if sp and cfg.embd_pdrop > 0:
        styles["transformer.drop"] = SP()
    linears = {"attn.c_attn": Conv1DColwiseParallel(fused=3),
               "attn.c_proj": Conv1DRowwiseParallel(),
               "mlp.c_fc": Conv1DColwiseParallel(), "mlp.c_proj": Conv1DRowwiseParallel()}
    styles |= _hf_block("transformer.h.*", "attn", "mlp", ("ln_1", "ln_2"), linears, sp=sp,
                        attn_kwarg=False, drops={"attn.resid_dropout": cfg.resid_pdrop,
                                                 "mlp.dropout": cfg.resid_pdrop})
    styles["transformer.ln_f"] = SP() if sp else ReplicateParallel()
    styles["lm_head"] = _head(loss_parallel, input_layouts=Shard(1) if sp else Replicate())
    inner = cfg.n_inner if cfg.n_inner is not None else 4 * cfg.n_embd
    return TPPlan(
        styles=styles, labels_kwarg="labels",
        local_attrs={"transformer.h.*.attn": ("num_heads", "embed_dim", "split_size")},
        divisible=_hf_sizes(cfg, "n_head", None, "n_inner", inner))


def plan_for(model: nn.Module, *, sequence_parallel: bool = False,
             loss_parallel: bool = False) -> TPPlan:
    """The built-in plan for `model`'s type; ValueError naming the supported types."""
    kw = dict(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    if isinstance(model, GPT):
        return gpt_plan(model, **kw)
    # transformers is only looked at when the model came from it (no import cost otherwise).
    hf = sys.modules.get("transformers")
    if hf is not None:
        if isinstance(model, hf.LlamaForCausalLM):
            return hf_llama_plan(model, **kw)
        if isinstance(model, hf.GPT2LMHeadModel):
            return hf_gpt2_plan(model, **kw)
    raise ValueError(f"no built-in tensor-parallel plan for {type(model).__name__}; built-in: "
                     "meshfit GPT, transformers LlamaForCausalLM and GPT2LMHeadModel; pass "
                     "plan={module pattern: ParallelStyle} to apply_tp")
