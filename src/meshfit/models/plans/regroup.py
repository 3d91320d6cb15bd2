"""The state-dict transformation a tensor-parallel plan implies: fused projections regrouped
by heads.

GPT-2 holds q, k and v in one fused projection (``c_attn``, a Conv1D whose output columns
are [q | k | v]). Split by plain columns over ``tp`` ranks, rank 0 would get all of q and
half of k; the plan's ``fused=3`` style therefore regroups the columns rank-major before
splitting, [q_0 k_0 v_0 | q_1 k_1 v_1 | ...], so each rank holds q, k and v of its own heads.
The parameter's global layout is then head-grouped and depends on the TP degree: these
functions move a tensor between the two layouts and find which parameters of a laid-out
model are head-grouped (the module carries a mark set when it was split). They are plain
tensor maths: the tensor-parallel styles (`meshfit.parallel.tp`), checkpoint export and
pretrained loading (`meshfit.checkpoint`) all use them.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["canonical_state", "group_columns", "mark_regrouped", "regrouped_params",
           "regrouped_tp", "unfuse_columns"]

_TP_ATTR = "_meshfit_regrouped_for_tp"  # on a split module: the TP degree of its layout
_CHUNKS_ATTR = "_meshfit_fused"  # ... and how many projections it fuses (3: q|k|v)


def _fuse_order(t: torch.Tensor, chunks: int, tp: int, dim: int, inverse: bool) -> torch.Tensor:
    if chunks == 1:
        return t
    dim = dim % t.ndim
    n = t.shape[dim] // (chunks * tp)
    outer, inner = (chunks, tp) if not inverse else (tp, chunks)
    shaped = t.unflatten(dim, (outer, inner, n)).transpose(dim, dim + 1)
    return shaped.flatten(dim, dim + 2).contiguous()


def group_columns(t: torch.Tensor, chunks: int, tp: int, dim: int = -1) -> torch.Tensor:
    """The head-grouped layout of a fused projection: `dim` of `t`, [q | k | v] for
    ``chunks=3``, becomes [q_0 k_0 v_0 | q_1 k_1 v_1 | ...] for `tp` ranks (rank-major), so
    that a plain split of `dim` in `tp` parts gives each rank its own heads."""
    return _fuse_order(t, chunks, tp, dim, inverse=False)


def unfuse_columns(t: torch.Tensor, chunks: int, tp: int, dim: int = -1) -> torch.Tensor:
    """Undo `group_columns`: [q | k | v], the layout of the original model (and of its
    checkpoints), from the global tensor of a parameter `Conv1DColwiseParallel(fused=chunks)`
    split on `tp` ranks."""
    return _fuse_order(t, chunks, tp, dim, inverse=True)


def mark_regrouped(module: nn.Module, chunks: int, tp: int) -> None:
    """Record on `module` that its parameters are held head-grouped for `tp` ranks."""
    setattr(module, _TP_ATTR, tp)
    setattr(module, _CHUNKS_ATTR, chunks)


def regrouped_tp(module: nn.Module) -> int:
    """The TP degree `module`'s own parameters are head-grouped for (1: not regrouped)."""
    return getattr(module, _TP_ATTR, 1)


def regrouped_params(model: nn.Module) -> dict[str, tuple[int, int, int]]:
    """Every parameter of `model` whose global layout is head-grouped (a fused projection
    split by `Conv1DColwiseParallel(fused=...)`), by state-dict name: ``(chunks, tp, dim)``
    for `unfuse_columns`. Empty for a model without such layers."""
    out = {}
    for mod_name, module in model.named_modules():
        tp = regrouped_tp(module)
        if tp == 1:
            continue
        for p_name, p in module.named_parameters(recurse=False):
            name = f"{mod_name}.{p_name}" if mod_name else p_name
            out[name] = (getattr(module, _CHUNKS_ATTR), tp, p.ndim - 1)
    return out


def canonical_state(state: dict, regrouped: dict[str, tuple[int, int, int]]) -> dict:
    """`state` (whole tensors, e.g. a gathered state dict) with the head-grouped entries
    listed by `regrouped_params` put back in the original model's layout: what a plain
    single-device model of the same class loads. Other entries are returned as they are."""
    out = dict(state)
    for name, (chunks, tp, dim) in regrouped.items():
        if name in out:
            out[name] = unfuse_columns(out[name], chunks, tp, dim)
    return out
