"""Context parallel for transformers' decoders: the ring (`meshfit.parallel.cp`) registered
as an attention implementation in transformers' attention interface, for every model class
whose attention goes through it.

**Which models.** A transformers model class says it runs any function registered with
``AttentionInterface`` by ``_supports_attention_backend = True``, which its public
``is_backend_compatible()`` returns (its attention layers call
``ALL_ATTENTION_FUNCTIONS``, and pass the function what it needs: the module, q [B, H, T, D],
k and v [B, Hkv, T, D], ``scaling``, ``dropout``, ``softcap``). That flag, not a list of
names, decides: Llama, Qwen2/3, Mistral, Mixtral, Gemma 2/3, Phi-3, OLMo 2, GPT-NeoX,
Granite, SmolLM3, the MoE and DeepSeek families all have it. What the ring then reads:

- the mask the model asked for, per layer: the ring registers a mask function too
  (``AttentionMaskInterface``), which builds no [T, T] mask but a `RingMask` naming the
  layer's sliding window (transformers' ``create_sliding_window_causal_mask`` gives it as
  ``local_size``); a model with sliding and full layers (Gemma 2/3, Qwen3's layer_types)
  hands each layer its own, as it does its SDPA masks. The window (query i sees keys j with
  0 <= i - j < window, transformers' convention) is applied to the ring's blocks
  (`meshfit.parallel.cp._pairs`);
- ``scaling`` from the module (Gemma's query_pre_attn_scalar, Granite's
  attention_multiplier, DeepSeek's mscale), ``softcap`` (Gemma 2's attention logit
  softcapping: the ring's matmul blocks cap the scores before the softmax);
- positions: the model's ``position_ids`` are filled in with the tokens' global positions
  (rotary tables of every kind, GPT-NeoX's partial rotary, SmolLM3's layers without RoPE
  take them as they are); q/k norms (Qwen3, OLMo 2, Gemma 3) run before attention, on the
  rank's own tokens;
- DeepSeek's multi-head latent attention: values narrower than queries and keys;
- GPT-OSS's attention sinks (``s_aux``: one more logit per head in every softmax).

**What is refused** (`cp_problem`, one line): a class without the flag (its attention does
not go through the interface: linear-attention and state-space hybrids, older models that
build their own masks), layer types other than full and sliding attention, bidirectional or
chunked attention, attention dropout, a model that is not a causal decoder (encoder-decoders,
vision towers); at run time a padding mask (a mask of all ones is dropped) and a mask of the
model's own making.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch

from meshfit._compat import transformers as hf_internals
from meshfit.models.gpt import GPT, GPTConfig
from meshfit.models.plans import adapted_model, meta_model

__all__ = ["RingMask", "apply_cp_hf", "cp_problem", "hf_model_class"]

_IMPLEMENTATION = "meshfit_ring"
_LAYER_TYPES = ("full_attention", "sliding_attention")
_DROPOUTS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")
_CHANGES_ATTENTION = {
    "sinks": "attention sinks", "cu_seq_lens_q": "packed sequences",
    "cu_seq_lens_k": "packed sequences",
}
"""Arguments some models pass their attention function that change what it computes."""
WORKS = ("ZeRO and DDP (cp=1) run it; context parallel runs transformers decoders whose "
         "attention goes through transformers' attention interface (Llama, Qwen2/3, "
         "Mistral, Mixtral, Gemma 2/3, Phi-3, OLMo 2, GPT-NeoX, Granite, SmolLM3, "
         "DeepSeek-V3, GLM-4-MoE, ...) and meshfit's GPT")
"""What does work, for the refusals' lines."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RingMask:
    """What the ring's mask function gives a layer in place of a [T, T] mask: the layer's
    sliding window (None: causal over the whole sequence), whether the model asked for
    bidirectional attention, and whether it added a pattern of its own (an or/and mask
    function: image tokens, bidirectional windows), which the ring cannot apply."""

    window: int | None = None
    bidirectional: bool = False
    custom: bool = False


def hf_model_class(config):
    """The causal-LM class transformers builds for `config` (None: none is registered, e.g.
    an encoder-decoder, a vision model, or remote code)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except (KeyError, ValueError):
        return None


def cp_problem(model_or_config, cp: int, seq_len: int | None = None, *,
               balanced: bool = True) -> str | None:
    """Why `model_or_config` (meshfit's GPT or GPTConfig, a transformers model or
    configuration) cannot train under context parallel `cp` with sequences of `seq_len`
    tokens, in one line naming what does work; None when it can."""
    if cp <= 1:
        return None
    pieces = 2 * cp if balanced else cp
    if seq_len is not None and seq_len % pieces:
        return (f"a sequence of {seq_len} tokens does not split into {pieces} equal chunks "
                f"(cp={cp}{', load-balanced: 2 x cp' if balanced else ''}); use a multiple "
                f"of {pieces}")
    target = adapted_model(model_or_config) if isinstance(model_or_config, torch.nn.Module) \
        else model_or_config
    if isinstance(target, (GPT, GPTConfig)):
        dropout = (target.config if isinstance(target, GPT) else target).dropout
        return None if not dropout > 0 else (
            f"attention dropout (dropout={dropout}) is not available: the ring computes "
            "exact attention; set the model's dropout to 0")
    config = getattr(target, "config", target)
    if not hasattr(config, "model_type"):
        return (f"{type(target).__name__} is neither meshfit's GPT nor a transformers model; "
                f"{WORKS}")
    cls = type(target) if isinstance(target, torch.nn.Module) else hf_model_class(config)
    problem = _hf_problem(config, cls)
    if problem or cls is None:
        return problem
    if isinstance(target, torch.nn.Module):
        module = target
    else:  # (the module tree on the meta device: where the attention layers are)
        try:
            module = meta_model(config)
        except Exception:  # noqa: BLE001 (a model that cannot be built says so at its build)
            return None
    if not attention_layers(module):
        return (f"model_type {config.model_type!r}: {type(module).__name__} has no attention "
                f"layer the ring can replace (none marked is_causal, as transformers marks "
                f"those its attention interface runs); {WORKS}")
    return None


def attention_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The attention layers of a transformers model: those transformers gives the `is_causal`
    its SDPA and flash paths read."""
    return [m for m in model.modules() if hasattr(m, "is_causal")
            and not isinstance(m, type(model))]


def _hf_problem(config, cls) -> str | None:
    kind = f"model_type {config.model_type!r}"
    if getattr(config, "is_encoder_decoder", False) or (cls is None and not getattr(
            config, "auto_map", None)):
        return (f"{kind} has no causal decoder in transformers (an encoder-decoder, encoder "
                f"or vision model?); {WORKS}")
    if cls is not None and not (hasattr(cls, "is_backend_compatible")
                                and cls.is_backend_compatible()):
        return (f"{kind}: {cls.__name__}'s attention does not go through transformers' "
                f"attention interface, so the ring cannot replace it; {WORKS}")
    # A composite configuration (Llama 4: a text model beside a vision tower) keeps the
    # decoder's layer types and attention settings in its text configuration.
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    others = sorted(set(getattr(config, "layer_types", None) or ()) - set(_LAYER_TYPES))
    if others:
        return (f"{kind} has {', '.join(map(repr, others))} layers (layer_types), which the "
                f"ring does not compute (it runs full and sliding attention); {WORKS}")
    if getattr(config, "is_causal", True) is False or getattr(
            config, "use_bidirectional_attention", False):
        return (f"{kind} with bidirectional attention is not available: the ring is causal; "
                "set use_bidirectional_attention=false, or cp=1")
    if getattr(config, "attention_chunk_size", None):
        return (f"{kind}'s chunked attention (attention_chunk_size="
                f"{config.attention_chunk_size}) is not available: the ring runs full and "
                "sliding-window attention; use cp=1")
    for name in _DROPOUTS:
        if getattr(config, name, 0.0):
            return (f"{name}={getattr(config, name)} is not available: the ring computes "
                    "attention exactly, without dropout; set it to 0")
    return None


def _ring(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
          softcap=None, s_aux=None, **kwargs):
    """transformers' attention-interface function: the ring over `module.sequence_shard`
    (`meshfit.parallel.cp.SequenceShard.attend`; query [B, H, T, D], key/value
    [B, Hkv, T, D or Dv]) with the layer's window from its `RingMask`, the module's scaling
    and softcap, GPT-OSS's attention sinks (`s_aux`)."""
    shard = getattr(module, "sequence_shard", None)
    where = type(module).__name__
    if shard is None:
        raise ValueError(f"context parallel: {where} was not prepared for the ring (it has "
                         "no sequence_shard); prepare the model with cp > 1")
    if dropout:
        raise ValueError(f"context parallel: {where} asks for attention dropout={dropout}; "
                         "the ring computes attention exactly: set attention_dropout to 0")
    unknown = sorted(k for k in _CHANGES_ATTENTION if kwargs.get(k) is not None)
    if unknown:
        raise ValueError(f"context parallel: {where} passes {', '.join(unknown)} to its "
                         f"attention ({_CHANGES_ATTENTION[unknown[0]]}), which the ring does "
                         "not compute; use cp=1 with this model")
    mask = attention_mask if attention_mask is not None else RingMask()
    if not isinstance(mask, RingMask) or mask.custom:
        raise ValueError(f"context parallel: {where} was handed a mask of the model's own "
                         "making, which the ring cannot apply (it masks causally, with the "
                         "layer's sliding window); use cp=1 with this model")
    if mask.bidirectional or getattr(module, "is_causal", True) is False:
        raise ValueError(f"context parallel: {where} attends bidirectionally; the ring is "
                         "causal: use cp=1 with this model")
    out = shard.attend(query, key, value, scale=scaling, window=mask.window, softcap=softcap,
                       sinks=s_aux)
    return out.transpose(1, 2).contiguous(), None


def _ring_mask(*args, local_size=None, use_vmap=False, **kwargs) -> RingMask:
    """transformers' mask-interface function: no [T, T] mask, the layer's pattern in a
    `RingMask` (the ring masks each block itself). `local_size` is the sliding window
    (``create_sliding_window_causal_mask``); an or/and mask function makes transformers
    ask for vmap, ``allow_is_bidirectional_skip`` comes with a bidirectional mask."""
    return RingMask(window=local_size, custom=bool(use_vmap),
                    bidirectional="allow_is_bidirectional_skip" in kwargs)


def apply_cp_hf(model, shard) -> None:
    """Make the transformers model `model` run its attention as the ring over `shard` (a
    `meshfit.parallel.cp.SequenceShard`) and take its tokens' global positions (refused in
    one line where `cp_problem` says so)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    problem = cp_problem(model, shard.size)
    if problem:
        raise ValueError(f"context parallel (cp={shard.size}): {problem}")
    AttentionInterface.register(_IMPLEMENTATION, _ring)
    AttentionMaskInterface.register(_IMPLEMENTATION, _ring_mask)
    # attention layers: transformers gives each the `is_causal` its SDPA/flash paths read
    layers = attention_layers(model)
    if not layers:
        raise ValueError(f"context parallel: found no attention layer in "
                         f"{type(model).__name__}; {WORKS}")
    for layer in layers:
        layer.sequence_shard = shard
    hf_internals.set_attention(model, _IMPLEMENTATION)
    takes_cache = "use_cache" in inspect.signature(model.forward).parameters
    model.register_forward_pre_hook(_placer(shard, takes_cache), with_kwargs=True)


def _placer(shard, takes_cache: bool):
    """The forward pre-hook: the tokens' global positions as position_ids (unless given),
    no key/value cache (a window's cache would drop keys the ring still sends), a padding
    mask refused (one of all ones dropped)."""

    def place(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs["inputs_embeds"]
        mask = kwargs.get("attention_mask")
        if mask is not None:
            if not bool(torch.as_tensor(mask).all()):
                raise ValueError("context parallel: an attention_mask with padding is not "
                                 "available; the ring attends causally over whole sequences: "
                                 "pack or drop padded rows, or use cp=1")
            kwargs["attention_mask"] = None
        if kwargs.get("position_ids") is None:
            kwargs["position_ids"] = shard.positions(ids.shape[1], ids.device).expand(
                ids.shape[0], -1)
        if takes_cache and kwargs.get("use_cache") is None:
            kwargs["use_cache"] = False
        return args, kwargs

    return place
