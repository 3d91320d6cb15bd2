"""Stochastic rounding to bf16 with counter-based bits (`meshfit.optim.rounding`).

- The 16 random bits of an element are uniform, and independent to first order of the bits
  of its neighbour in the tensor, of the same element at the next step, of the same index in
  another tensor and under another seed (2^18 elements: every statistic within 5 standard
  errors of its value for independent uniform bits; a generator that ignored the step, the
  tensor or the seed, or whose bits followed the index, scores ~1 on one of them).
- The rounding is unbiased: over 2^16 values with the same dropped fraction f, the share
  rounded away from zero is f (within 5 standard errors), and it goes to the two bf16
  neighbours only; NaN, infinities and zeros keep their value.
- A block of a tensor (rows, columns, a 3-D box: any rank's part under FSDP2's dim-0
  shards, tensor parallel's column shards, or both) is rounded as the whole tensor's
  elements are, bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch

from meshfit.optim.rounding import element_index, random_bits, rounding_key, stochastic_bf16

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)

N = 1 << 18
SE = 1 / math.sqrt(N)  # standard error of a correlation of N independent pairs


def _bits(seed=0, tensor=0, step=1, index=None):
    return random_bits(torch.arange(N) if index is None else index,
                       *rounding_key(seed, tensor, step)).double()


def _corr(a, b):
    return torch.corrcoef(torch.stack([a, b]))[0, 1].item()


def test_random_bits_are_uniform_and_independent_to_first_order():
    bits = _bits()
    assert bits.min() >= 0 and bits.max() < 1 << 16
    # uniform: chi-square of the top 8 bits over 256 cells (255 dof: mean 255, sd 22.6)
    counts = torch.bincount((bits // 256).long(), minlength=256).double()
    chi2 = ((counts - N / 256) ** 2 / (N / 256)).sum().item()
    assert abs(chi2 - 255) < 5 * math.sqrt(2 * 255), chi2
    # ... and so are the low bits (a weak mixer leaves the low bits of a counter visible)
    low = torch.bincount((bits % 256).long(), minlength=256).double()
    assert abs(((low - N / 256) ** 2 / (N / 256)).sum().item() - 255) < 5 * math.sqrt(510)
    others = {"neighbour": torch.roll(bits, 1), "next step": _bits(step=2),
              "next tensor": _bits(tensor=1), "other seed": _bits(seed=1),
              "index + 2^32": _bits(index=torch.arange(N) + (1 << 32))}
    for what, other in others.items():
        assert abs(_corr(bits, other)) < 5 * SE, what
        assert not torch.equal(bits, other), what


def test_rounding_is_unbiased_and_goes_to_a_neighbour():
    ulp, n = 2.0 ** -7, 1 << 16  # bf16's ulp in [1, 2)
    fractions = torch.tensor([0.01, 0.3, 0.5, 0.77])
    x = (1 + fractions * ulp).repeat_interleave(n)  # n values of each dropped fraction
    index = torch.arange(x.numel())
    got = stochastic_bf16(x, index, *rounding_key(3, 7, 11)).float()
    assert set(got.unique().tolist()) == {1.0, 1 + ulp}
    shares = (got == 1 + ulp).double().view(4, n).mean(1)
    bound = 5 * (fractions * (1 - fractions) / n).sqrt()
    assert ((shares - fractions).abs() < bound).all(), shares
    negative = stochastic_bf16(-x, index, *rounding_key(3, 7, 11)).float()
    assert torch.equal(negative, -got)  # away from zero: the sign is kept


def test_special_values_keep_their_value():
    x = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, 1.0, -2.5])
    x = torch.cat([x, torch.tensor([-1], dtype=torch.int32).view(torch.float32)])  # a NaN
    for step in range(8):
        got = stochastic_bf16(x, torch.arange(x.numel()), *rounding_key(0, 0, step))
        assert got[:2].tolist() == [float("inf"), -float("inf")]
        assert got[2].isnan() and got[-1].isnan()
        assert got[3:7].tolist() == [0.0, -0.0, 1.0, -2.5]
        assert got[4].float().view(torch.int32) == -(1 << 31)  # -0.0: sign kept


@pytest.mark.parametrize("shape,block", [
    ((10, 12), (slice(4, 7), slice(None))),        # dim-0 shard (FSDP2)
    ((10, 12), (slice(None), slice(6, 12))),       # column shard (tensor parallel)
    ((4, 6, 10), (slice(2, 4), slice(1, 5), slice(0, 5))),  # both, 3-D
])
def test_a_block_rounds_as_the_whole_tensor_does(shape, block):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    key = rounding_key(1, 2, 3)
    whole = stochastic_bf16(x, element_index(shape, (0,) * len(shape), shape), *key)
    part = x[block].contiguous()
    offset = tuple(s.start or 0 for s in block)
    index = element_index(part.shape, offset, shape)
    assert torch.equal(index, torch.arange(x.numel()).view(shape)[block])
    assert torch.equal(stochastic_bf16(part, index, *key), whole[block])
