"""Rows that pack several documents (fine-tuning examples under ``data.packing``, text
documents under ``data.document_mask``) through a transformers model, so that each document
computes what it computes alone: positions restart at 0 where a document begins, and no
token attends across a document's edge.

A transformers model takes that in one of three forms, and which one depends on the
attention implementation it runs, not on the model:

- a 4-D mask ``[B, 1, T, T]`` is handed to every layer as it is (``masking_utils`` returns a
  4-D mask unchanged); SDPA reads a boolean mask (True: attend), but eager attention *adds*
  the mask to the scores, so it takes 0 where a token may attend and a large negative number
  where it may not. A boolean mask given to eager attention adds 1 and 0 and masks nothing,
  not even the future (issue #39).
- flex attention takes a ``BlockMask`` (its own form, which ``masking_utils`` also passes
  through unchanged), built here from the same boolean mask. Its other form, a 4-D tensor
  added to the scores by a ``score_mod`` that indexes it, crashes the process on the CPU in
  torch 2.13 (heap corruption in the compiled kernel, whatever the length), and a block mask
  skips the blocks no token of a query block may see.
- flash attention takes no mask at all: it finds the documents from ``position_ids`` when
  the batch is one row (``_is_packed_sequence``), so the rows are laid end to end.
- a model whose layers see windows (``sliding_window``, ``attention_chunk_size``) shorter
  than the row builds a mask per layer kind, and one 4-D mask would replace them all: it gets
  each kind's mask, window (or chunk) and documents both, as the ``{layer kind: mask}`` dict
  such models take in place of their own (``config.layer_types``: Gemma 2 and 3, gpt-oss,
  Llama 4...), or as the one windowed mask where every layer slides (Mistral, Phi-3). Not
  transformers' packed-sequence path (positions alone): some windowed families (AFMoE) never
  give their masks the positions.

Layers that carry a state along the row (Mamba, linear attention: ``layer_types`` other than
attention) would carry it across documents; `check_packable` refuses them before launch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask

from meshfit._compat import transformers as hf_internals
from meshfit.models.gpt import document_causal_mask

__all__ = ["additive_mask", "check_packable", "packed_forward"]

ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
"""``config.layer_types`` entries whose layers only attend (a mask keeps documents apart)."""
WINDOWS = ("sliding_window", "attention_chunk_size")
"""Config fields of layers that attend within a window of the row."""
ADDITIVE = frozenset({"eager"})
"""Implementations that add a 4-D tensor mask to the attention scores."""
BOOLEAN = frozenset({"sdpa"})
"""Implementations that read a boolean 4-D mask (True: attend)."""
BLOCK = frozenset({"flex_attention"})
"""Implementations that take a flex attention ``BlockMask``."""


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


def _window(config, name: str, length: int) -> int | None:
    """The config's window `name` when some layer attends within fewer than `length` tokens."""
    w = getattr(config, name, None)
    return w if isinstance(w, int) and not isinstance(w, bool) and 0 < w < length else None


def _masks(model: nn.Module, positions: torch.Tensor, form_of: str):
    """The mask of each layer kind the model runs, for rows of documents (`positions`), in
    the form its implementation takes (`form_of`: "boolean", "additive" or "block"): one
    mask, or {layer kind: mask} for a model with windowed and full layers."""
    config = _text_config(model)
    length = positions.shape[-1]
    window = _window(config, "sliding_window", length)
    chunk = _window(config, "attention_chunk_size", length)
    # [B, 1, T, T]: same document, not ahead (the block form reads the positions instead)
    allowed = None if form_of == "block" else document_causal_mask(positions)

    def form(kind: str):
        if form_of == "block":
            return block_mask(positions, window if kind == "sliding_attention" else None,
                              chunk if kind == "chunked_attention" else None)
        mask = allowed
        if kind == "sliding_attention" and window:  # transformers': kv > q - window
            index = torch.arange(length, device=positions.device)
            mask = mask & (index[:, None] - index[None, :] < window)
        if kind == "chunked_attention" and chunk:  # chunks count from the document's start
            part = positions // chunk
            mask = mask & (part[:, None, :, None] == part[:, None, None, :])
        return additive_mask(mask) if form_of == "additive" else mask

    if not (window or chunk):
        return form("full_attention")
    kinds = getattr(config, "layer_types", None)
    if kinds:
        return {kind: form(kind) for kind in sorted(set(kinds))}
    return form("sliding_attention" if window else "chunked_attention")


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
    if name is not None and not (_flash(name) or name in ADDITIVE | BOOLEAN | BLOCK):
        raise ValueError(f"{field}: it runs the attention implementation {name!r}, whose mask "
                         "form meshfit does not know, so packed documents could attend to each "
                         "other; use attn_implementation 'sdpa', 'eager', 'flex_attention' or "
                         "a flash one in its config.json, or data.packing / "
                         "data.document_mask = false")


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The mask an implementation that adds its mask to the scores takes, from a boolean one
    (True: attend): 0 where a token attends, the dtype's lowest value elsewhere (as
    transformers' own eager masks: finite, so no row can turn into NaN)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(dtype).min)


def block_mask(positions: torch.Tensor, window: int | None = None,
               chunk: int | None = None):
    """Flex attention's ``BlockMask`` for rows of documents (`positions`): causal within a
    document, and within `window` tokens back or the same `chunk` of the document where
    given, as `_masks`' tensors. Its ``mask_mod`` reads a [B, T] document index (as
    transformers' own packed-sequence mask does), not the [B, 1, T, T] mask: torch 2.13's
    CPU kernel fails to compile a mask_mod indexing a 4-D tensor for some head sizes."""
    rows, length = positions.shape
    document = torch.cumsum(positions == 0, dim=1)
    part = positions // chunk if chunk else None

    def allowed(b, h, q, kv):
        keep = (kv <= q) & (document[b, q] == document[b, kv])
        if window:
            keep = keep & (q - kv < window)
        if part is not None:
            keep = keep & (part[b, q] == part[b, kv])
        return keep

    return create_block_mask(allowed, rows, None, length, length,
                             device=positions.device.type)


def packed_forward(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor | None,
                   **kwargs: Any) -> Any:
    """``model(input_ids=..., **kwargs)`` of a transformers model (under LoRA adapters and
    data-parallel wrappers too), with rows packing several documents when `positions` is
    given ([B, T], 0 where each document begins): the documents kept apart in the form the
    model's attention implementation takes (module docstring). The output's ``logits`` are
    [B, T, V] whatever the form. No cache (rows are trained or scored whole; with a cache
    transformers would not read the positions as documents on the flash path)."""
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
    mask = _masks(model, positions, "boolean" if name in BOOLEAN else
                  "block" if name in BLOCK else "additive")
    return model(input_ids=input_ids, position_ids=positions, attention_mask=mask, **kwargs)
