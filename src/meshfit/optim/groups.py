"""Weight-decay parameter groups and the trainable-parameter filters every builder uses."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from meshfit._compat import nn as nn_internals

__all__ = ["flat_params", "param_groups", "trainable"]

# Normalisation layers by type; modules whose class name ends in "Norm" (LlamaRMSNorm,
# T5LayerNorm, ...) count too, as Hugging Face's ALL_LAYERNORM_LAYERS list intends.
_NORM_TYPES = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.LocalResponseNorm,
               *nn_internals.NORM_BASES)


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, _NORM_TYPES) or type(module).__name__.endswith("Norm")


def param_groups(model: nn.Module, weight_decay: float,
                 no_decay: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """Two groups of the trainable parameters: decayed and not.

    Weight decay goes on weights of ndim >= 2 (linears, embeddings, convolutions); none on
    biases, on any parameter of a normalisation layer, on other 1-D (or 0-D) parameters, and
    on parameters whose full name contains one of the `no_decay` substrings. This is the
    Hugging Face single-GPU guide's grouping (`get_parameter_names(model, [nn.LayerNorm])`,
    then drop "bias"), widened to every norm type and to 1-D tensors, which GPT-2 and Llama
    never decay either. A tied weight is placed once, under its first name. Frozen
    parameters (requires_grad False) are left out, so they hold no optimizer state. Empty
    groups are omitted; each group is {"params": [...], "weight_decay": float}.
    """
    extra = (no_decay,) if isinstance(no_decay, str) else tuple(no_decay or ())
    decay, plain, seen = [], [], set()
    for mod_name, module in model.named_modules():
        for p_name, p in module.named_parameters(recurse=False):
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            name = f"{mod_name}.{p_name}" if mod_name else p_name
            skip = (p.ndim < 2 or p_name == "bias" or _is_norm(module)
                    or any(s in name for s in extra))
            (plain if skip else decay).append(p)
    groups = [{"params": decay, "weight_decay": float(weight_decay)},
              {"params": plain, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def trainable(params: Iterable[Any]) -> list[Any]:
    """Keep trainable entries of an iterable of tensors, (name, tensor) pairs or groups."""
    out = []
    for item in params:
        if isinstance(item, dict):
            kept = [p for p in _as_list(item["params"]) if _tensor(p).requires_grad]
            if kept:
                out.append({**item, "params": kept})
        elif _tensor(item).requires_grad:
            out.append(item)
    return out


def _as_list(params: Any) -> list[Any]:
    return [params] if isinstance(params, torch.Tensor) else list(params)


def _tensor(item: Any) -> torch.Tensor:
    return item[1] if isinstance(item, tuple) else item


def flat_params(groups: list[Any]) -> list[torch.Tensor]:
    out = []
    for item in groups:
        items = _as_list(item["params"]) if isinstance(item, dict) else [item]
        out.extend(_tensor(p) for p in items)
    return out


