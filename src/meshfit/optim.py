"""Optimizers by name, with weight-decay parameter groups and a measured state-size report.

    optimizer = build("adamw_fused", model, lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95))
    print(format_report({"adamw_fused": state_bytes(optimizer)}))   # after a step

Build the optimizer after the model is parallelised (torchtitan's order): the parameters it
is given are then the sharded DTensors and the fused kernel can check their device.

Optimizer state per trainable parameter element (fp32 parameters), as `state_bytes`
measures it on a live optimizer:

    adamw, adamw_fused  8 B      exp_avg + exp_avg_sq in fp32 (Loshchilov & Hutter 2019).
                                 `adamw` uses the foreach kernels, `adamw_fused` the fused one
                                 (fastest on CPU and GPU; measured on CPU with torch 2.13:
                                 29 ms per step vs 135 foreach, 189 loop, 33.5M parameters).
    adamw_8bit          ~2 B     both moments as uint8 codes with one fp32 scale per block of
                                 256 (+4/256 B per moment) and 256-entry fp32 lookup tables
                                 (Dettmers et al. 2022, "8-bit Optimizers via Block-wise
                                 Quantization"). Only tensors of >= 4096 elements are quantized
                                 (torchao: also a multiple of its block_size); smaller ones
                                 (biases, norms) keep 8 B fp32 state. bitsandbytes on CUDA
                                 (tables shared by all parameters: 2.03 B/param on matrices),
                                 torchao elsewhere (2 KiB of tables per matrix: 2.09 B/param on
                                 the tiny GPT's). torchao compiles its step per parameter shape
                                 on first use and keeps lr as a tensor, which torch's
                                 LRScheduler fills in place.
    adafactor           ~(r+c)*4 per r x c matrix: a factored second moment, one row and one
                                 column vector, and no first moment (Shazeer & Stern 2018);
                                 4 B for vectors. torch.optim.Adafactor.
    sgd                 4 B      the momentum buffer (none with momentum=0).

AdamW, Adafactor and torchao also keep a scalar `step` tensor per parameter tensor (4 B, not
per element); bitsandbytes keeps a Python int, SGD none.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from meshfit._compat import nn as nn_internals
from meshfit._compat import optim as optim_internals
from meshfit._quiet import quiet_logs
from meshfit._torchao import torchao_error
from meshfit.distributed.tensors import local_tensor, storage_bytes
from meshfit.optim_names import OPTIMIZERS, OptimizerName

__all__ = ["OPTIMIZERS", "OptimizerName", "StateReport", "build", "format_report", "param_groups",
           "state_bytes"]

# Normalisation layers by type; modules whose class name ends in "Norm" (LlamaRMSNorm,
# T5LayerNorm, ...) count too, as Hugging Face's ALL_LAYERNORM_LAYERS list intends.
_NORM_TYPES = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.LocalResponseNorm,
               *nn_internals.NORM_BASES)


# ---------------------------------------------------------------- parameter groups
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


def _trainable(params: Iterable[Any]) -> list[Any]:
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


def _flat_params(groups: list[Any]) -> list[torch.Tensor]:
    out = []
    for item in groups:
        items = _as_list(item["params"]) if isinstance(item, dict) else [item]
        out.extend(_tensor(p) for p in items)
    return out


# ---------------------------------------------------------------- build
def build(name: str, model_or_params: nn.Module | Iterable[Any], *, lr: float,
          weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999),
          eps: float = 1e-8, momentum: float = 0.9, no_decay: Iterable[str] | None = None,
          **kwargs: Any) -> torch.optim.Optimizer:
    """A ready optimizer `name` (one of `OPTIMIZERS`) over the trainable parameters.

    An `nn.Module` is split by `param_groups` (with `no_decay`). An iterable of parameters or of
    param groups is used as given, minus frozen parameters: `weight_decay` is then the default
    for every group that does not set its own. Which hyperparameters apply:

        adamw, adamw_fused, adamw_8bit   lr, weight_decay (decoupled), betas, eps
        adafactor                        lr (the cap on the relative step size rho_t),
                                         weight_decay (decoupled), eps -> eps1, the floor of
                                         the RMS denominator (a 2-tuple is passed whole);
                                         betas and momentum do not apply: Adafactor keeps no
                                         first moment and decays its second moment by
                                         1 - t^beta2_decay (pass beta2_decay= to change it)
        sgd                              lr, weight_decay (L2, added to the gradient),
                                         momentum

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
    if importlib.util.find_spec("torchao") is None:
        raise ValueError("optimizer='adamw_8bit' needs torchao (or bitsandbytes on CUDA); "
                         'pip install "meshfit[optim]"')
    try:
        with quiet_logs():
            from torchao.optim import AdamW8bit  # first step compiles (~50 s cold on a CPU)
    except ImportError as err:  # installed, but a release made for another torch
        raise torchao_error("optimizer='adamw_8bit'", err) from None
    return AdamW8bit(groups, **args)


# One builder per name of OptimizerName, in its order.
_BUILDERS = {"adamw": _adamw, "adamw_fused": _adamw_fused, "adafactor": _adafactor,
             "adamw_8bit": _adamw_8bit, "sgd": _sgd}


# ---------------------------------------------------------------- state report
@dataclass(frozen=True, kw_only=True)
class StateReport:
    """Bytes of optimizer state, measured on a live optimizer (see `state_bytes`)."""

    total_bytes: int
    """All state tensors, each storage once (a shared lookup table counts once)."""
    num_params: int
    """Parameter elements the optimizer holds (local shards for DTensors)."""
    matrix_bytes: int
    """State of parameters with ndim >= 2."""
    matrix_params: int
    """Elements of parameters with ndim >= 2."""

    @property
    def other_bytes(self) -> int:
        """State of 1-D and 0-D parameters (biases, norm weights)."""
        return self.total_bytes - self.matrix_bytes

    @property
    def other_params(self) -> int:
        return self.num_params - self.matrix_params

    @property
    def bytes_per_param(self) -> float:
        return _ratio(self.total_bytes, self.num_params)

    @property
    def matrix_bytes_per_param(self) -> float:
        return _ratio(self.matrix_bytes, self.matrix_params)

    @property
    def other_bytes_per_param(self) -> float:
        return _ratio(self.other_bytes, self.other_params)


def _ratio(num: int, den: int) -> float:
    return num / den if den else 0.0


def state_bytes(optimizer: torch.optim.Optimizer) -> StateReport:
    """Measure `optimizer.state`: bytes of every tensor it holds, per parameter kind, each
    storage once (`meshfit.distributed.tensors.storage_bytes`: a lookup table shared by all
    of bitsandbytes' states counts once). Scalar `step` tensors count; Python numbers in the
    state do not (they are not tensor memory). State is created lazily by most optimizers:
    measure after the first step."""
    seen_storage: set[tuple[str, int]] = set()
    seen_params: set[int] = set()
    total = matrix = n_params = n_matrix = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in seen_params:
                continue
            seen_params.add(id(p))
            numel = local_tensor(p).numel()
            nbytes = storage_bytes(optimizer.state.get(p, {}), seen_storage)
            total, n_params = total + nbytes, n_params + numel
            if p.ndim >= 2:
                matrix, n_matrix = matrix + nbytes, n_matrix + numel
    return StateReport(total_bytes=total, num_params=n_params, matrix_bytes=matrix,
                       matrix_params=n_matrix)


def format_report(reports: dict[str, StateReport]) -> str:
    """A small fixed-width table: one row per optimizer, bytes/param overall and split."""
    header = ("optimizer", "params", "state MiB", "B/param", "matrix B/param", "other B/param")
    rows = [header] + [
        (name, f"{r.num_params:,}", f"{r.total_bytes / 2**20:.3f}", f"{r.bytes_per_param:.3f}",
         f"{r.matrix_bytes_per_param:.3f}", f"{r.other_bytes_per_param:.3f}")
        for name, r in reports.items()]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                       enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
