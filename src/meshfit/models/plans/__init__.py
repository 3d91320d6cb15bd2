"""Parallel plans as data: how tensor parallel splits a model's modules (`TPPlan`) and where
pipeline stages are cut (`PipelinePlan`), for meshfit's reference model and Hugging Face's:

    base.py     `TPPlan`, `PipelinePlan` and the `Style` kinds
    gpt.py      meshfit's reference `GPT`
    hf.py       Hugging Face GPT-2 (tensor parallel), and the pipeline plans of Llama (and
                Qwen2, Mistral), GPT-2, Mixtral and Qwen2-MoE
    transformers_tp.py  the tensor-parallel plan of every other transformers decoder, read
                from the model's own plan (``config.base_model_tp_plan``)
    regroup.py  fused projections regrouped by heads, and back

How `plan_for` finds a tensor-parallel plan (a user's plan, given to ``apply_tp(plan=...)``,
``Accelerator(tp_plan=...)`` or ``meshfit train``'s ``model.tp_plan``, is used instead of
any of these): meshfit's `GPT` -> `gpt_plan`; transformers' GPT-2 (which ships no plan) ->
`hf_gpt2_plan`; any other transformers model -> `transformers_tp_plan`, or a one-line
refusal (`tp_problem`) naming the family and what works.

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

import dataclasses
import sys
from fnmatch import fnmatchcase

from torch import nn

from meshfit.models.gpt import GPT
from meshfit.models.plans.base import (REPLICATE, SHARD_LAST, PipelinePlan, Style, TPPlan, colwise,
                                       divisibility_problem, gather_input, gather_sequence,
                                       prepare_input, replicate, replicate_local, rowwise,
                                       sequence)
from meshfit.models.plans.gpt import gpt_pipeline_plan, gpt_plan
from meshfit.models.plans.hf import (hf_gpt2_pipeline_plan, hf_gpt2_plan, hf_llama_pipeline_plan,
                                     hf_moe_pipeline_plan)
from meshfit.models.plans.transformers_pp import (pipeline_plan_problem,
                                                  transformers_pipeline_plan)
from meshfit.models.plans.transformers_tp import (MAPPED_STYLES, hf_tp_problem, meta_model,
                                                  transformers_tp_plan)

__all__ = ["MAPPED_STYLES", "PipelinePlan", "Style", "TPPlan", "adapted_model", "colwise",
           "divisibility_problem", "gather_input", "gather_sequence", "gpt_pipeline_plan",
           "gpt_plan", "has_builtin_plans", "has_pipeline_plan", "has_tp_plan", "hf_gpt2_pipeline_plan",
           "hf_gpt2_plan", "hf_llama_pipeline_plan", "hf_llama_plan", "hf_moe_pipeline_plan",
           "hf_moe_plan", "lora_plan", "pipeline_plan_for", "plan_for", "prepare_input",
           "pipeline_plan_problem", "replicate", "replicate_local", "rowwise", "sequence",
           "tp_problem", "transformers_pipeline_plan", "transformers_tp_plan"]

# The hand-written Llama (Qwen2, Mistral) and Mixtral / Qwen2-MoE plans were replaced by the
# general path, which gives those families the same styles; the names stay for users.
hf_llama_plan = hf_moe_plan = transformers_tp_plan

_BUILT_IN = ("meshfit GPT, transformers LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM, "
             "GPT2LMHeadModel, MixtralForCausalLM and Qwen2MoeForCausalLM")
_LLAMA_LIKE = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
_MOE = ("MixtralForCausalLM", "Qwen2MoeForCausalLM")


def adapted_model(model: nn.Module) -> nn.Module:
    """The model a peft.PeftModel (LoRA) adapts, its LoRA layers inside; else `model`.
    (peft is only looked at when it is already imported: no import cost otherwise.)"""
    peft = sys.modules.get("peft")
    if peft is not None and isinstance(model, peft.PeftModel):
        return model.get_base_model()
    return model


def _family(model: nn.Module) -> str | None:
    model = adapted_model(model)  # LoRA changes no module the plans name but the linears
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


def _is_transformers(model) -> bool:
    hf = sys.modules.get("transformers")
    return hf is not None and isinstance(model, hf.PreTrainedModel)


def tp_problem(model_or_config, tp: int) -> str | None:
    """Why `model_or_config` (a model, a transformers configuration) cannot run tensor
    parallel on `tp` ranks with meshfit's own plan, in one line naming the family and what
    works instead; None when it can (a user's own plan is not considered)."""
    model = model_or_config
    if isinstance(model, nn.Module):
        model = adapted_model(model)
    elif getattr(model, "model_type", None) == "gpt2":  # a configuration: its module tree
        model = meta_model(model)
    if isinstance(model, nn.Module) and _family(model) in ("gpt", "gpt2"):
        try:
            plan = plan_for(model)
        except ValueError as err:
            return str(err)
        return divisibility_problem(plan.divisible, tp) if tp > 1 else None
    if isinstance(model, nn.Module) and not _is_transformers(model):
        return (f"no built-in tensor-parallel plan for {type(model).__name__} (meshfit's GPT, "
                "transformers GPT-2 and the transformers decoders that ship a plan have one); "
                "ZeRO (parallel.dp_shard) and DDP work for it")
    return hf_tp_problem(model, tp)


def has_tp_plan(model: nn.Module) -> bool:
    """Whether meshfit has a tensor-parallel plan for `model` (any tp; sizes not checked)."""
    return tp_problem(model, 1) is None


def has_pipeline_plan(model: nn.Module) -> bool:
    """Whether meshfit has a pipeline plan for `model` (`pipeline_plan_for`)."""
    try:
        pipeline_plan_for(model)
    except ValueError:
        return False
    return True


def has_builtin_plans(model: nn.Module) -> bool:
    """Whether meshfit has both a tensor-parallel plan (`has_tp_plan`) and a pipeline plan
    (`has_pipeline_plan`) for `model`; ask each for its axis alone."""
    return has_tp_plan(model) and has_pipeline_plan(model)


def _refuse_peft(model: nn.Module, what: str) -> None:
    if adapted_model(model) is not model:
        raise ValueError(f"{what} of a LoRA model: pass the model inside the peft.PeftModel "
                         "(peft_model.base_model.model), whose adapted linears go with their "
                         "blocks; the stages are copies, so save the adapters from the "
                         "pipeline's full_state_dict (meshfit train does)")


def plan_for(model: nn.Module, *, sequence_parallel: bool = False,
             loss_parallel: bool = False) -> TPPlan:
    """meshfit's tensor-parallel plan for `model` (see the module docstring for the order);
    ValueError in one line where there is none (`tp_problem` says why). A LoRA model (peft.PeftModel): its base model's plan with
    each adapted linear's adapters laid out to match (`lora_plan`)."""
    base = adapted_model(model)
    if base is not model:
        return lora_plan(plan_for(base, sequence_parallel=sequence_parallel,
                                  loss_parallel=loss_parallel), model)
    family = _family(model)
    if family in ("gpt", "gpt2"):
        build = gpt_plan if family == "gpt" else hf_gpt2_plan
        return build(model, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    if not _is_transformers(model):
        raise ValueError(f"no built-in tensor-parallel plan for {type(model).__name__}; "
                         "built-in: meshfit GPT, transformers GPT-2 and every transformers "
                         "decoder that ships a tensor-parallel plan; pass plan={module "
                         "pattern: Style or ParallelStyle} to apply_tp, or "
                         "Accelerator(tp_plan=...)")
    return transformers_tp_plan(model, sequence_parallel=sequence_parallel,
                                loss_parallel=loss_parallel)


_LORA_PREFIX = "base_model.model."  # where a PeftModel keeps the model it adapts
# Styles that keep a module's parameters whole on every rank: an adapted module under one of
# them keeps its adapters whole too, the style given to the LoRA layer itself (a MoE's
# routed experts, Qwen2-MoE's shared-expert gate), so base(x) + B(A(x)) adds like tensors.
_WHOLE = ("replicate", "replicate_local")


def _adapted(module: nn.Module) -> bool:
    """A peft LoRA layer: the wrapped linear in `base_layer`, adapters in lora_A / lora_B."""
    return all(isinstance(getattr(module, a, None), nn.Module)
               for a in ("base_layer", "lora_A", "lora_B"))


def lora_plan(plan: TPPlan, model: nn.Module) -> TPPlan:
    """`plan` (of the model inside the PeftModel `model`) for `model`: every key under peft's
    prefix, and each adapted linear's style given to its ``base_layer`` with the adapters laid
    out so that ``base(x) + B(A(x))`` adds like placements:

    - column-parallel base (output features split): A whole on every rank (input as the
      base gets it, output replicated), B column-parallel (its output split like the base's);
    - row-parallel base (input features split): A row-parallel (its input split like the
      base's, its r outputs all-reduced), B whole on every rank (output laid out like the
      base's: replicated, or sequence-sharded under sequence parallel).

    A and B whole are replicated DTensors, so their gradients are summed over the ranks
    that computed parts of them. A module kept whole (`_WHOLE`) keeps its adapters whole:
    the style goes to the LoRA layer with everything in it. Other styles on an adapted
    module are refused."""
    names = {n: m for n, m in model.named_modules()}
    styles: dict[str, object] = {}
    for key, style in plan.styles.items():
        full = _LORA_PREFIX + key
        matched = [m for n, m in names.items() if _matches_pattern(full, n)]
        if not any(_adapted(m) for m in matched):
            styles[full] = style
            continue
        if isinstance(style, Style) and style.kind in _WHOLE:  # adapters replicated with it
            styles[full] = style
            continue
        if not isinstance(style, Style) or style.kind not in ("colwise", "rowwise"):
            kind = getattr(style, "kind", type(style).__name__)
            raise ValueError(f"tensor parallel of a LoRA model: {key!r} is adapted by LoRA and "
                             f"laid out as {kind!r}; only column- and row-parallel linears "
                             "and replicated modules take adapters (leave it out of "
                             "peft.target_modules)")
        adapters = sorted({a for m in matched if _adapted(m) for a in m.lora_A.keys()})
        styles[f"{full}.base_layer"] = style
        local = style.local_output if style.local_output is not None else True
        column = style.kind == "colwise"
        # (A, B): the split one takes the base's input (row) or output (column) layout
        a_style, b_style = (replicate, colwise) if column else (rowwise, replicate)
        for a in adapters:
            styles[f"{full}.lora_A.{a}"] = a_style(
                input=style.input or (REPLICATE if column else SHARD_LAST), output=REPLICATE,
                local_output=True)
            styles[f"{full}.lora_B.{a}"] = b_style(
                input=REPLICATE, output=style.output or (SHARD_LAST if column else REPLICATE),
                local_output=local)
    local_attrs = {_LORA_PREFIX + k: v for k, v in plan.local_attrs.items()}
    return dataclasses.replace(plan, styles=styles, local_attrs=local_attrs)


def _matches_pattern(pattern: str, name: str) -> bool:
    """fnmatch per dotted atom, as `apply_tp` matches plan keys."""
    p, n = pattern.split("."), name.split(".")
    return len(p) == len(n) and all(fnmatchcase(b, a) for a, b in zip(p, n))


def pipeline_plan_for(model: nn.Module) -> PipelinePlan:
    """The built-in pipeline plan for `model`: meshfit's GPT and transformers' GPT-2 have
    theirs written out; every other transformers decoder's is read from its own
    ``config.base_model_pp_plan`` (`transformers_pipeline_plan`). ValueError naming why not
    (`pipeline_plan_problem`), what works instead and how to pass a plan."""
    _refuse_peft(model, "pipeline parallel")
    if isinstance(model, GPT):
        return gpt_pipeline_plan(model)
    hf = sys.modules.get("transformers")  # (only looked at when the model came from it)
    if hf is not None and isinstance(model, hf.GPT2LMHeadModel):
        return hf_gpt2_pipeline_plan(model)
    if hf is not None and isinstance(model, hf.PreTrainedModel):
        problem = pipeline_plan_problem(model)
        if problem is None:
            return transformers_pipeline_plan(model)
        raise ValueError(f"no built-in pipeline plan for {type(model).__name__}: {problem}")
    raise ValueError(f"no built-in pipeline plan for {type(model).__name__}; built-in: meshfit "
                     "GPT, transformers GPT-2 and every transformers decoder that ships a "
                     "base_model_pp_plan; pass plan=PipelinePlan(blocks=..., first=..., "
                     "last=...) to prepare_pipeline / build_pipeline")
