"""Pipeline plans read from transformers' own ``config.base_model_pp_plan``, for every
decoder that ships one (123+ model types in transformers 5.2x).

transformers states, per model type, the modules of the base model in the order its forward
runs them and what each takes and gives, e.g. Llama's::

    {"embed_tokens": (["input_ids"], ["inputs_embeds"]),
     "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
     "norm": (["hidden_states"], ["hidden_states"])}

GPT-NeoX adds ``"emb_dropout"`` after ``"embed_in"`` (Phi: ``"embed_dropout"``), GPT-J and
CodeGen name theirs ``wte``, ``drop``, ``h``, ``ln_f``. Read as data: the entry that takes the
attention mask is the block list; the entries before it belong to the first stage, those after
it, and the head (the model's output embedding), to the last (`transformers_pipeline_plan`).

How a stage runs (`StageRun`): the model's own forward, with ``inputs_embeds`` after the first
stage, so that each family builds its positions, causal and sliding-window masks and rotary
tables itself, on every stage. The stage's blocks (`meshfit.models.plans.stage.StageBlocks`)
make the boundaries exact for every family:

- the first block of a stage after the first runs on exactly what the previous stage's last
  block produced, so what the forward does to ``inputs_embeds`` before its blocks (Granite's
  ``embedding_multiplier``, GPT-NeoX's embedding dropout) happens once, on the first stage
  (Gemma scales inside its embedding module, which only the first stage holds);
- a stage before the last hands on its last block's output, so what follows the blocks
  (final norm, head, Gemma 2/3's ``final_logit_softcapping``, Granite's ``logits_scaling``)
  happens once, on the last stage;
- alternating layer types (Gemma 2/3, Qwen2/3, SmolLM3 with sliding windows): the forward
  picks layer i's mask (Gemma 3: also its rotary table) by ``config.layer_types[i]``, i
  counted within the blocks it iterates, so each stage's base model reads a copy of the
  configuration whose ``layer_types`` are those of the layers it holds (the layers keep the
  full configuration: they read theirs, by global index, when built);
- per-layer features fixed at construction (SmolLM3's layers without RoPE, GPT-NeoX's
  parallel residual, dense and sparse MoE layers) travel with the layers;
- a head tied to the embedding (Gemma, SmolLM3) is a second copy on the last stage, whose
  gradient `meshfit.parallel.pp` sums with the first stage's and keeps equal, as for GPT-2;
- mixture-of-experts models run with ``output_router_logits=False``: a pipeline's loss is the
  last stage's cross-entropy; the load-balancing loss of each stage's routers is not in it.

What is refused (`pipeline_plan_problem`): configurations without a ``base_model_pp_plan``,
encoder-decoders, layer types other than full, sliding or chunked attention (linear-attention
and state-space hybrids, DeepSeek-V3.2's indexed attention), layers that reuse earlier layers'
keys and values (Gemma 3n's ``num_kv_shared_layers``), a plan whose block list cannot be told
or is not a ModuleList in the model, a model without an output embedding (not a causal LM).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from meshfit._compat.nn import child_slots
from meshfit.models.plans.base import PipelinePlan
from meshfit.models.plans.stage import StageBlocks

__all__ = ["StageRun", "pipeline_plan_problem", "transformers_pipeline_plan"]

ATTENTION_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
"""Layer types whose masks a stage builds as the full model does (by layer type)."""
_WORKS = ("data parallel and ZeRO (parallel.dp_replicate, parallel.dp_shard) work for every "
          "model")
_GIVE = ("give a PipelinePlan(blocks=..., first=..., last=...) as prepare_pipeline(plan=...) "
         "or model.pipeline_plan = \"module:PLAN\"")


def _config_of(model_or_config):
    return getattr(model_or_config, "config", model_or_config)


def _parts(pp_plan: Mapping) -> tuple[list[str], str, list[str]] | None:
    """(names before the blocks, the blocks' name, names after) of a base_model_pp_plan;
    None when not exactly one entry takes the attention mask or nothing takes the ids."""
    names = list(pp_plan)
    blocks = [n for n in names if "attention_mask" in tuple(pp_plan[n][0])]
    if len(blocks) != 1:
        return None
    i = names.index(blocks[0])
    if not any("input_ids" in tuple(pp_plan[n][0]) for n in names[:i]):
        return None
    return names[:i], blocks[0], names[i + 1:]


def pipeline_plan_problem(model_or_config) -> str | None:
    """Why no pipeline plan can be read from the transformers model or configuration
    `model_or_config` (one line naming the model type and what works instead), or None."""
    config = _config_of(model_or_config)
    kind = getattr(config, "model_type", None) or type(config).__name__
    pp_plan = getattr(config, "base_model_pp_plan", None)
    if getattr(config, "is_encoder_decoder", False):
        return (f"model_type {kind!r} is an encoder-decoder; pipeline stages are cut from "
                f"decoders only; {_WORKS}")
    if not pp_plan:
        return (f"model_type {kind!r} ships no base_model_pp_plan in transformers; {_GIVE}; "
                f"{_WORKS}")
    if _parts(pp_plan) is None:
        return (f"model_type {kind!r}: its base_model_pp_plan {list(pp_plan)} has no single "
                f"block list after the embedding; {_GIVE}; {_WORKS}")
    other = sorted(set(getattr(config, "layer_types", None) or ()) - set(ATTENTION_TYPES))
    if other:
        return (f"model_type {kind!r} has layers of type {other} (not full, sliding or "
                f"chunked attention: a linear-attention or state-space hybrid, indexed sparse "
                f"attention), which pipeline stages do not cover yet; {_WORKS}")
    shared = getattr(config, "num_kv_shared_layers", 0)
    if shared:
        return (f"model_type {kind!r}: its last num_kv_shared_layers={shared} layers attend "
                f"with the keys and values of earlier layers, which another stage would hold; "
                f"{_WORKS}")
    if isinstance(model_or_config, nn.Module):
        return _model_problem(model_or_config, _parts(pp_plan)[1])
    return None


def _model_problem(model: nn.Module, blocks: str) -> str | None:
    """What the model (beyond its configuration) lacks for a pipeline plan."""
    name, prefix = type(model).__name__, getattr(model, "base_model_prefix", "")
    if not prefix or not hasattr(model, prefix) or model.get_output_embeddings() is None:
        return (f"{name} has no output embedding (not a causal LM): a pipeline's last stage "
                f"computes logits; {_WORKS}")
    if not isinstance(getattr(getattr(model, prefix), blocks, None), nn.ModuleList):
        return (f"{name} holds no ModuleList at {prefix}.{blocks}, where its "
                f"base_model_pp_plan puts the blocks; {_GIVE}; {_WORKS}")
    return None


def _name_of(model: nn.Module, module: nn.Module) -> str:
    return next(n for n, m in model.named_modules() if m is module)


def transformers_pipeline_plan(model: nn.Module) -> PipelinePlan:
    """The `PipelinePlan` of a transformers causal LM, from its ``base_model_pp_plan`` (see
    the module docstring); ValueError (`pipeline_plan_problem`) when it has none."""
    problem = pipeline_plan_problem(model)
    if problem:
        raise ValueError(problem)
    config = model.config
    before, blocks, after = _parts(config.base_model_pp_plan)
    prefix = model.base_model_prefix
    head = _name_of(model, model.get_output_embeddings())
    first = tuple(f"{prefix}.{n}" for n in before)
    last = tuple(f"{prefix}.{n}" for n in after) + (head,)
    # What the forward calls on every stage gets a parameterless stand-in; what it calls
    # only without inputs_embeds (the token embedding) is left out.
    stand_ins = {f"{prefix}.{n}": nn.Identity for n in before
                 if "input_ids" not in tuple(config.base_model_pp_plan[n][0])}
    stand_ins |= {name: nn.Identity for name in last}
    types = getattr(config, "layer_types", None)
    run = StageRun(base=prefix, blocks=f"{prefix}.{blocks}", head=head,
                   layer_types=tuple(types) if types else None,
                   router=hasattr(config, "output_router_logits"))
    return PipelinePlan(blocks=f"{prefix}.{blocks}", first=first, last=last,
                        stand_ins=stand_ins, forward=run)


@dataclass(frozen=True, kw_only=True)
class StageRun:
    """``run(model_forward, x)``: one stage of a transformers causal LM on `x` (token ids on
    the first stage, hidden states [B, T, d] after it), through the model's own forward
    (`model_forward`, bound to the stage), without KV cache; returns logits on the last
    stage, the last block's output before it."""

    base: str
    """Path of the base model (``model``, ``gpt_neox``)."""
    blocks: str
    """Path of the block list."""
    head: str
    """Path of the output embedding (``lm_head``)."""
    layer_types: tuple[str, ...] | None
    """The full model's ``config.layer_types`` (None: it has none)."""
    router: bool
    """The forward takes ``output_router_logits`` (mixture of experts): turned off."""

    def __call__(self, forward, x: torch.Tensor) -> torch.Tensor:
        stage = forward.__self__
        blocks = stage.get_submodule(self.blocks)
        extra = {"output_router_logits": False} if self.router else {}
        ids = not x.is_floating_point()
        inputs = {"input_ids": x} if ids else {"inputs_embeds": x}
        if not isinstance(blocks, StageBlocks):  # the whole model, not cut
            return forward(**inputs, use_cache=False, **extra).logits
        self._stage_layer_types(stage, blocks)
        last = any(True for _ in stage.get_submodule(self.head).parameters())
        with blocks.boundary(None if ids else x):
            out = forward(**inputs, use_cache=False, **extra).logits
            # (a piece without blocks, as `block_times` cuts: what the forward gave)
            return out if last or blocks.exit is None else blocks.exit

    def _stage_layer_types(self, stage: nn.Module, blocks: StageBlocks) -> None:
        """The stage's base model reads the layer types of the layers it holds, in order."""
        if not self.layer_types:
            return
        base = stage.get_submodule(self.base)
        held = [self.layer_types[int(k)] for k, m in child_slots(blocks).items()
                if m is not None]
        if list(base.config.layer_types) != held:
            config = copy.copy(base.config)  # the layers keep the full one
            config.layer_types = held
            base.config = config
