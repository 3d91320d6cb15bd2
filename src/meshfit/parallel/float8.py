"""float8 training of a model's linear layers through torchao's float8 conversion.

    apply_float8(model, recipe="rowwise", device=device)

Every ``nn.Linear`` whose two dimensions are multiples of 16 (what the float8 matrix-product
kernel takes) becomes torchao's ``Float8Linear``: its inputs, weights and output gradients are
scaled and cast to float8 for the three matrix products of a step, while the parameters, the
optimizer and every other operation keep their precision. The output projection (the head
that produces the logits) keeps its precision, as in torchtitan: the logits are the most
sensitive product, and the chunked cross-entropy fuses it with the loss. The parameters keep
their names, so checkpoints move freely between float8 and other runs.

Recipes are torchao's: "tensorwise" (one scale per tensor), "rowwise" (one per row, with
power-of-two scales; the default, as torchtitan and Accelerate recommend for accuracy) and
"rowwise_with_gw_hp" (rowwise, with the weight gradient computed in high precision).

The hardware kernels need an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper,
Blackwell); anywhere else the conversion is refused in one line. ``emulate=True`` runs
torchao's emulation (float8 casts and scaling, the products in high precision) on any
device; it checks the conversion and its numerics, not its speed.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import torch
from torch import nn

from meshfit._quiet import quiet_logs
from meshfit._torchao import torchao_error
from meshfit.parallel.options import FLOAT8_RECIPES

__all__ = ["FLOAT8_RECIPES", "apply_float8", "check_float8_device", "float8_filter"]

_MULTIPLE = 16  # torch._scaled_mm needs both dimensions of the weight in multiples of 16


def check_float8_device(device: torch.device | str, field: str = "float8") -> None:
    """One-line ValueError where `device` cannot run float8 matrix products."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"{field}=True needs an NVIDIA GPU of compute capability 8.9 or newer "
                         f"(H100, H200, L4, RTX 4090, B200); this run's device is {device.type}"
                         f"; set {field}=False")
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(index)
        raise ValueError(f"{field}=True needs compute capability 8.9 or newer; {name} has "
                         f"{major}.{minor}; set {field}=False (bf16 is the fastest precision "
                         "this GPU runs)")


def _heads(model: nn.Module) -> set[int]:
    """The ids of the model's output projections (kept in their precision)."""
    heads = set()
    getter = getattr(model, "get_output_embeddings", None)
    if callable(getter):
        try:
            head = getter()
        except (NotImplementedError, AttributeError):
            head = None
        if isinstance(head, nn.Module):
            heads.add(id(head))
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in ("lm_head", "output"):
            heads.add(id(module))
    return heads


def float8_filter(model: nn.Module):
    """The module filter of `apply_float8`: a plain ``nn.Linear`` with both dimensions in
    multiples of 16, not the output projection."""
    heads = _heads(model)

    def keep(module: nn.Module, name: str) -> bool:
        if not isinstance(module, nn.Linear) or id(module) in heads:
            return False
        return module.in_features % _MULTIPLE == 0 and module.out_features % _MULTIPLE == 0

    return keep


def apply_float8(model: nn.Module, recipe: str = "rowwise", *,
                 device: torch.device | str | None = None, emulate: bool = False) -> int:
    """Convert `model`'s eligible linear layers to float8 training in place; returns how
    many were converted. Refused in one line where `device` cannot run float8 (unless
    `emulate`), where torchao is missing, or where no layer qualifies."""
    if recipe not in FLOAT8_RECIPES:
        raise ValueError(f"float8_recipe={recipe!r} is not one of {', '.join(FLOAT8_RECIPES)}")
    if not emulate:
        check_float8_device(device if device is not None else "cpu")
    if importlib.util.find_spec("torchao") is None:
        raise ValueError("float8=True needs torchao (pip install torchao, or meshfit[optim]); "
                         "or set float8=False")
    try:
        with quiet_logs():  # torchao's notes on extensions it cannot load here
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as err:  # installed, but a release made for another torch
        raise torchao_error("float8=True", err) from None
    keep = float8_filter(model)
    count = sum(keep(m, n) for n, m in model.named_modules())
    if count == 0:
        raise ValueError("float8=True: the model has no nn.Linear with both dimensions in "
                         f"multiples of {_MULTIPLE} (the output head is never converted); set "
                         "float8=False")
    config = Float8LinearConfig.from_recipe_name(recipe)
    if emulate:
        config = _with_emulation(config)
    convert_to_float8_training(model, module_filter_fn=keep, config=config)
    return count


def _with_emulation(config):
    """A copy of torchao's frozen config with ``emulate=True``."""
    return dataclasses.replace(config, emulate=True)
