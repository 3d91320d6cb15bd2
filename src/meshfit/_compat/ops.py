"""ATen's private operators and the dispatcher's types: the fused attention kernels that
return their log-sum-exp, the operator type, and the tensor-subclass protocol test.

- Context parallel's ring (`meshfit.parallel.cp`) merges the blocks of one query's attention
  by their log-sum-exp, which ``F.scaled_dot_product_attention`` does not return: it calls
  SDPA's kernels directly (``aten._scaled_dot_product_flash_attention*``,
  ``aten._scaled_dot_product_efficient_attention*``), forward and backward, as torch's own
  context parallel does. Their signatures move between releases; cp probes each on a small
  block before trusting it. Public replacement: an SDPA that returns the log-sum-exp (and
  takes it back for the backward).
- Selective activation checkpointing (`meshfit.parallel.activation`) keeps the outputs of
  named operators, SDPA's kernels among them (`ATTENTION_OPS`), and names their type
  (``torch._ops.OpOverload``). Public replacement: a public name for the type.
- `is_traceable_wrapper_subclass` (``torch.utils._python_dispatch``): whether a tensor is a
  wrapper subclass that ``__tensor_flatten__`` opens (DTensor, torchao's quantised
  tensors). Public replacement: the same function in a public module.
- `is_view`: whether a tensor is a view of another (``Tensor._base``), which
  `meshfit.parallel.parallelize` asks of a module's outputs. Public replacement: a public
  ``Tensor.is_view()``.
"""

from __future__ import annotations

import torch
from torch._ops import OpOverload
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from meshfit._compat import _probe

__all__ = ["ATTENTION_OPS", "OpOverload", "is_traceable_wrapper_subclass", "is_view"]

_aten = torch.ops.aten

_ATTENTION = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
              "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
ATTENTION_OPS: list[OpOverload] = [getattr(_aten, name).default for name in _ATTENTION
                                   if hasattr(_aten, name)]
"""SDPA's fused kernels (what ``F.scaled_dot_product_attention`` dispatches to), those this
torch has (`missing` names any other)."""


def is_view(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a view of another tensor (its ``_base``)."""
    return tensor._base is not None


# The ring's kernels: forward(q, k, v, causal, scale) -> (out, lse [B, H, T] in fp32, fp64
# for fp64 inputs) and backward(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv), all
# [B, H, T, D] in the inputs' dtype, no dropout, no mask but the causal one.
def has_cpu_flash() -> bool:
    """Whether this torch has SDPA's flash kernel for the CPU."""
    return hasattr(_aten, "_scaled_dot_product_flash_attention_for_cpu")


def cpu_flash_forward(q, k, v, causal, scale):
    return _aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=None, scale=scale)


def cpu_flash_backward(dout, q, k, v, out, lse, causal, scale):
    return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=None, scale=scale)


def cuda_flash_forward(q, k, v, causal, scale):
    out, lse, *_ = _aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale)
    return out, lse


def cuda_flash_backward(dout, q, k, v, out, lse, causal, scale):
    none = torch.empty(0, dtype=torch.int64, device=q.device)  # no dropout, no varlen
    return _aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, none, none, q.shape[2], k.shape[2], 0.0, causal, none, none,
        scale=scale)


def cuda_efficient_forward(q, k, v, causal, scale):
    out, lse, _, _ = _aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, causal, scale=scale)
    return out, lse[..., :q.shape[2]]  # (its rows are padded to a multiple of 32)


def cuda_efficient_backward(dout, q, k, v, out, lse, causal, scale):
    pad = -(-q.shape[2] // 32) * 32 - q.shape[2]
    lse = torch.nn.functional.pad(lse, (0, pad)) if pad else lse
    none = torch.empty(0, dtype=torch.int64, device=q.device)
    dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, lse.contiguous(), none, none, 0.0,
        [True, True, True, False], causal, scale=scale)
    return dq, dk, dv


def missing() -> list[str]:
    ops = (*_ATTENTION, "_scaled_dot_product_flash_attention_backward",
           "_scaled_dot_product_flash_attention_for_cpu_backward",
           "_scaled_dot_product_efficient_attention_backward")
    return _probe.absent("torch", ("torch._ops.OpOverload", "torch.Tensor._base",
                                   "torch.utils._python_dispatch.is_traceable_wrapper_subclass",
                                   *(f"torch.ops.aten.{op}" for op in ops)))
