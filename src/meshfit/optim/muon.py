"""Muon for the blocks' weight matrices, AdamW for the rest, on every layout.

Muon (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks";
Liu et al. 2025, "Muon is Scalable for LLM Training") keeps one momentum buffer per matrix
and steps along the orthogonalised momentum, computed by a quintic Newton-Schulz iteration
on the whole matrix. `Muon` here is `torch.optim.Muon`'s algorithm, step for step (the same
iteration in bfloat16, the same Nesterov momentum, decoupled weight decay and learning-rate
adjustment), extended to what torch's refuses:

- DTensor parameters (ZeRO-2/3 under FSDP2, tensor parallelism): each matrix is made whole
  for its iteration, by an owner rank or by all ranks (`meshfit.optim.muon_whole`), and
  every rank keeps its own part of the result: the same numbers as one process.
- 3-D parameters (a mixture of experts' stacked expert weights, ``(experts, out, in)``): one
  matrix per expert, each with its own learning-rate adjustment from its 2-D shape.
- Groups with ``use_muon=False``: stepped by AdamW (torch's functional `adam` with
  decoupled weight decay, as `torch.optim.AdamW` steps), so one optimizer object carries the
  usual split (Muon for hidden matrices; embeddings, head, norms and biases on AdamW) through
  schedulers, ZeRO-1's ZeroRedundancyOptimizer, checkpoints and `meshfit.optim.state_bytes`.

State: ``momentum_buffer`` (the parameter's shape and dtype: 4 B/element for fp32) on Muon
parameters, AdamW's ``step``, ``exp_avg`` and ``exp_avg_sq`` (8 B/element) on the others.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.optim.adam import adam

from meshfit.distributed.tensors import local_tensor
from meshfit.optim.muon_whole import WHOLE, orthogonalize

__all__ = ["BUCKET_ELEMENTS", "Muon", "build_muon", "buckets", "check_muon_param",
           "newton_schulz", "sharded_class", "split_groups"]

# Keller Jordan's coefficients and defaults, as torch.optim.Muon has them
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
ADJUST_LR = (None, "original", "match_rms_adamw")
BUCKET_ELEMENTS = 2**25
"""Local matrix elements a Muon step holds updates and whole-matrix buffers for at once
(128 MiB of fp32 updates): enough matrices for the owner strategy to keep every rank of a
group busy, not the whole model's (`meshfit.memory.estimate` counts one bucket)."""


def newton_schulz(g: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                  eps: float) -> torch.Tensor:
    """The orthogonalised `g` (2-D; 3-D: each ``g[i]``), the quintic iteration exactly as
    torch.optim.Muon computes it (bfloat16, transposed when tall, Frobenius-normalised)."""
    if g.ndim == 3:
        return torch.stack([newton_schulz(m, coefficients, steps, eps) for m in g]) \
            if len(g) else g.bfloat16()
    a, b, c = coefficients
    x = g.to(torch.bfloat16, copy=True)  # a copy even of a bf16 `g` (the momentum itself
    #                                      without Nesterov): the iteration works in place
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: tuple[int, ...]) -> float:
    """torch.optim.Muon's learning-rate adjustment for an ``A x B`` matrix (a 3-D tensor:
    its ``shape[1:]``, one expert's): sqrt(max(1, A/B)) ("original", Jordan) or
    0.2 sqrt(max(A, B)) ("match_rms_adamw", Liu et al.: AdamW's lr and weight decay
    carry over)."""
    a, b = shape[-2:]
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(a, b))
    return lr * math.sqrt(max(1, a / b))


class Muon(torch.optim.Optimizer):
    """Muon on the groups with ``use_muon`` True (the default), AdamW on the others.

    The constructor takes torch.optim.Muon's arguments (a torch.optim.Muon's ``defaults``
    rebuild this one: `meshfit.accelerator` does so under ZeRO/TP) and AdamW's ``betas`` and
    ``adam_eps`` for the AdamW groups (a group may set its own ``eps``, ``betas``, ``lr``).
    `whole`: how a sharded matrix is made whole, "owner" or "gather"
    (`meshfit.optim.muon_whole`)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, weight_decay: float = 0.1,
                 momentum: float = 0.95, nesterov: bool = True,
                 ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                 eps: float = 1e-7, ns_steps: int = 5, adjust_lr_fn: str | None = None,
                 betas: tuple[float, float] = (0.9, 0.999), adam_eps: float = 1e-8,
                 whole: str = "owner") -> None:
        _check_args(lr=lr, weight_decay=weight_decay, momentum=momentum, ns_steps=ns_steps,
                    adjust_lr_fn=adjust_lr_fn, whole=whole)
        defaults = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum,
                    "nesterov": nesterov, "ns_coefficients": tuple(ns_coefficients),
                    "eps": eps, "ns_steps": ns_steps, "adjust_lr_fn": adjust_lr_fn,
                    "betas": tuple(betas), "adam_eps": adam_eps, "whole": whole}
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        param_group.setdefault("use_muon", True)
        super().add_param_group(param_group)
        if param_group["use_muon"]:
            for i, p in enumerate(param_group["params"]):
                check_muon_param(p, f"param_groups[{len(self.param_groups) - 1}]"
                                    f"['params'][{i}]")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            (self._muon_step if group["use_muon"] else self._adamw_step)(group)
        return loss

    def _muon_step(self, group: dict[str, Any]) -> None:
        """Momentum, then Newton-Schulz and the update, one bucket of matrices at a time
        (`buckets`: the updates and the whole-matrix buffers of one bucket are held at
        once, not the whole model's)."""
        coefficients, steps, eps = group["ns_coefficients"], group["ns_steps"], group["eps"]
        lr, load = group["lr"], {}
        for bucket in buckets([p for p in group["params"] if p.grad is not None]):
            updates = [self._nesterov(p, group["momentum"], group["nesterov"]) for p in bucket]
            whole = orthogonalize(updates, lambda g: newton_schulz(g, coefficients, steps, eps),
                                  group["whole"], load)
            del updates
            for p, update in zip(bucket, whole):
                local = local_tensor(p)
                local.mul_(1 - lr * group["weight_decay"])
                local.add_(update, alpha=-adjusted_lr(lr, group["adjust_lr_fn"],
                                                      tuple(p.shape)))

    def _nesterov(self, p: torch.Tensor, momentum: float, nesterov: bool) -> torch.Tensor:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad)
        buf = state["momentum_buffer"]
        buf.lerp_(p.grad, 1 - momentum)
        return p.grad.lerp(buf, momentum) if nesterov else buf

    def _adamw_step(self, group: dict[str, Any]) -> None:
        params, grads, avgs, sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:  # as torch.optim.AdamW initialises it
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            avgs.append(state["exp_avg"])
            sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        beta1, beta2 = group["betas"]
        adam(params, grads, avgs, sqs, [], steps, decoupled_weight_decay=True, amsgrad=False,
             beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
             eps=group["adam_eps"], maximize=False)


def buckets(params: list[torch.Tensor], budget: int | None = None
            ) -> list[list[torch.Tensor]]:
    """Consecutive runs of `params` holding at most `budget` local elements each (a larger
    matrix alone): what one round of `orthogonalize` holds at once. Every rank cuts the same
    runs (local sizes differ by at most a shard's padding; the cut uses the whole shapes
    divided evenly, the same number everywhere)."""
    budget = BUCKET_ELEMENTS if budget is None else budget
    out: list[list[torch.Tensor]] = []
    size = 0
    for p in params:
        n = p.numel() // _shards(p)
        if not out or size + n > budget:
            out.append([])
            size = 0
        out[-1].append(p)
        size += n
    return out


def _shards(p: torch.Tensor) -> int:
    """Into how many pieces a DTensor's mesh cuts it (1 for a plain tensor)."""
    mesh, placements = getattr(p, "device_mesh", None), getattr(p, "placements", ())
    count = 1
    for dim, placement in enumerate(placements):
        if placement.is_shard():
            count *= mesh.size(dim)
    return count


def _check_args(*, lr, weight_decay, momentum, ns_steps, adjust_lr_fn, whole) -> None:
    for name, value in (("lr", lr), ("weight_decay", weight_decay), ("momentum", momentum)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                math.isfinite(value) and value >= 0):
            raise ValueError(f"Muon: {name}={value!r} must be a finite number >= 0")
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or not 1 <= ns_steps < 100:
        raise ValueError(f"Muon: ns_steps={ns_steps!r} must be an integer in [1, 99] (5 is "
                         "Jordan's)")
    if adjust_lr_fn not in ADJUST_LR:
        raise ValueError(f"Muon: adjust_lr_fn={adjust_lr_fn!r} is not one of "
                         "None, 'original', 'match_rms_adamw'")
    if whole not in WHOLE:
        raise ValueError(f"Muon: whole={whole!r} is not one of {', '.join(WHOLE)}")


def check_muon_param(p: torch.Tensor, name: str) -> None:
    """Refuse, naming it, a parameter Muon cannot step: not a matrix or a stack of matrices
    (ndim 2 or 3), complex, or not floating point."""
    if p.ndim not in (2, 3) or not p.is_floating_point() or p.is_complex():
        raise ValueError(
            f"Muon: parameter {name} ({tuple(p.shape)}, {p.dtype}) is not a real 2-D matrix "
            "or 3-D stack of matrices, which Muon orthogonalises; put it in a group with "
            "use_muon=False (AdamW), or name it in [optim] muon_exclude")


def split_groups(groups: list[Any], model: nn.Module | None = None, *,
                 exclude: Iterable[str] = ()) -> list[dict[str, Any]]:
    """The usual split of each of `groups` (param groups, parameters, or (name, parameter)
    pairs, as `meshfit.optim.build` has them) in a Muon part and an AdamW part: Muon for
    the matrices (ndim >= 2: the blocks' 2-D weights, 3-D stacked expert weights), AdamW for
    norms, biases and every other 0-D/1-D parameter and, with `model`, for its embeddings
    and output head (`get_output_embeddings()`, or a linear whose outputs are the largest
    embedding's vocabulary, tied or not) and parameters whose name contains one of
    `exclude`. A group that sets ``use_muon`` is kept as it is. A matrix Muon cannot step
    (ndim > 3, complex) is refused, named (`check_muon_param`)."""
    exclude = (exclude,) if isinstance(exclude, str) else tuple(exclude)
    names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
    outside = _outside_blocks(model) if model is not None else set()
    out: list[dict[str, Any]] = []
    for g, item in enumerate(groups):
        group = dict(item) if isinstance(item, dict) else {"params": [item]}
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        if "use_muon" in group:
            out.append({**group, "params": params})
            continue
        parts: dict[bool, list[Any]] = {True: [], False: []}
        for i, entry in enumerate(params):
            p = entry[1] if isinstance(entry, tuple) else entry
            name = entry[0] if isinstance(entry, tuple) else names.get(
                id(p), f"param_groups[{g}]['params'][{i}]")
            muon = p.ndim >= 2 and id(p) not in outside and not any(s in name for s in exclude)
            if muon:
                check_muon_param(p, name)
            parts[muon].append(p)
        # AdamW's part first: a log of the first group's lr shows [optim] lr, not muon_lr
        out.extend({**group, "params": parts[muon], "use_muon": muon} for muon in (False, True)
                   if parts[muon])
    return out


def _outside_blocks(model: nn.Module) -> set[int]:
    """ids of the embeddings' and the output head's parameters. The head: what a module's
    `get_output_embeddings()` returns (Hugging Face), or a linear layer producing the
    vocabulary's logits (out_features = an embedding's rows or a module's
    ``config.vocab_size``: a pipeline's last stage holds the head without the embedding)."""
    out: set[int] = set()
    vocab: set[int] = set()
    rows = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
    vocab.update([max(rows)] if rows else [])  # the token embedding's
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            out.update(id(p) for p in module.parameters())
        size = getattr(getattr(module, "config", None), "vocab_size", None)
        if isinstance(size, int):
            vocab.add(size)
        get_head = getattr(module, "get_output_embeddings", None)
        head = get_head() if callable(get_head) else None
        if isinstance(head, nn.Module):
            out.update(id(p) for p in head.parameters())
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.out_features in vocab:
            out.update(id(p) for p in module.parameters())
    return out


def build_muon(groups, *, lr, weight_decay, betas, eps, momentum, muon_lr: float = 0.02,
               muon_momentum: float = 0.95, muon_exclude: Iterable[str] = (),
               **kwargs) -> Muon:
    """`meshfit.optim.build`'s "muon": `split_groups` (already done with names where build
    had the model), Muon's groups at `muon_lr` with `muon_momentum`, AdamW's at `lr` with
    `betas` and `eps`; `weight_decay` as build gave it per group. `kwargs`: `Muon`'s other
    arguments (nesterov, ns_steps, adjust_lr_fn, whole, ...)."""
    groups = split_groups(groups, exclude=muon_exclude)
    for group in groups:
        group.setdefault("lr", muon_lr if group["use_muon"] else lr)
    return Muon(groups, **{"lr": muon_lr, "weight_decay": weight_decay,
                           "momentum": muon_momentum, "betas": betas, "adam_eps": eps,
                           **kwargs})


def sharded_class(cls: type) -> type:
    """The optimizer class to rebuild `cls` as over sharded (DTensor) parameters:
    `Muon` for torch.optim.Muon (which refuses DTensors; the same constructor arguments and
    the same step), `cls` itself otherwise."""
    return Muon if cls is torch.optim.Muon else cls
