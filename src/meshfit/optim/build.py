"""`build`: an optimizer by name over a model's weight-decay groups or the user's params."""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from meshfit._compat import optim as optim_internals
from meshfit.optim.groups import flat_params as _flat_params
from meshfit.optim.groups import param_groups
from meshfit.optim.groups import trainable as _trainable
from meshfit.optim.muon import build_muon, split_groups
from meshfit.optim.states import AdamWBf16States, quantized_adamw
from meshfit.optim_names import OPTIMIZERS

__all__ = ["build"]


def build(name: str, model_or_params: nn.Module | Iterable[Any], *, lr: float,
          weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999),
          eps: float = 1e-8, momentum: float = 0.9, no_decay: Iterable[str] | None = None,
          **kwargs: Any) -> torch.optim.Optimizer:
    """A ready optimizer `name` (one of `OPTIMIZERS`) over the trainable parameters.

    An `nn.Module` is split by `param_groups` (with `no_decay`). An iterable of parameters or of
    param groups is used as given, minus frozen parameters: `weight_decay` is then the default
    for every group that does not set its own. Which hyperparameters apply:

        adamw, adamw_fused, adamw_8bit   lr, weight_decay (decoupled), betas, eps
        adamw_bf16_states, adamw_4bit    lr, weight_decay (decoupled), betas, eps
        adafactor                        lr (the cap on the relative step size rho_t),
                                         weight_decay (decoupled), eps -> eps1, the floor of
                                         the RMS denominator (a 2-tuple is passed whole);
                                         betas and momentum do not apply: Adafactor keeps no
                                         first moment and decays its second moment by
                                         1 - t^beta2_decay (pass beta2_decay= to change it)
        sgd                              lr, weight_decay (L2, added to the gradient),
                                         momentum
        muon                             Muon (`meshfit.optim.muon`) on the matrices:
                                         muon_lr (0.02), muon_momentum (0.95),
                                         weight_decay; AdamW on the rest (embeddings,
                                         head, norms, biases, names in muon_exclude): lr,
                                         weight_decay, betas, eps

    `kwargs` go to the optimizer's constructor and override the values chosen here (e.g.
    block_size= for torchao, nesterov= for SGD).
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer={name!r} is not one of {', '.join(OPTIMIZERS)}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (math.isfinite(lr)
                                                                         and lr > 0):
        raise ValueError(f"lr={lr!r} must be a positive finite number, e.g. lr=3e-4")
    if (isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float))
            or not (math.isfinite(weight_decay) and weight_decay >= 0)):
        raise ValueError(f"weight_decay={weight_decay!r} must be a finite number >= 0 (0 "
                         "disables it)")
    if isinstance(model_or_params, torch.Tensor):
        model_or_params = [model_or_params]
    if isinstance(model_or_params, nn.Module):
        groups: list[Any] = param_groups(model_or_params, weight_decay, no_decay)
        if name == "muon":  # the Muon/AdamW split needs the names: embeddings, head, exclude
            groups = split_groups(groups, model_or_params, exclude=kwargs.get("muon_exclude", ()))
    else:
        if no_decay:
            raise ValueError(f"no_decay={no_decay!r} needs parameter names: pass the nn.Module, "
                             "not its parameters")
        groups = _trainable(model_or_params)
    if not groups:
        raise ValueError(f"optimizer={name!r} got no trainable parameters (all have "
                         "requires_grad=False); unfreeze some before building it")
    return _BUILDERS[name](groups, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps,
                           momentum=momentum, **kwargs)


def _adamw(groups, *, lr, weight_decay, betas, eps, momentum, **kwargs):
    return torch.optim.AdamW(groups, **{"lr": lr, "betas": betas, "eps": eps,
                                        "weight_decay": weight_decay, "foreach": True, **kwargs})


def _adamw_fused(groups, *, lr, weight_decay, betas, eps, momentum, **kwargs):
    supported = optim_internals.fused_devices()
    for p in _flat_params(groups):
        if p.device.type not in supported or not p.is_floating_point():
            raise ValueError(
                f"optimizer='adamw_fused' needs floating-point parameters on one of "
                f"{', '.join(supported)}; got {p.dtype} on {p.device}; use optimizer='adamw'")
    return torch.optim.AdamW(groups, **{"lr": lr, "betas": betas, "eps": eps,
                                        "weight_decay": weight_decay, "fused": True, **kwargs})


def _adafactor(groups, *, lr, weight_decay, betas, eps, momentum, **kwargs):
    # eps2 (1e-3, torch's default) floors the parameter RMS that scales each relative step.
    eps_pair = tuple(eps) if isinstance(eps, (tuple, list)) else (eps, 1e-3)
    return torch.optim.Adafactor(groups, **{"lr": lr, "eps": eps_pair,
                                            "weight_decay": weight_decay, **kwargs})


def _sgd(groups, *, lr, weight_decay, betas, eps, momentum, **kwargs):
    return torch.optim.SGD(groups, **{"lr": lr, "momentum": momentum,
                                      "weight_decay": weight_decay, **kwargs})


def _adamw_8bit(groups, *, lr, weight_decay, betas, eps, momentum, **kwargs):
    args = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, **kwargs}
    on_cuda = all(p.device.type == "cuda" for p in _flat_params(groups))
    # bitsandbytes has the CUDA kernels; torchao's torch.compile'd step runs on any device.
    if on_cuda and importlib.util.find_spec("bitsandbytes") is not None:
        import bitsandbytes as bnb
        return bnb.optim.AdamW8bit(groups, **args)
    return quantized_adamw(8, groups, **args)  # torchao's: compiles its step on first use


def _adamw_4bit(groups, *, lr, weight_decay, betas, eps, momentum, **kwargs):
    return quantized_adamw(4, groups, **{"lr": lr, "betas": betas, "eps": eps,
                                         "weight_decay": weight_decay, **kwargs})


def _adamw_bf16_states(groups, *, lr, weight_decay, betas, eps, momentum, **kwargs):
    return AdamWBf16States(groups, **{"lr": lr, "betas": betas, "eps": eps,
                                      "weight_decay": weight_decay, **kwargs})


# One builder per name of OptimizerName, in its order.
_BUILDERS = {"adamw": _adamw, "adamw_fused": _adamw_fused, "adafactor": _adafactor,
             "adamw_8bit": _adamw_8bit, "sgd": _sgd,
             "muon": build_muon,
             "adamw_bf16_states": _adamw_bf16_states, "adamw_4bit": _adamw_4bit}

