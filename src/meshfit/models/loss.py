"""Cross-entropy of a linear output head without the whole [tokens, vocab] logits.

A language model's last step, ``cross_entropy(h @ W.T, targets)``, materialises float32
logits of tokens x vocab: 8 x 1024 tokens of GPT-2's 50,304-entry vocabulary are 1.6 GB
(and as much again for their gradient), often the largest tensor of a training step.
`linear_cross_entropy` computes the same mean loss a chunk of tokens at a time: each chunk's
logits are formed, turned into its loss and, when gradients are wanted, into the chunk's
gradients for ``h`` and ``W`` right away (softmax minus one-hot, times W and times h), then
freed. The backward pass only scales the stored gradients by the incoming one. The matrix
products are the same three a plain head does (logits, grad of h, grad of W), so the FLOPs
do not change. What stays alive until backward is the gradient of h (tokens x d) and of W
(vocab x d, float32) instead of the logits, their float32 copy and log-softmax; the
transient peak is a chunk's float32 logits and their gradient (1,024 tokens of GPT-2:
2 x 206 MB).
Liger-Kernel's "fused linear cross-entropy" works this way.

Matrix products run in the dtype the head would use (autocast's, or h's and W's), the
log-softmax in float32, like `GPT.forward`'s plain path. ``ignore_index`` targets (-100)
count in neither loss nor gradient, and the mean is over the others, as
``F.cross_entropy``'s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["linear_cross_entropy"]

IGNORE_INDEX = -100


def _compute_dtype(h: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(h.device.type):
        return torch.get_autocast_dtype(h.device.type)
    return torch.promote_types(h.dtype, weight.dtype)


def _chunks(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
            dtype: torch.dtype, want_h: bool, want_w: bool):
    """(mean loss, its gradient for h or None, for weight or None), chunk by chunk."""
    acc = torch.promote_types(dtype, torch.float32)  # float32, or float64 for a float64 model
    valid = targets != IGNORE_INDEX
    denom = valid.sum().clamp(min=1).to(acc)
    w = weight.to(dtype)
    grad_h = torch.empty_like(h) if want_h else None
    grad_w = torch.zeros(weight.shape, dtype=torch.promote_types(acc, weight.dtype),
                         device=weight.device) if want_w else None
    total = torch.zeros((), dtype=acc, device=h.device)
    for start in range(0, h.shape[0], chunk):
        hc = h[start:start + chunk].to(dtype)
        tc, vc = targets[start:start + chunk], valid[start:start + chunk]
        logits = (hc @ w.t()).to(acc)
        lse = torch.logsumexp(logits, dim=-1)
        safe = torch.where(vc, tc, torch.zeros_like(tc))
        picked = logits.gather(1, safe.unsqueeze(1)).squeeze(1)
        total = total + torch.where(vc, lse - picked, torch.zeros_like(lse)).sum()
        if not (want_h or want_w):
            continue
        # d(mean loss)/d(logits) = (softmax - onehot) / count, on the counted rows only
        grad = torch.exp(logits - lse.unsqueeze(1))
        del logits
        grad.scatter_add_(1, safe.unsqueeze(1), -torch.ones_like(picked).unsqueeze(1))
        grad = (grad * (vc.unsqueeze(1) / denom)).to(dtype)
        if grad_h is not None:
            grad_h[start:start + chunk] = (grad @ w).to(h.dtype)
        if grad_w is not None:
            grad_w += (grad.t() @ hc).to(grad_w.dtype)
    return total / denom, grad_h, grad_w


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                chunk: int, dtype: torch.dtype) -> torch.Tensor:
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss, grad_h, grad_w = _chunks(h, weight, targets, chunk, dtype, want_h, want_w)
        ctx.save_for_backward(grad_h if want_h else h.new_empty(0),
                              grad_w if want_w else weight.new_empty(0))
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        gh = gw = None
        if ctx.needs_input_grad[0]:
            gh = grad_h * grad_out.to(grad_h.dtype)
        if ctx.needs_input_grad[1]:
            gw = (grad_w * grad_out).to(ctx.weight_dtype)
        return gh, gw, None, None, None


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         chunk_tokens: int = 1024) -> torch.Tensor:
    """Mean cross-entropy of ``h @ weight.T`` against `targets`, `chunk_tokens` tokens of
    logits at a time (see the module docstring).

    h: [..., d] hidden states; weight: [vocab, d] (a bias-free head); targets: h's leading
    shape, class indices (-100: ignored; 0 when every target is). Returns a float32 scalar
    (float64 for float64 inputs); gradients flow to h and weight, not through `targets`."""
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens={chunk_tokens!r} must be a positive integer")
    flat_h = h.reshape(-1, h.shape[-1])
    flat_t = targets.reshape(-1)
    if flat_t.shape[0] != flat_h.shape[0]:
        raise ValueError(f"targets of shape {tuple(targets.shape)} do not match hidden states "
                         f"of shape {tuple(h.shape)}: give one target per position")
    dtype = _compute_dtype(h, weight)
    if not torch.is_grad_enabled() or not (h.requires_grad or weight.requires_grad):
        with torch.no_grad():
            return _chunks(flat_h, weight, flat_t, chunk_tokens, dtype, False, False)[0]
    return _LinearCrossEntropy.apply(flat_h, weight, flat_t, chunk_tokens, dtype)


def plain_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss of whole logits (`GPT.forward`'s, and the reference the chunked loss equals):
    float32 log-softmax, which over a large vocabulary is unstable in bf16 (a float64 model
    keeps float64)."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())
