"""Parallel plans as data: how tensor parallel splits a model's modules (`TPPlan`) and where
pipeline stages are cut (`PipelinePlan`), for meshfit's reference model and Hugging Face's:

    base.py     `TPPlan`, `PipelinePlan` and the `Style` kinds
    gpt.py      meshfit's reference `GPT`
    hf.py       Hugging Face Llama (and Qwen2, Mistral), GPT-2, Mixtral and Qwen2-MoE
    regroup.py  fused projections regrouped by heads, and back

Tensor parallel follows Megatron-LM (Shoeybi et al. 2019): attention q/k/v and MLP up/gate
column-parallel, attention output and MLP down row-parallel, so each block needs one
all-reduce forward and one backward per sub-layer; embedding and head vocabulary-parallel.
With sequence parallel (Korthikanti et al. 2022) the all-reduces become reduce-scatter /
all-gather pairs and the norms and dropouts between them run on a sequence shard (the
placements: `meshfit.parallel.tp.apply`). RoPE tables are buffers used on the full sequence
inside attention. Dropout modules appear in sequence-parallel plans only when their
probability is > 0.

The plans name no parallel code: `meshfit.parallel.tp.apply_tp` turns each `Style` into a
PyTorch `ParallelStyle`, and `meshfit.parallel.pp` cuts stages from a `PipelinePlan`. A model
of another type passes its own plans (``apply_tp(plan=...)``, ``prepare_pipeline(plan=...)``).
"""

from __future__ import annotations

import sys

from torch import nn

from meshfit.models.gpt import GPT
from meshfit.models.plans.base import (PipelinePlan, Style, TPPlan, colwise, divisibility_problem,
                                       gather_sequence, prepare_input, replicate,
                                       replicate_local, rowwise, sequence)
from meshfit.models.plans.gpt import gpt_pipeline_plan, gpt_plan
from meshfit.models.plans.hf import (hf_gpt2_pipeline_plan, hf_gpt2_plan, hf_llama_pipeline_plan,
                                     hf_llama_plan, hf_moe_pipeline_plan, hf_moe_plan)

__all__ = ["PipelinePlan", "Style", "TPPlan", "colwise", "divisibility_problem",
           "gather_sequence", "gpt_pipeline_plan", "gpt_plan", "hf_gpt2_pipeline_plan",
           "hf_gpt2_plan", "has_builtin_plans", "hf_llama_pipeline_plan", "hf_llama_plan",
           "hf_moe_pipeline_plan", "hf_moe_plan", "pipeline_plan_for", "plan_for",
           "prepare_input", "replicate", "replicate_local", "rowwise", "sequence"]

_BUILT_IN = ("meshfit GPT, transformers LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM, "
             "GPT2LMHeadModel, MixtralForCausalLM and Qwen2MoeForCausalLM")
_LLAMA_LIKE = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
_MOE = ("MixtralForCausalLM", "Qwen2MoeForCausalLM")


def _family(model: nn.Module) -> str | None:
    if isinstance(model, GPT):
        return "gpt"
    # transformers is only looked at when the model came from it (no import cost otherwise).
    hf = sys.modules.get("transformers")
    if hf is not None:
        # Qwen2 and Mistral decoders have Llama's module names and shapes (Qwen2 adds
        # biases to q/k/v, which split with their columns), so Llama's plans fit them.
        llama_like = tuple(getattr(hf, n) for n in _LLAMA_LIKE if hasattr(hf, n))
        if isinstance(model, llama_like):
            return "llama"
        if isinstance(model, hf.GPT2LMHeadModel):
            return "gpt2"
        # Llama's attention with a mixture-of-experts MLP (transformers 5's fused experts).
        if isinstance(model, tuple(getattr(hf, n) for n in _MOE if hasattr(hf, n))):
            return "moe"
    return None


def has_builtin_plans(model: nn.Module) -> bool:
    """Whether meshfit has tensor- and pipeline-parallel plans for `model`'s type."""
    return _family(model) is not None


def _refuse_peft(model: nn.Module, what: str) -> None:
    peft = sys.modules.get("peft")
    if peft is not None and isinstance(model, peft.PeftModel):
        raise ValueError(f"{what} of a LoRA model (peft.PeftModel) is not yet available: LoRA "
                         "wraps each adapted linear in a LoraLayer (its weight moves to "
                         "base_layer, beside lora_A/lora_B), which the built-in plans do not "
                         "name; use data parallel or ZeRO with LoRA, or tensor/pipeline "
                         "parallel without it")


def plan_for(model: nn.Module, *, sequence_parallel: bool = False,
             loss_parallel: bool = False) -> TPPlan:
    """The built-in tensor-parallel plan for `model`'s type; ValueError naming the supported
    types and how to pass a plan."""
    _refuse_peft(model, "tensor parallel")
    build = {"gpt": gpt_plan, "llama": hf_llama_plan, "gpt2": hf_gpt2_plan,
             "moe": hf_moe_plan}.get(_family(model))
    if build is None:
        raise ValueError(f"no built-in tensor-parallel plan for {type(model).__name__}; "
                         f"built-in: {_BUILT_IN}; pass plan={{module pattern: Style or "
                         "ParallelStyle}} to apply_tp, or Accelerator(tp_plan=...)")
    return build(model, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)


def pipeline_plan_for(model: nn.Module) -> PipelinePlan:
    """The built-in pipeline plan for `model`'s type; ValueError naming the supported types
    and how to pass a plan."""
    _refuse_peft(model, "pipeline parallel")
    build = {"gpt": gpt_pipeline_plan, "llama": hf_llama_pipeline_plan,
             "gpt2": hf_gpt2_pipeline_plan, "moe": hf_moe_pipeline_plan}.get(_family(model))
    if build is None:
        raise ValueError(f"no built-in pipeline plan for {type(model).__name__}; built-in: "
                         f"{_BUILT_IN}; pass plan=PipelinePlan(blocks=..., first=..., last=...)"
                         " to prepare_pipeline / build_pipeline")
    return build(model)
