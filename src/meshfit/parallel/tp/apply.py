"""Tensor parallel (Megatron-LM, Shoeybi et al. 2019) and sequence parallel (Korthikanti et
al. 2022) on a 1-D DTensor mesh: `apply_tp(model, tp_mesh)` and `tp_cross_entropy`.

A plan (see `meshfit.models.plans`) maps module-name patterns ("layers.*.attn.wq") to
PyTorch parallel styles; `apply_tp` validates the model against the mesh size, then calls
`parallelize_module`. Layouts, with T = TP degree:

- column-parallel linears (q/k/v, MLP up/gate): weight sharded on the output features, input
  replicated, output sharded on the last dim (each rank holds n_head/T heads);
- row-parallel linears (attention out, MLP down): weight sharded on the input features, output
  all-reduced (Replicate) or, under sequence parallel, reduce-scattered on the sequence dim;
- vocabulary-parallel embedding and head: both shard the [vocab, d] weight on the vocabulary
  dim (Shard(0)), so a tied embedding stays one tensor; the head's logits are gathered
  (Replicate) or, with `loss_parallel=True`, left sharded on the vocabulary for
  `tp_cross_entropy`;
- everything else (norms, position tables) is replicated: a DTensor with `Replicate()`, so
  every parameter of a TP model is a DTensor on the same mesh.

Every distributed parameter is scattered/broadcast from the mesh's first rank (torch's
`src_data_rank=0`), so the ranks agree on the weights whatever they held before.
"""

from __future__ import annotations

import fnmatch
import hashlib
from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle, loss_parallel, parallelize_module

from meshfit.distributed.tensors import names_by_parameter
from meshfit.models import plans
from meshfit.parallel.tp.styles import (NO_PARAMS, ReplicateLocal, ReplicateParallel,
                                       planned_placement, to_torch_style)

__all__ = ["apply_tp", "tp_cross_entropy"]


# ---------------------------------------------------------------------------- apply_tp
def _matches(pattern: str, name: str) -> bool:
    """Module-name match as `parallelize_module` does it: atom by atom with fnmatch."""
    if not pattern:  # parallelize_module's "": the module itself
        return not name
    pat, parts = pattern.split("."), name.split(".") if name else []
    return len(pat) == len(parts) and all(fnmatch.fnmatch(n, p) for n, p in zip(parts, pat))


def _style_for(styles: Mapping[str, ParallelStyle], name: str) -> ParallelStyle | None:
    """The style that places the parameters of module `name`: its own, else a
    `ReplicateLocal` or `ReplicateParallel` on a module holding it (both replicate every
    parameter inside: a LoRA layer's base and adapters under one style)."""
    found = [s for k, s in styles.items() if _matches(k, name) and not isinstance(s, NO_PARAMS)]
    if found:
        return found[-1]  # parallelize_module applies entries in order
    parts = name.split(".")
    for end in range(len(parts) - 1, -1, -1):
        outer = [s for k, s in styles.items()
                 if _matches(k, ".".join(parts[:end]))
                 and isinstance(s, (ReplicateLocal, ReplicateParallel))]
        if outer:
            return outer[-1]
    return None


def _check_params(model: nn.Module, styles: Mapping[str, ParallelStyle]) -> list[list[str]]:
    """Raise if a parameter would stay a plain tensor or tied copies would be laid out
    differently; return the groups of names that share one parameter (to re-tie after)."""
    modules = dict(model.named_modules())
    plain, tied = [], []
    for names in names_by_parameter(model):
        placements = set()
        for full in names:
            owner, _, p_name = full.rpartition(".")
            style = _style_for(styles, owner)
            if style is None:
                plain.append(full)
            elif len(names) > 1:
                placements.add(planned_placement(style, modules[owner], p_name))
        if len(names) > 1:
            if len(placements) > 1:
                raise ValueError(
                    f"{' and '.join(names)} are one tied tensor but the TP plan lays them out as "
                    f"{' vs '.join(map(str, placements))}; give them the same placement (a "
                    "vocabulary-parallel pair: RowwiseParallel on the embedding, ColwiseParallel "
                    "on the head) or untie them explicitly before apply_tp")
            tied.append(names)
    if plain:
        raise ValueError(
            f"the TP plan leaves {len(plain)} parameters as plain tensors ({', '.join(plain[:4])}"
            f"{', ...' if len(plain) > 4 else ''}); add their modules to the plan, e.g. "
            "ReplicateParallel() for small modules that are not split")
    return tied


def _retie(model: nn.Module, tied: list[list[str]]) -> None:
    # parallelize_module gives each module its own new Parameter; point the copies back at
    # the first one (same placement, checked above), so the weight stays one leaf.
    for first, *others in tied:
        shared = model.get_parameter(first)
        for full in others:
            owner, _, p_name = full.rpartition(".")
            setattr(model.get_submodule(owner), p_name, shared)


def _check_same_rng(model: nn.Module, tp_mesh) -> None:
    """Dropout on replicated activations must draw the same mask on every TP rank, or the
    replicas drift apart silently (Megatron keeps one RNG stream per TP group for them)."""
    if not any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules()):
        return
    state = torch.get_rng_state().numpy().tobytes()
    if any(p.is_cuda for p in model.parameters()):
        state += torch.cuda.get_rng_state().numpy().tobytes()
    digest = hashlib.sha256(state).hexdigest()
    states = [None] * tp_mesh.size()
    dist.all_gather_object(states, digest, group=tp_mesh.get_group())
    if len(set(states)) > 1:
        raise ValueError("dropout on replicated activations needs the same RNG state on every "
                         "TP rank; call torch.manual_seed(seed) with one seed on all ranks before "
                         "apply_tp, or use sequence_parallel=True")


def _seq_check_hook(tp: int, kwarg: str):
    def hook(module, args, kwargs):
        x = kwargs.get(kwarg, args[0] if args else None)
        if isinstance(x, torch.Tensor) and x.ndim >= 2 and x.shape[1] % tp:
            raise ValueError(
                f"sequence length {x.shape[1]} does not divide by tp={tp} under sequence "
                f"parallelism (the sequence is split across TP ranks); pad it to "
                f"{-(-x.shape[1] // tp) * tp}")
    return hook


def _route_loss(model: nn.Module, plan) -> None:
    """Under loss_parallel, turn the model's own loss argument into `tp_cross_entropy`."""
    if plan.labels_kwarg is not None:
        def refuse(module, args, kwargs):
            if kwargs.get(plan.labels_kwarg) is not None:
                raise ValueError(
                    f"{type(module).__name__}({plan.labels_kwarg}=...) cannot compute its loss on "
                    "vocabulary-sharded logits (loss_parallel=True); call it without "
                    f"{plan.labels_kwarg} and use tp_cross_entropy(logits[:, :-1], "
                    f"{plan.labels_kwarg}[:, 1:]), or apply_tp with loss_parallel=False")
        model.register_forward_pre_hook(refuse, with_kwargs=True)
    if plan.targets_arg is None:
        return
    pos, key = plan.targets_arg
    pending: list = []  # a stack: one entry per call in flight

    def take_targets(module, args, kwargs):
        targets = kwargs.pop(key, None)
        if targets is None and len(args) > pos:
            targets, args = args[pos], args[:pos] + args[pos + 1:]
        pending.append(targets)
        return args, kwargs

    def loss(module, args, kwargs, logits):
        targets = pending.pop()
        return logits if targets is None else tp_cross_entropy(logits, targets)

    model.register_forward_pre_hook(take_targets, with_kwargs=True)
    model.register_forward_hook(loss, with_kwargs=True)


def apply_tp(model: nn.Module, tp_mesh, *, plan=None, sequence_parallel: bool = False,
             loss_parallel: bool = False) -> nn.Module:
    """Split `model` (the same full model on every rank) across the 1-D `tp_mesh` in place
    and return it. Build the optimizer after this call (its parameters are new DTensors).

    `plan`: a `meshfit.models.plans.TPPlan`, a dict {module-name pattern: `Style` or PyTorch
    `ParallelStyle`}, or None for the built-in plan of the model's type (reference GPT,
    Hugging Face LlamaForCausalLM and GPT2LMHeadModel). Checked before the model is touched:
    sizes that must divide by the TP degree (one-line ValueError naming the field and what
    to pad to), parameters the plan leaves plain, tied weights laid out differently, and
    dropout RNG agreement without sequence parallel.

    Input ids [B, T] are replicated on every TP rank (the same batch). With
    `loss_parallel=True` the logits stay a DTensor sharded on V for `tp_cross_entropy`; the
    reference GPT's `model(idx, targets)` then computes its loss that way by itself, while
    Hugging Face `labels=` is refused with advice. `sequence_parallel=True` needs T divisible
    by the TP degree (checked per forward)."""
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tp needs a 1-D mesh, got axes {tp_mesh.mesh_dim_names}; pass "
                         "mesh['tp']")
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError("apply_tp: the model already holds DTensor parameters; apply tensor "
                         "parallel once, to the plain model, before FSDP/DDP")
    tp = tp_mesh.size()
    if plan is None:
        plan = plans.plan_for(model, sequence_parallel=sequence_parallel,
                              loss_parallel=loss_parallel)
    elif not isinstance(plan, plans.TPPlan):
        plan = plans.TPPlan(styles=dict(plan))
    plan.check_divisible(tp)
    styles = {key: to_torch_style(style) for key, style in plan.styles.items()}
    for key in styles:
        if not any(_matches(key, n) for n, _ in model.named_modules()):
            raise ValueError(f"TP plan key {key!r} matches no module of "
                             f"{type(model).__name__}; check the module names")
    tied = _check_params(model, styles)
    if not sequence_parallel:
        _check_same_rng(model, tp_mesh)

    parallelize_module(model, tp_mesh, styles)
    _retie(model, tied)
    for pattern, attrs in plan.local_attrs.items():
        for name, module in model.named_modules():
            if _matches(pattern, name):
                for attr in attrs:
                    if hasattr(module, attr):  # e.g. GPT-2's split_size, per-rank widths
                        setattr(module, attr, getattr(module, attr) // tp)
    if sequence_parallel:
        model.register_forward_pre_hook(_seq_check_hook(tp, plan.input_kwarg), with_kwargs=True)
    if loss_parallel:
        _route_loss(model, plan)
    return model


# ---------------------------------------------------------------------------- loss
class _LossParallelCE(torch.autograd.Function):
    """Cross-entropy under `loss_parallel()`, with the backward also run under it.

    torch requires `loss.backward()` inside the context (outside, nll_loss_backward fails on
    mixed Tensor/DTensor); computing the loss on a detached leaf and replaying its gradient
    here lifts that requirement, so the loss behaves like any other.
    """

    @staticmethod
    def forward(ctx, logits: DTensor, targets: torch.Tensor, ignore_index: int):
        with torch.enable_grad(), loss_parallel():
            leaf = logits.detach().requires_grad_()
            loss = F.cross_entropy(leaf, targets, ignore_index=ignore_index)
        ctx.leaf, ctx.loss = leaf, loss
        return loss.detach()

    @staticmethod
    def backward(ctx, grad: DTensor):
        with loss_parallel():
            (g,) = torch.autograd.grad(ctx.loss, ctx.leaf, grad)
        ctx.leaf = ctx.loss = None
        return g, None, None


def tp_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *,
                     ignore_index: int = -100) -> torch.Tensor:
    """Mean token cross-entropy of `logits` [..., V] against `targets` [...] (ignore_index
    skipped), returned as a plain scalar tensor equal on every TP rank.

    When `logits` is a DTensor sharded on the vocabulary (a model after
    `apply_tp(..., loss_parallel=True)`), the loss runs under PyTorch's `loss_parallel`: each
    rank works on its [N, V/T] shard and only per-token max, sum-of-exp and target logit are
    all-reduced, so the full [N, V] logits are never gathered (Megatron's vocabulary-parallel
    cross-entropy). `backward()` may be called anywhere. Other logits take the ordinary path.
    Half-precision logits are upcast to float32 first, as the reference GPT does.
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    flat, tgt = logits.flatten(0, -2), targets.flatten()
    if isinstance(logits, DTensor):
        if any(p.is_shard(logits.ndim - 1) for p in logits.placements):
            return _LossParallelCE.apply(flat, tgt, ignore_index).to_local()
        flat = flat.full_tensor()
    return F.cross_entropy(flat, tgt, ignore_index=ignore_index)
