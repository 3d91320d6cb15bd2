"""Plans for Hugging Face `GPT2LMHeadModel` (tensor and pipeline parallel) and the pipeline
plans of `LlamaForCausalLM` (Qwen2, Mistral) and the mixture-of-experts decoders
`MixtralForCausalLM` and `Qwen2MoeForCausalLM` (transformers 5.x module names). The
tensor-parallel plans of every transformers decoder but GPT-2 (which ships none) are read from
the model's own plan: `meshfit.models.plans.transformers_tp`.

Tensor parallel of GPT-2: under sequence parallel the residual stream stays a DTensor
(``local_output=False``): the model's forward reads the sequence length from the embedding
output to build positions and masks, which must be the global length. GPT-2's fused
``c_attn`` (q|k|v in one Conv1D) is re-laid out so that each rank holds q, k and v of its own
heads (``fused=3``); the global view of that weight is then head-grouped, and
`meshfit.models.plans.regroup.unfuse_columns` restores the HF layout.

Pipeline parallel: Llama, Qwen2, Mistral, Mixtral and Qwen2-MoE, as every transformers
decoder that ships a ``base_model_pp_plan``, get their plan from it
(`meshfit.models.plans.transformers_pp`). GPT-2 ships none: its plan is written here, a stage
being the model itself with the blocks of other stages removed (the kept ones under their
original indices), its forward called with ``inputs_embeds`` after the first stage, and
stand-ins for the parts it does not hold: the final norm and head before the last stage, a
zero position table and no dropout after the first (the first stage already added positions
and applied dropout).

Mixture of experts (Mixtral, Qwen2-MoE) in a pipeline: the router's load-balancing loss is
not part of a pipeline's loss: the stages call the model with ``output_router_logits=False``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from meshfit._compat.nn import child_slots
from meshfit.models.plans.base import (REPLICATE, SHARD_SEQ, PipelinePlan, Style, TPPlan,
                                       prepare_input, replicate, rowwise, sequence)
from meshfit.models.plans.gpt import head
from meshfit.models.plans.transformers_pp import transformers_pipeline_plan

__all__ = ["hf_gpt2_pipeline_plan", "hf_gpt2_plan", "hf_llama_pipeline_plan",
           "hf_moe_pipeline_plan"]


def _holds_params(model: nn.Module, name: str) -> bool:
    """Whether `model` has a module at `name` with parameters (a pipeline stage replaces
    the parts it does not hold by parameterless stand-ins or None)."""
    try:
        module = model.get_submodule(name)
    except AttributeError:
        return False
    return any(True for _ in module.parameters())


def _block(prefix: str, attn: str, mlp: str, norms: tuple[str, str], linears: dict,
           *, sp: bool, attn_kwarg: bool, drops: dict[str, float]) -> dict:
    """One decoder layer: norms, the two input preparations, the linears, the dropouts."""
    styles: dict[str, Style] = {}
    for norm in norms:
        styles[f"{prefix}.{norm}"] = sequence() if sp else replicate()
    if sp:
        styles[f"{prefix}.{attn}"] = prepare_input(
            input_kwargs={"hidden_states": SHARD_SEQ}, desired_kwargs={"hidden_states": REPLICATE}
        ) if attn_kwarg else prepare_input(input=(SHARD_SEQ,), desired=(REPLICATE,))
        styles[f"{prefix}.{mlp}"] = prepare_input(input=(SHARD_SEQ,), desired=(REPLICATE,))
    for name, style in linears.items():
        if style.kind in ("rowwise", "conv1d_rowwise") and sp:
            style = dataclasses.replace(style, output=SHARD_SEQ, local_output=False)
        styles[f"{prefix}.{name}"] = style
    for name, p in drops.items():
        if sp and p > 0:
            styles[f"{prefix}.{name}"] = sequence()
    return styles


def _sizes(config, heads: str, kv: str | None, widths: dict[str, int]) -> tuple:
    cls = type(config).__name__
    out = [(f"{cls}.{heads}", getattr(config, heads), "heads")]
    if kv and getattr(config, kv, None) not in (None, getattr(config, heads)):
        out.append((f"{cls}.{kv}", getattr(config, kv), "heads"))
    out += [(f"{cls}.{width}", value, "width") for width, value in widths.items()]
    out.append((f"{cls}.vocab_size", config.vocab_size, "vocab"))
    return tuple(out)


def _ends(model, sp: bool, loss_parallel: bool, embedding: str, extra_first: dict,
          norm: str) -> tuple[dict, dict]:
    """Styles of the parts before and after the blocks that this model (or stage) holds."""
    seq = SHARD_SEQ if sp else REPLICATE
    first: dict[str, Style] = {}
    if _holds_params(model, embedding):
        first[embedding] = rowwise(input=REPLICATE, output=seq, local_output=not sp)
    first.update({k: v for k, v in extra_first.items() if _holds_params(model, k)})
    last: dict[str, Style] = {}
    if _holds_params(model, norm):
        last[norm] = sequence() if sp else replicate()
    if _holds_params(model, "lm_head"):
        last["lm_head"] = head(loss_parallel, input=seq)
    return first, last


def hf_gpt2_plan(model: nn.Module, *, sequence_parallel: bool = False,
                 loss_parallel: bool = False) -> TPPlan:
    """Conv1D layers, fused q|k|v, tied head. Cross-attention (`add_cross_attention=True`) is
    not covered."""
    cfg, sp = model.config, sequence_parallel
    if getattr(cfg, "add_cross_attention", False):
        raise ValueError("hf_gpt2_plan does not cover GPT2Config.add_cross_attention=True; "
                         "write a plan that also splits the crossattention modules")
    extra: dict[str, Style] = {
        "transformer.wpe": replicate(output=SHARD_SEQ if sp else REPLICATE, local_output=not sp)}
    first, last = _ends(model, sp, loss_parallel, "transformer.wte", extra, "transformer.ln_f")
    if sp and cfg.embd_pdrop > 0 and "transformer.wte" in first:
        first["transformer.drop"] = sequence()
    linears = {"attn.c_attn": Style(kind="conv1d_colwise", fused=3),
               "attn.c_proj": Style(kind="conv1d_rowwise"),
               "mlp.c_fc": Style(kind="conv1d_colwise"),
               "mlp.c_proj": Style(kind="conv1d_rowwise")}
    styles = {**first, **_block("transformer.h.*", "attn", "mlp", ("ln_1", "ln_2"), linears,
                                sp=sp, attn_kwarg=False,
                                drops={"attn.resid_dropout": cfg.resid_pdrop,
                                       "mlp.dropout": cfg.resid_pdrop}), **last}
    inner = cfg.n_inner if cfg.n_inner is not None else 4 * cfg.n_embd
    return TPPlan(
        styles=styles, labels_kwarg="labels",
        local_attrs={"transformer.h.*.attn": ("num_heads", "embed_dim", "split_size")},
        divisible=_sizes(cfg, "n_head", None, {"n_inner": inner}))


# ---------------------------------------------------------------------------- pipeline
class ZeroPositions(nn.Module):
    """A position table that adds nothing: what GPT-2's stages after the first put in place
    of ``wpe`` (their input already holds the positions). A 0-dim zero, so the sum keeps the
    hidden states' dtype and values exactly."""

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros((), device=position_ids.device)


def _stage_forward(forward, x: torch.Tensor, **extra) -> torch.Tensor:
    """Token ids in on the first stage, hidden states [B, T, d] after; the model's own
    `forward` either way (it builds positions, the causal mask and rotary tables itself), no
    KV cache. Returns ``.logits``: real logits on the last stage, hidden states elsewhere
    (where the norm and head are identities)."""
    if x.is_floating_point():
        return forward(inputs_embeds=x, use_cache=False, **extra).logits
    return forward(input_ids=x, use_cache=False, **extra).logits


def hf_gpt2_pipeline_plan(model: nn.Module) -> PipelinePlan:
    """Blocks ``transformer.h``; ``wte``, ``wpe`` and the embedding dropout first;
    ``transformer.ln_f`` and ``lm_head`` (tied to ``wte``: a second copy, kept equal) last."""
    return PipelinePlan(
        blocks="transformer.h", first=("transformer.wte", "transformer.wpe", "transformer.drop"),
        last=("transformer.ln_f", "lm_head"),
        stand_ins={"transformer.wpe": ZeroPositions, "transformer.drop": nn.Identity,
                   "transformer.ln_f": nn.Identity, "lm_head": nn.Identity},
        forward=_stage_forward)


def hf_llama_pipeline_plan(model: nn.Module) -> PipelinePlan:
    """Llama, Qwen2, Mistral (and every transformers decoder with a ``base_model_pp_plan``):
    `meshfit.models.plans.transformers_pp.transformers_pipeline_plan`, the one way such a
    plan is made (blocks ``model.layers``; ``model.embed_tokens`` first; ``model.norm`` and
    ``lm_head`` last; ``model.rotary_emb`` on every stage)."""
    return transformers_pipeline_plan(model)


def hf_moe_pipeline_plan(model: nn.Module) -> PipelinePlan:
    """Mixtral, Qwen2-MoE: `transformers_pipeline_plan`, whose stages run without router
    logits (a pipeline trains on the cross-entropy only, no load-balancing loss)."""
    return transformers_pipeline_plan(model)
