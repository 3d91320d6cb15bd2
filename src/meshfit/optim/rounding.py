"""Stochastic rounding of fp32 to bf16 with counter-based random bits: the same bits for an
element under every layout.

Stochastic rounding (Gupta et al. 2015, "Deep Learning with Limited Numerical Precision")
rounds x to its bf16 neighbour away from zero with the probability given by the 16 bits that
bf16 drops (as a fraction of 2^16), toward zero otherwise: E[round(x)] = x, so an update
smaller than half a bf16 ulp is kept in expectation instead of lost. torchao draws the 16
random bits with `torch.randint` on each rank's generator over that rank's shard, so a
sharded run rounds each element with other bits than one process does: equal in
distribution only. Here the bits of an element are a pure function of

    (seed of the run, step count of the tensor, id of the tensor, the element's index in the
     whole flattened tensor)

-- a counter-based generator in the spirit of Philox (Salmon et al. 2011, "Parallel random
numbers: as easy as 1, 2, 3"): nothing is drawn, so any rank holding any part of the tensor
computes the bits one process computes for the same elements, and a resumed run (the seed in
the optimizer's param groups, the step in its state) computes those of the run it resumes.

The function: a 64-bit key is made of (seed, tensor id, step) in Python with SplitMix64's
finaliser (Steele et al. 2014; each input passes through a full 64-bit avalanche, so the keys
of neighbouring steps or tensors are unrelated). Per element, two rounds of MurmurHash3's
32-bit finaliser `fmix32` (Appleby), each after mixing in 32 bits of key:

    h = fmix32(index_lo ^ key_lo);   h = fmix32(h ^ index_hi ^ key_hi);   bits = h >> 16

fmix32 is a bijection of 32-bit words in which every input bit flips every output bit with
probability close to 1/2 (its design criterion, measured by its author). For a fixed key the
map from index (< 2^32) to h is a bijection, so the elements of a tensor get distinct words
(their top 16 bits exactly uniform over the 2^32 indices that share their upper 32 bits),
and neighbouring
indices, which differ in a few low bits, get words that differ in about half their bits.
This is not a generator for Monte Carlo work (it is not claimed to pass BigCrush); rounding
needs bits that are uniform and independent of the neighbours' and of the previous steps' to
first order, which tests/optim/test_rounding.py measures (uniformity of the high and the
low bits, correlation with the neighbour's bits, the next step's, another tensor's, another
seed's and those 2^32 indices on, over 2^18 elements; the share rounded away per dropped
fraction over 2^16: unbiased).

Integer arithmetic is in int64 torch ops on values below 2^32 (torch has no uint32
arithmetic on every device); a multiplier c >= 2^31 is used as c - 2^32 (the same residue
mod 2^32), so that no product reaches 2^63 (a signed overflow would be undefined behaviour
in the C++ that inductor generates), then masked to 32 bits.

The rounding itself is torchao's `_fp32_to_bf16_sr` (optim/quant_utils.py) in the form its
comment calls slightly faster: the random 16 bits added to the fp32 bit pattern, the low 16
bits then cleared. A NaN stays a NaN (torchao's can carry a NaN whose upper mantissa bits
are all ones into the sign bit), an infinity has a zero fraction and stays itself, and the
largest finite values round away to infinity with the probability their fraction gives (as
torchao's).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

__all__ = ["element_index", "random_bits", "register_tensor_ids", "rounding_key",
           "stochastic_bf16", "stochastic_bf16_compiled", "tensor_id"]

MASK32 = 0xFFFFFFFF
ID_ATTR = "_meshfit_rounding_id"
"""Attribute a parameter carries: its stable id for the rounding's random bits."""


def register_tensor_ids(params: Iterable[torch.Tensor], start: int = 0) -> None:
    """Give each parameter its position in an optimizer's parameter order (from `start`) as
    its id, unless it has one: the first optimizer built over a tensor names it. ZeRO-1
    (`meshfit.parallel.zero1`) builds each rank's optimizer over a partition of the
    parameters of the optimizer it was given, which named them all first, so the ids stay
    those of one process; a resumed run builds its optimizer as the stopped one did."""
    for i, p in enumerate(params, start):
        if getattr(p, ID_ATTR, None) is None:
            setattr(p, ID_ATTR, i)


def tensor_id(p: torch.Tensor) -> int:
    """The id `register_tensor_ids` gave `p` (0 for a tensor no optimizer named)."""
    return getattr(p, ID_ATTR, None) or 0


def _splitmix64(x: int) -> int:
    """SplitMix64's output function (Steele, Lea & Flood 2014) on a Python int."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def rounding_key(seed: int, tensor: int, step: int) -> tuple[int, int]:
    """The 64-bit key of one tensor's rounding at one step, as two 32-bit halves."""
    key = _splitmix64(_splitmix64(_splitmix64(int(seed)) ^ int(tensor)) ^ int(step))
    return key & MASK32, key >> 32


def _mul32_(x: torch.Tensor, c: int) -> torch.Tensor:
    """x = (x * c) mod 2^32, in place, for int64 x in [0, 2^32): c taken as c - 2^32 when
    c >= 2^31 (the same residue), so that |product| < 2^63 never overflows."""
    return x.mul_(c - (1 << 32) if c >= 1 << 31 else c).bitwise_and_(MASK32)


def _fmix32_(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser, in place, on int64 values in [0, 2^32). (In place:
    on a CPU the eager step's time goes mostly to the pages of new tensors.)"""
    h ^= h >> 16
    _mul32_(h, 0x85EBCA6B)
    h ^= h >> 13
    _mul32_(h, 0xC2B2AE35)
    h ^= h >> 16
    return h


def random_bits(index: torch.Tensor, key_lo, key_hi) -> torch.Tensor:
    """16 random bits (int64 in [0, 2^16)) per element index (int64 >= 0) under a key (ints
    or 0-d int64 tensors: a compiled step takes tensors so that a new step does not
    recompile)."""
    h = _fmix32_((index & MASK32) ^ key_lo)
    h ^= index >> 32
    h ^= key_hi
    return _fmix32_(h) >> 16


def element_index(local_shape: Sequence[int], offset: Sequence[int],
                  global_shape: Sequence[int], device=None) -> torch.Tensor:
    """Index in the whole flattened (row-major) tensor of shape `global_shape` of each
    element of a block of shape `local_shape` starting at `offset` (int64, `local_shape`)."""
    index = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for dim in reversed(range(len(global_shape))):
        along = torch.arange(offset[dim], offset[dim] + local_shape[dim], dtype=torch.int64,
                             device=device) * stride
        index = index + along.view(-1, *([1] * (len(global_shape) - 1 - dim)))
        stride *= global_shape[dim]
    return index.expand(tuple(local_shape))


def stochastic_bf16(x: torch.Tensor, index: torch.Tensor, key_lo, key_hi) -> torch.Tensor:
    """fp32 `x` rounded stochastically to bf16 with the bits of `random_bits(index, key)`.

    Adding 16 uniform bits r to the fp32 bit pattern carries into the kept bits (rounds away
    from zero: the pattern is sign and magnitude) exactly when r >= 2^16 - fraction, with
    probability fraction / 2^16; then the dropped bits are cleared (torchao's "slightly
    faster" alternative). In int64, where the one pattern that can carry past bit 31, a NaN,
    is taken back from `x`."""
    bits = random_bits(index, key_lo, key_hi)
    bits += x.view(torch.int32)
    rounded = bits.bitwise_and_(-0x10000).to(torch.int32).view(torch.float32)
    return torch.where(x.isnan(), x, rounded).bfloat16()


_COMPILED: list = []


def stochastic_bf16_compiled(x: torch.Tensor, index: torch.Tensor, key_lo: int,
                             key_hi: int) -> torch.Tensor:
    """`stochastic_bf16` compiled once for every shape (flattened, dynamic shapes; the key as
    tensors so that a new step does not recompile): the same bits and result, integer
    arithmetic being exact, in one pass instead of ~25."""
    if not _COMPILED:
        _COMPILED.append(torch.compile(stochastic_bf16, dynamic=True, fullgraph=True))
    keys = (torch.tensor(key_lo, device=x.device), torch.tensor(key_hi, device=x.device))
    return _COMPILED[0](x.reshape(-1), index.reshape(-1), *keys).view(x.shape)
