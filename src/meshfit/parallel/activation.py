"""Activation checkpointing: keep fewer activations, recompute them in the backward pass.

Chen et al. 2016 ("Training Deep Nets with Sublinear Memory Cost"): a checkpointed block
keeps only its inputs in the forward pass and runs again inside the backward pass, so the
memory for activations drops from O(layers x activations per block) to O(layers x block
input) plus one block's activations, for about one extra forward pass of compute.

    apply_activation_checkpointing(model, "full")                    # every block
    apply_activation_checkpointing(model, "selective", every=2)      # blocks 0, 2, 4, ...
    apply_activation_checkpointing(model, "selective", policy="op")  # per-op, every block

Modes (torchtitan's names):

- ``"none"``: leave the model as it is.
- ``"full"``: every transformer block is recomputed in the backward pass.
- ``"selective"`` with ``policy="block"``: only every `every`-th block (indices 0, every,
  2*every, ...) is checkpointed; the others keep their activations. Memory and recompute
  both fall between "none" and "full".
- ``"selective"`` with ``policy="op"``: every block is checkpointed, but the outputs of the
  expensive ops (matmuls, attention; `SAVED_OPS`) are kept, so the backward pass recomputes
  only cheap elementwise work (norms, activations, residual adds). Korthikanti et al. 2022
  ("Reducing Activation Recomputation in Large Transformer Models") make the same trade.

Checkpointing is always non-reentrant (`use_reentrant=False`): it preserves the RNG state
(dropout masks replay exactly), supports keyword arguments and inputs without
`requires_grad`, and composes with DDP, FSDP2 and torch.compile. The block keeps its
parameter names: instead of a wrapper module (`checkpoint_wrapper` adds a
`_checkpoint_wrapped_module.` prefix to every state_dict key), the block's class is swapped
for a subclass whose `forward` runs the original one under `torch.utils.checkpoint`, as
FSDP2's `fully_shard` does. Module hooks (FSDP2's unshard, for one) stay outside the
checkpoint and do not run twice.

Hugging Face models (`transformers.PreTrainedModel`) use their own per-layer mechanism
(`activation_checkpointing_enable`, named `gradient_checkpointing_enable` before 5.x), with
our non-reentrant kwargs: its layer wrapper also drops the KV cache, which a recompute would
otherwise update twice. HF turns `use_cache` off for checkpointed layers in train mode.
"""

from __future__ import annotations

import copyreg
import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from meshfit._compat import ops as aten_ops
from meshfit.models.gpt import GPT
from meshfit.parallel.activation_budget import apply_memory_budget
from meshfit.parallel.activation_call import _around_class, _AroundCallMixin
from meshfit.parallel.options import CheckpointMode, CheckpointPolicy, check_checkpointing

__all__ = ["CheckpointMode", "CheckpointPolicy", "SAVED_OPS", "apply_activation_checkpointing",
           "check_checkpointing", "find_blocks", "is_checkpointed"]

_aten = torch.ops.aten
# Outputs kept by policy="op": the matmuls and attention (SDPA's fused kernels), whose
# recompute costs most FLOPs (torchtitan's `_save_list` keeps the same, minus collectives).
# Linear layers reach these as mm/addmm (2-D after flattening) and batched matmul as bmm.
# Everything else is recomputed.
SAVED_OPS: list[aten_ops.OpOverload] = [
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
    *aten_ops.ATTENTION_OPS]


def apply_activation_checkpointing(model: nn.Module, mode: CheckpointMode = "full", *,
                                   every: int = 2, policy: CheckpointPolicy = "block",
                                   budget: float = 0.5) -> nn.Module:
    """Checkpoint the transformer blocks of `model` in place; returns `model`.

    `every` and `policy` apply to mode="selective" only (see the module docstring); mode
    "budget" lets torch.compile's partitioner keep `budget` of the activations
    (`meshfit.parallel.activation_budget.apply_memory_budget`: compile the model too). Call
    before `apply_compile` (which traces through the checkpoint as a higher-order op) and
    before wrapping in DDP/FSDP. Calling again replaces the previous choice."""
    check_checkpointing(mode, every, policy, names=("mode", "every", "policy"),
                        where="apply_activation_checkpointing: ")
    if mode == "budget":
        return apply_memory_budget(model, budget)
    if mode == "none":
        return model
    try:
        from transformers import PreTrainedModel
    except ImportError:
        PreTrainedModel = ()  # noqa: N806 - transformers is optional
    if isinstance(model, PreTrainedModel) and model.supports_gradient_checkpointing:
        return _apply_hf(model, mode, every, policy)
    # A meshfit GPT pipeline stage may hold no blocks at all, which find_blocks would reject.
    blocks = list(model.layers.values()) if isinstance(model, GPT) else find_blocks(model)
    for block in blocks:
        if (isinstance(block, _CheckpointedMixin)
                and _inner_class(block).__bases__[0] is not _CheckpointedMixin):
            raise ValueError(f"apply_activation_checkpointing: {type(block).__name__} was wrapped "
                             "again after checkpointing (e.g. by fully_shard); set checkpointing "
                             "before sharding")
    for i, block in enumerate(blocks):
        _unwrap(block)
        if mode == "full" or policy == "op" or i % every == 0:
            _wrap(block, _context_fn(mode, policy))
    return model


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of `model`: the children of the ModuleList / ModuleDict /
    Sequential whose children all share one class and which holds the most parameters
    (meshfit GPT `layers`, HF Llama `model.layers`, HF GPT-2 `transformer.h`).
    """
    best, best_size = None, 0
    for _, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            continue
        children = list(container.children())
        classes = {_plain_class(c) for c in children}
        if len(classes) != 1 or issubclass(classes.pop(), (nn.ModuleList, nn.ModuleDict)):
            continue
        size = sum(p.numel() for p in container.parameters())
        if size > best_size:
            best, best_size = children, size
    if best is None:
        raise ValueError(f"apply_activation_checkpointing: found no repeated blocks in "
                         f"{type(model).__name__} (no ModuleList/ModuleDict of same-class "
                         "modules with parameters); keep the blocks in an nn.ModuleList or use "
                         "mode='none'")
    return best


def is_checkpointed(module: nn.Module) -> bool:
    """Whether `module` runs under checkpointing set by `apply_activation_checkpointing`
    (the meshfit wrapper or HF's per-layer flag)."""
    return (isinstance(module, _CheckpointedMixin)
            or bool(getattr(module, "gradient_checkpointing", False)))


# --------------------------------------------------------------------------- the wrapper
class _CheckpointedMixin:
    """Runs the block's own `forward` under non-reentrant `torch.utils.checkpoint`: the first
    base of a per-class subclass, so `super().forward` is the original forward."""

    _meshfit_context_fn = None  # per instance: None (full) or a SAC context factory

    def forward(self, *args, **kwargs):
        plain_forward = super().forward
        if not torch.is_grad_enabled():  # nothing to save: inference runs as is
            return plain_forward(*args, **kwargs)
        context_fn = self._meshfit_context_fn
        extra = {} if context_fn is None else {"context_fn": context_fn}
        return checkpoint(plain_forward, *args, use_reentrant=False, **extra, **kwargs)

    def __reduce_ex__(self, protocol):
        # The subclass is made at run time and cannot be pickled by name: pickle the plain
        # class and rebuild the subclass on load (deepcopy works either way).
        fn, args, *rest = super().__reduce_ex__(max(protocol, 2))
        if fn is not copyreg.__newobj__:
            raise TypeError(f"cannot pickle checkpointed {type(self).__name__}")
        return (_new_checkpointed, (_plain_class(self), *args[1:]), *rest)


@functools.cache
def _checkpointed_class(cls: type) -> type:
    return type(f"Checkpointed{cls.__name__}", (_CheckpointedMixin, cls),
                {"__module__": cls.__module__})


def _new_checkpointed(plain: type, *args):
    cls = _checkpointed_class(plain)
    return cls.__new__(cls, *args)


def _plain_class(module: nn.Module) -> type:
    mro = type(module).__mro__
    if _CheckpointedMixin in mro:
        return mro[mro.index(_CheckpointedMixin) + 1]
    return _inner_class(module)


def _inner_class(module: nn.Module) -> type:
    """The module's class below the `activation_call` swap (its own class without one)."""
    cls = type(module)
    return cls.__bases__[1] if cls.__bases__[0] is _AroundCallMixin else cls


def _set_inner_class(block: nn.Module, inner: type) -> None:
    """Swap the class below the `activation_call` swap, which stays on top."""
    around = type(block).__bases__[0] is _AroundCallMixin
    block.__class__ = _around_class(inner) if around else inner


def _wrap(block: nn.Module, context_fn) -> None:
    _set_inner_class(block, _checkpointed_class(_inner_class(block)))
    block._meshfit_context_fn = context_fn


def _unwrap(block: nn.Module) -> None:
    if not isinstance(block, _CheckpointedMixin):
        return
    _set_inner_class(block, _plain_class(block))
    block.__dict__.pop("_meshfit_context_fn", None)


def _context_fn(mode: str, policy: str):
    return _save_matmuls_contexts if mode == "selective" and policy == "op" else None


def _save_matmuls_contexts():
    # A module-level function rather than a partial over SAVED_OPS: op overloads cannot be
    # pickled, and the context factory is stored on the block.
    return create_selective_checkpoint_contexts(SAVED_OPS)


# --------------------------------------------------------------------------- Hugging Face
def _apply_hf(model: nn.Module, mode: str, every: int, policy: str) -> nn.Module:
    blocks = find_blocks(model)
    per_layer = all(hasattr(b, "gradient_checkpointing") for b in blocks)
    if mode == "selective" and policy == "block" and not per_layer:
        raise ValueError(f"apply_activation_checkpointing: {type(model).__name__} has no "
                         "per-layer checkpointing flag (transformers < 4.52?); use mode='full' "
                         "or policy='op'")
    kwargs = {"use_reentrant": False}
    if mode == "selective" and policy == "op":
        kwargs["context_fn"] = _context_fn(mode, policy)
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if mode == "selective" and policy == "block":
        for i, block in enumerate(blocks):  # HF set every layer's flag; keep 0, every, ...
            block.gradient_checkpointing = i % every == 0
    return model
