"""Rows that pack several documents (fine-tuning examples under ``data.packing``, text
documents under ``data.document_mask``) through a transformers model, so that each document
computes what it computes alone: positions restart at 0 where a document begins, and no
token attends across a document's edge.

A transformers model takes that in one of three forms, and which one depends on the
attention implementation it runs, not on the model:

- a 4-D mask ``[B, 1, T, T]`` is handed to every layer as it is (``masking_utils`` returns a
  4-D mask unchanged); SDPA reads a boolean mask (True: attend), but eager attention (and
  flex attention's tensor path) *adds* the mask to the scores, so it takes 0 where a token
  may attend and a large negative number where it may not. A boolean mask given to eager
  attention adds 1 and 0 and masks nothing, not even the future (issue #39).
- flash attention takes no mask at all: it finds the documents from ``position_ids`` when
  the batch is one row (``_is_packed_sequence``), so the rows are laid end to end.
- a model whose layers see windows (``sliding_window``, ``attention_chunk_size``) shorter
  than the row builds a different mask per layer kind; one 4-D mask would replace all of
  them. Those models get no mask and the positions: transformers' own packed-sequence path
  (``find_packed_sequence_indices``) then builds each kind's mask, window and documents both,
  in the form its implementation takes. (Every transformers family with windowed layers
  passes ``position_ids`` to its mask; families that do not, such as OPT and Bloom, have no
  windows and take the 4-D mask.)

Layers that carry a state along the row (Mamba, linear attention: ``layer_types`` other than
attention) would carry it across documents; `check_packable` refuses them before launch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from meshfit._compat import transformers as hf_internals
from meshfit.models.gpt import document_causal_mask

__all__ = ["additive_mask", "check_packable", "packed_forward"]

ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
"""``config.layer_types`` entries whose layers only attend (a mask keeps documents apart)."""
WINDOWS = ("sliding_window", "attention_chunk_size")
"""Config fields of layers that attend within a window of the row."""
ADDITIVE = frozenset({"eager", "flex_attention"})
"""Implementations that add a 4-D tensor mask to the attention scores."""
BOOLEAN = frozenset({"sdpa"})
"""Implementations that read a boolean 4-D mask (True: attend)."""


def _flash(name: str | None) -> bool:
    """transformers' flash implementations ("flash_attention_2/3/4", kernels such as
    "kernels-community/vllm-flash-attn3"), as ``is_flash_attention_requested`` tells them."""
    return name is not None and "flash" in name


def _inner(model: nn.Module) -> nn.Module:
    """The transformers model inside data-parallel wrappers (DDP's ``.module``); LoRA's
    PeftModel and FSDP2's sharded model answer ``.config`` themselves."""
    while not hasattr(model, "config") and isinstance(getattr(model, "module", None),
                                                        nn.Module):
        model = model.module
    return model


def _text_config(model: nn.Module):
    config = getattr(_inner(model), "config", None)
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def _windowed(model: nn.Module, length: int) -> bool:
    """Whether some layer of `model` attends within a window shorter than `length`."""
    config = _text_config(model)
    return any(isinstance(w, int) and not isinstance(w, bool) and 0 < w < length
               for w in (getattr(config, name, None) for name in WINDOWS))


def check_packable(model: nn.Module, field: str) -> None:
    """Before launch: a one-line ValueError naming `field` when `model` (a transformers model)
    cannot keep packed documents apart: layers that carry a state along the row, or an
    attention implementation whose mask form is unknown here."""
    config = _text_config(model)
    kinds = getattr(config, "layer_types", None) or ()
    other = sorted({k for k in kinds if k not in ATTENTION_LAYERS})
    if other:
        raise ValueError(f"{field}: its layers of type {', '.join(other)} carry a state along "
                         "the row, across the documents data.packing / data.document_mask put "
                         "in it; set both to false for this model")
    name = hf_internals.attention_implementation(_inner(model))
    if name is not None and not (_flash(name) or name in ADDITIVE | BOOLEAN):
        raise ValueError(f"{field}: it runs the attention implementation {name!r}, whose mask "
                         "form meshfit does not know, so packed documents could attend to each "
                         "other; use attn_implementation 'sdpa', 'eager', 'flex_attention' or "
                         "a flash one in its config.json, or data.packing / "
                         "data.document_mask = false")


def additive_mask(positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The [B, 1, T, T] mask an implementation that adds its mask to the scores takes: 0
    where a token attends (its own document, up to itself), the dtype's lowest value elsewhere
    (as transformers' own eager masks: finite, so no row can turn into NaN)."""
    allowed = document_causal_mask(positions)
    return torch.zeros(allowed.shape, dtype=dtype, device=positions.device).masked_fill(
        ~allowed, torch.finfo(dtype).min)


def packed_forward(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor | None,
                   **kwargs: Any) -> Any:
    """``model(input_ids=..., **kwargs)`` of a transformers model (under LoRA adapters and
    data-parallel wrappers too), with rows packing several documents when `positions` is
    given ([B, T], 0 where each document begins): the documents kept apart in the form the
    model's attention implementation takes (module docstring). The output's ``logits`` are
    [B, T, V] whatever the form. No cache: a cache would stop transformers reading the
    positions as documents."""
    if positions is None:
        return model(input_ids=input_ids, **kwargs)
    kwargs["use_cache"] = False
    name = hf_internals.attention_implementation(_inner(model))
    rows, length = input_ids.shape
    if _flash(name):  # one row, the documents found from the positions (varlen kernels)
        out = model(input_ids=input_ids.reshape(1, -1), position_ids=positions.reshape(1, -1),
                    **kwargs)
        out.logits = out.logits.reshape(rows, length, -1)
        return out
    if _windowed(model, length):  # transformers builds each layer kind's mask itself
        return model(input_ids=input_ids, position_ids=positions, **kwargs)
    mask = document_causal_mask(positions) if name in BOOLEAN else additive_mask(positions)
    return model(input_ids=input_ids, position_ids=positions, attention_mask=mask, **kwargs)
