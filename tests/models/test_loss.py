"""The chunked linear cross-entropy (`meshfit.models.loss`) against the plain head + F.cross_entropy:
same loss and gradients (float64: to rounding; bf16 autocast: within bf16's rounding of the
matrix products), and without the whole logits kept for backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshfit.models import GPT, GPTConfig
from meshfit.models.loss import linear_cross_entropy, plain_cross_entropy

# float64 sums of a few hundred terms of order 1: a few ulps of 1, far below 1e-12.
F64_TOL = 1e-12


def _case(dtype=torch.float64, n=(3, 37), d=16, vocab=50):
    torch.manual_seed(0)
    h = torch.randn(*n, d, dtype=dtype, requires_grad=True)
    w = torch.randn(vocab, d, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, vocab, n)
    targets.view(-1)[:5] = -100  # ignored positions count in neither the loss nor its mean
    return h, w, targets


@pytest.mark.parametrize("chunk", [1, 7, 111, 4096])
def test_equals_plain_cross_entropy_in_float64(chunk):
    h, w, targets = _case()
    ref = plain_cross_entropy(h @ w.t(), targets)
    ref_grads = torch.autograd.grad(ref * 2.5, (h, w))
    loss = linear_cross_entropy(h, w, targets, chunk_tokens=chunk)
    grads = torch.autograd.grad(loss * 2.5, (h, w))  # the incoming gradient is applied
    assert loss.dtype == torch.float64
    assert abs(loss.item() - ref.item()) < F64_TOL
    for got, want in zip(grads, ref_grads):
        assert (got - want).abs().max().item() < F64_TOL


def test_bf16_autocast_matches_the_plain_head():
    h, w, targets = _case(torch.float32, n=(64,), d=32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = plain_cross_entropy(F.linear(h, w), targets)
        loss = linear_cross_entropy(h, w, targets, chunk_tokens=10)
    assert loss.dtype == torch.float32
    # Both use bf16 products and a float32 log-softmax: bf16's 2^-8 relative rounding.
    assert loss.item() == pytest.approx(ref.item(), rel=2**-7)
    ref_grads = torch.autograd.grad(ref, (h, w))
    grads = torch.autograd.grad(loss, (h, w))
    for got, want in zip(grads, ref_grads):
        assert got.dtype == torch.float32
        assert (got - want).abs().max().item() <= 2**-6 * want.abs().max().item()


def test_no_grad_gives_the_loss_only():
    h, w, targets = _case()
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, targets, chunk_tokens=5)
    assert not loss.requires_grad
    assert abs(loss.item() - plain_cross_entropy(h @ w.t(), targets).item()) < F64_TOL


def test_bad_arguments_are_one_line():
    h, w, targets = _case()
    with pytest.raises(ValueError, match="chunk_tokens=0 must be a positive integer"):
        linear_cross_entropy(h, w, targets, chunk_tokens=0)
    with pytest.raises(ValueError, match="one target per position"):
        linear_cross_entropy(h, w, targets[:, :3])


def _gpt(**overrides) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig.preset("tiny", **overrides)
    return GPT(cfg).double()


@pytest.mark.parametrize("tied", [True, False])
def test_gpt_fused_loss_equals_the_plain_path(tied):
    idx = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1))
    results = []
    for mode in ("off", "on"):
        model = _gpt(tie_embeddings=tied)
        model.fused_loss = mode
        loss = model(idx, idx.roll(-1, 1))
        loss.backward()
        results.append((loss.item(), {n: p.grad for n, p in model.named_parameters()}))
    (plain, plain_grads), (fused, fused_grads) = results
    assert abs(plain - fused) < F64_TOL
    assert plain_grads.keys() == fused_grads.keys()
    for name in plain_grads:
        assert (plain_grads[name] - fused_grads[name]).abs().max().item() < F64_TOL, name


def _largest_saved(model: GPT, idx: torch.Tensor) -> int:
    """Elements of the largest tensor autograd keeps for backward in one training forward."""
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx, idx)
    return max(sizes)


def test_auto_skips_the_whole_logits_only_when_large(monkeypatch):
    model = _gpt(vocab_size=4096)  # the logits outgrow every other saved tensor
    idx = torch.randint(0, 4096, (4, 64))
    logits = 4 * 64 * model.config.vocab_size
    assert _largest_saved(model, idx) >= logits  # small: the plain head keeps its logits
    monkeypatch.setattr(GPT, "FUSED_LOSS_MIN_BYTES", logits * 4)  # now exactly "large"
    assert _largest_saved(model, idx) < logits


def test_fused_loss_steps_aside_for_a_wrapped_head():
    model = _gpt(tie_embeddings=False)
    model.fused_loss = "on"
    seen = []
    model.lm_head.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    idx = torch.randint(0, 256, (2, 16))
    model(idx, idx)
    assert seen == [(2, 16, 256)]  # the head ran as a module: its hook saw the logits
    model.fused_loss = "sometimes"
    with pytest.raises(ValueError, match="GPT.fused_loss='sometimes'"):
        model(idx, idx)
