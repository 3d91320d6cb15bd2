"""AdamW with smaller states: both moments in bf16 (4 B/param), 8-bit or 4-bit (torchao).

    adamw_bf16_states  AdamWBf16States: exp_avg and exp_avg_sq stored in bf16, 2 + 2 B per
                       element (half of AdamW's 8), the footprint torchtitan reaches with
                       bf16 optimizer states under FSDP2.
    adamw_8bit         torchao's AdamW8bit (Dettmers et al. 2022, block-wise dynamic 8-bit
                       codes, one fp32 scale per 256): ~2 B.
    adamw_4bit         torchao's AdamW4bit (Li et al. 2023, "Memory Efficient Optimizers with
                       4-bit States": 4-bit codes, one fp32 scale per 128): ~1 B.

All three round bf16 weights stochastically (``bf16_stochastic_round=True``, the default):
a bf16 weight is updated in fp32 and rounded back to bf16 away from zero with the
probability given by the 16 dropped bits, so that updates smaller than half a bf16 ulp are
kept in expectation instead of lost. The random bits are meshfit's, not torchao's
(`meshfit.optim.rounding`): a pure function of the run's ``rounding_seed`` (0 unless given;
kept in the param groups, so a checkpoint saves and restores it), the tensor's step count,
its position in the optimizer's parameter order and the element's index in the whole
tensor. It applies only to bf16 parameters (meshfit's fp32 masters are updated in fp32 and
stored as they are); ``bf16_stochastic_round=False`` rounds to nearest.

**Sharded (ZeRO-1/2/3) equals one process.** The step is element-wise except for the block
scales of the quantized states (the largest magnitude of a block of 256 or 128 consecutive
elements of the flattened tensor). ZeRO-1 (`meshfit.parallel.zero1`) gives each rank whole
parameters: the same blocks. FSDP2 (ZeRO-2/3) shards dim 0, each rank holding a contiguous
range of the flattened tensor; its blocks are the single process's blocks exactly when every
shard's length is a multiple of the block size (then every shard starts on a block boundary
too), e.g. any row split of a matrix whose rows are a multiple of 256 (128) elements. (Other
placements, tensor parallel's column shards or dim 0 sharded over two mesh dimensions, are
not checked and keep plain fp32 moments, listed by `unaligned`: there the run differs from
one process by the quantization error of the moments, ~1e-3 in the weights after 4 steps at
lr 1e-2, not by summation order alone.) The optimizers `quantized_adamw` builds decide
*whether* a tensor's state is quantized on the whole tensor (torchao decides on the local
shard: a 4096-element matrix sharded over two ranks would keep fp32 moments there and 8-bit
ones on one process), and quantize a shard with its own blocks where they are the whole
tensor's blocks. Where some dim-0 shard's length is not a multiple of the block size, every
rank of that tensor keeps its moments in fp32 holding exactly the values one process's
quantized state dequantizes to, the blocks that straddle two ranks scaled by their maximum
over both (`meshfit.optim.edge_blocks`: one small all-gather per such tensor and step): equal
to one process, at fp32's 8 B/param for those tensors (`unaligned` lists them).
Stochastic rounding gives an element the same random bits on whichever rank holds it (any
placement: FSDP2's dim-0 shards, ZeRO-1's whole tensors, tensor parallel's columns), so from
the same gradients bf16 weights under ZeRO-1/2/3 equal one process bit for bit. (torchao's
own rounding draws from each rank's generator over its shard: equal only in distribution.)
A bf16 model's gradients themselves differ by layout -- each rank's backward rounds its
partial sums to bf16 before they are reduced -- and the update is computed in fp32 from
them, so an element whose fp32 result differs by layout is rounded to the other neighbour
where its random threshold lies between the two results (a share of the elements about
their difference in ulps; measured on the tiny GPT under ZeRO-2 after one step: 0.2% of the
weights, as with round to nearest, against 33% with torchao's rounding); that difference is
the gradients', not the rounding's. torchao computes the update in fp32 whatever the
parameter's dtype: float64 parameters are rounded to fp32 values by each step.

**Checkpoints.** DCP (`meshfit.checkpoint`) writes torchao's states as the tensor subclass
they are (its metadata names their dequantized shape and dtype) and loads them by copying
codes and scales: exact. A dequantized copy would not be: quantizing it again moves a block
whose largest magnitude is negative (the signed maps' most negative codes are -0.993 for
8 bits and -0.887 for 4, their largest +1) to another scale and other codes.
`AdamWBf16States.load_state_dict` casts the moments back to bf16 (torch's loading casts
every state to the parameter's dtype); the quantized optimizers' `load_state_dict` takes the
fp32 moments of a shard that cuts blocks back as saved (a bf16 parameter's cast would round
them).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from meshfit._compat import dynamo as dynamo_internals
from meshfit._compat.dcp import local_shape_and_offset
from meshfit._quiet import quiet_logs
from meshfit._torchao import torchao_error
from meshfit.distributed.tensors import local_tensor
from meshfit.optim.edge_blocks import cuts_blocks, requantize_
from meshfit.optim.rounding import (element_index, register_tensor_ids, rounding_key,
                                    stochastic_bf16, stochastic_bf16_compiled, tensor_id)

__all__ = ["AdamWBf16States", "quantized_adamw", "unaligned"]

QUANTIZE_MIN_NUMEL = 4096
"""Tensors with fewer elements keep fp32 moments (bitsandbytes' and torchao's threshold)."""


class AdamWBf16States(torch.optim.Optimizer):
    """AdamW (Loshchilov & Hutter 2019) with both moments stored in bf16.

    Each step, per parameter, in fp32 (in float64 for float64 parameters):

        m = float(m_bf16) + (1 - beta1) * (g - float(m_bf16))       (torch's lerp)
        v = beta2 * float(v_bf16) + (1 - beta2) * g * g
        p = p * (1 - lr * weight_decay)
        p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
        m_bf16, v_bf16 = bf16(m), bf16(v)       (round to nearest, ties to even)

    The update uses the fp32 moments of this step, before they are rounded; only what is
    carried to the next step is rounded (as torchao keeps a high-precision copy for the
    update). So one step equals `torch.optim.AdamW`'s from the same (rounded) moments bit
    for bit, and the whole run equals AdamW whose moments are rounded to bf16 after every
    step (tests/optim/test_low_precision_states.py). Rounding the moments to nearest is
    deterministic and element-wise: a sharded run rounds each element as one process does.

    bf16 keeps 8 significant bits: a change under half an ulp (2^-9 to 2^-8 relative) is
    rounded away. With beta2 = 0.999 (torch's default) the second moment's decay per step,
    0.1% relative, is below that: where the gradients vanish v stays where it was instead of
    decaying. beta2 = 0.95 (meshfit's [optim] default) decays 5% a step and is not affected
    (tests/optim/test_low_precision_states.py).

    A bf16 weight is updated in fp32 and rounded back stochastically (as torchao's 8-bit and
    4-bit AdamW do, with the same layout-independent bits: module docstring), or to nearest
    with ``bf16_stochastic_round=False``. ``compile=True`` compiles that rounding (once, for
    every shape; the same bits): on a CPU the step with it takes 3.2x the step rounding to
    nearest, eager 5.0x (~25 int64 passes per element, without 64-bit vector multiplies;
    benchmarks/stochastic_rounding.py).
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, bf16_stochastic_round: bool = True,
                 rounding_seed: int = 0, compile: bool = True) -> None:
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas={betas!r} must each be in [0, 1), e.g. (0.9, 0.95)")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps,
                                  "weight_decay": weight_decay,
                                  "rounding_seed": int(rounding_seed)})
        # (as torchao's: attributes, and in `defaults` for ZeRO-1's rebuild, not in the
        # param groups that a checkpoint restores over what the resumed run asked for)
        self.bf16_stochastic_round, self.compile = bool(bf16_stochastic_round), bool(compile)
        self.defaults.update(bf16_stochastic_round=self.bf16_stochastic_round,
                             compile=self.compile)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        _name_tensors(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loading casts every state tensor but `step` to its parameter's dtype; the
        moments go back to bf16 (exactly: a bf16 checkpoint's values are bf16 values), or
        are rounded to it where the checkpoint holds fp32 moments (another AdamW's)."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state and state[key].dtype != torch.bfloat16:
                    state[key] = state[key].to(torch.bfloat16)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    # zeros_like keeps a DTensor's mesh and placements: the states shard as
                    # the parameter does and DCP saves them by parameter name.
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16)
                state["step"] += 1
                _bf16_states_update(local_tensor(p), local_tensor(p.grad),
                                    local_tensor(state["exp_avg"]),
                                    local_tensor(state["exp_avg_sq"]),
                                    step=float(state["step"]),
                                    rounding=self._rounding(group, p, int(state["step"])),
                                    **_hyper(group))
        return loss

    def _rounding(self, group: dict, p: torch.Tensor, step: int):
        """How bf16 `p`'s fp32 result at `step` is rounded: stochastically with counter-based
        bits (compiled with ``compile``), or None: to nearest."""
        if not (self.bf16_stochastic_round and p.dtype is torch.bfloat16):
            return None
        index = _index(p)
        key = rounding_key(group.get("rounding_seed", 0), tensor_id(p), step)
        if self.compile:
            return lambda w: stochastic_bf16_compiled(w, index, *key)
        return lambda w: stochastic_bf16(w, index, *key)


def _name_tensors(optimizer: torch.optim.Optimizer) -> None:
    """Stable ids for the rounding's random bits (`meshfit.optim.rounding`): the position of
    each parameter of the group just added in the optimizer's order."""
    start = sum(len(group["params"]) for group in optimizer.param_groups[:-1])
    register_tensor_ids(optimizer.param_groups[-1]["params"], start)


def _block(p: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offset of this rank's part of `p` in the whole tensor, the whole tensor's shape)."""
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        return local_shape_and_offset(p)[1], tuple(p.shape)
    return (0,) * p.dim(), tuple(p.shape)


def _index(p: torch.Tensor) -> torch.Tensor:
    """Each local element's index in the whole flattened `p` (`element_index`)."""
    offset, shape = _block(p)
    local = local_tensor(p)
    return element_index(local.shape, offset, shape, local.device)


def _hyper(group: dict) -> dict[str, float]:
    lr = group["lr"]
    return {"lr": float(lr), "beta1": group["betas"][0], "beta2": group["betas"][1],
            "eps": group["eps"], "weight_decay": group["weight_decay"]}


def _bf16_states_update(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                        exp_avg_sq: torch.Tensor, *, step: float, lr: float, beta1: float,
                        beta2: float, eps: float, weight_decay: float,
                        rounding: Callable | None = None) -> None:
    """One AdamW step of one (local) tensor; the ops and their order are torch's
    single-tensor AdamW's, so that fp32 moments would give its result bit for bit. A bf16
    `p` gets ``rounding(fp32 result)`` (`_rounding`), or the result rounded to nearest."""
    work = torch.promote_types(p.dtype, torch.float32)
    g = grad.to(work)
    m = exp_avg.to(work).lerp_(g, 1 - beta1)
    v = exp_avg_sq.to(work).mul_(beta2).addcmul_(g, g, value=1 - beta2)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    w = p if p.dtype == work else p.to(work)
    w.mul_(1 - lr * weight_decay)
    denom = (v.sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
    w.addcdiv_(m, denom, value=-lr / (1 - beta1 ** step))
    if w is not p:
        p.copy_(w if rounding is None else rounding(w))


# ------------------------------------------------------------------------ torchao 8/4-bit
def quantized_adamw(bits: int, groups: list[Any], **kwargs: Any) -> torch.optim.Optimizer:
    """torchao's AdamW8bit (bits=8) or AdamW4bit (bits=4) with meshfit's choice of which
    tensors are quantized (module docstring) and ``bf16_stochastic_round=True``; `kwargs`
    go to the constructor (block_size=, bf16_stochastic_round=, ...)."""
    name = f"optimizer='adamw_{bits}bit'"
    if importlib.util.find_spec("torchao") is None:
        extra = " (or bitsandbytes on CUDA)" if bits == 8 else ""
        raise ValueError(f"{name} needs torchao{extra}, which is not installed; "
                         'pip install "meshfit[optim]"')
    try:
        with quiet_logs():
            from torchao.optim import AdamW4bit, AdamW8bit  # step compiles on first use
    except ImportError as err:  # installed, but a release made for another torch
        raise torchao_error(name, err) from None
    base = AdamW8bit if bits == 8 else AdamW4bit
    if not callable(getattr(base, "_subclass_zeros", None)):  # what `_new_buffer` builds on
        raise torchao_error(name, AttributeError(f"{base.__name__} has no _subclass_zeros: "
                                                 "a torchao this meshfit was not made for"))
    cls = _QUANTIZED.get(base)
    if cls is None:
        cls = _QUANTIZED[base] = type(f"Quantized{base.__name__}", (_LayoutExact, base),
                                      {"__module__": __name__, "bits": bits})
    return cls(groups, **{"bf16_stochastic_round": True, **kwargs})


_QUANTIZED: dict[type, type] = {}


class _LayoutExact:
    """Mixed in before torchao's AdamW8bit / AdamW4bit: the constructor's block_size,
    bf16_stochastic_round and compile go into `defaults` (ZeRO-1 rebuilds the optimizer from
    its class and defaults), `_new_buffer` decides on the whole tensor (module docstring),
    and `step` runs torchao's per-tensor update on this rank's local tensors: the same
    plain-tensor graph for a shard as for a whole tensor (torchao hands the compiler the
    DTensors, which dynamo in torch 2.13 fails to trace there). `compile=False` runs that
    update eagerly: the same operations without inductor's fusion (results may differ from
    the compiled ones in the last bit; no compile per shape, which takes seconds each on a
    CPU)."""

    def __init__(self, params, *args, compile: bool = True, rounding_seed: int = 0,
                 **kwargs) -> None:
        super().__init__(params, *args, **kwargs)
        self.compile = compile
        self.defaults.update(block_size=self.block_size, compile=compile,
                             bf16_stochastic_round=self.bf16_stochastic_round,
                             rounding_seed=int(rounding_seed))
        for group in self.param_groups:  # (a checkpoint saves and restores the groups)
            group.setdefault("rounding_seed", int(rounding_seed))
        self.unaligned: list[tuple[int, ...]] = []

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        _name_tensors(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loading casts every state tensor to its parameter's dtype (torchao's states
        change only their appearance); the fp32 moments of a shard that cuts the blocks
        (`meshfit.optim.edge_blocks`) of a bf16 parameter would be rounded to bf16, so they
        are taken back from the checkpoint as they were saved."""
        saved = state_dict.get("state", {})
        ids = [i for group in state_dict.get("param_groups", []) for i in group["params"]]
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        for i, p in zip(ids, params):
            if not (_quantized_whole(p, self.block_size) and cuts_blocks(p, self.block_size)):
                continue
            for key, value in saved.get(i, {}).items():
                if key != "step" and getattr(value, "dtype", None) is torch.float32:
                    self.state[p][key] = value.to(device=p.device)

    @torch.no_grad()
    def step(self, closure=None):
        from torchao.optim.adam import single_param_adam

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        update, rounded = single_param_adam, _adam_rounded
        if self.compile:
            update, rounded = (torch.compile(f, fullgraph=True, dynamic=False)
                               for f in (update, rounded))
        with dynamo_internals.unlimited_recompiles():
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self._step_one(update, rounded, group, p)
        return loss

    def _step_one(self, update, rounded, group: dict, p: torch.Tensor) -> None:
        state = self.state[p]
        if not state:  # torchao's state: a float step, the moments as its subclass or fp32
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = self._new_buffer(p, True)
            state["exp_avg_sq"] = self._new_buffer(p, False)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = self._new_buffer(p, False)
        state["step"] += 1
        if not isinstance(group["lr"], torch.Tensor):
            raise TypeError(f"lr={group['lr']!r}: torchao's AdamW keeps lr as a tensor; set "
                             "it in place, optimizer.param_groups[i]['lr'].fill_(value)")
        most = state.get("max_exp_avg_sq")
        args = (local_tensor(p.grad), state["step"], local_tensor(state["exp_avg"]),
                local_tensor(state["exp_avg_sq"]), None if most is None else local_tensor(most),
                group["lr"], group["betas"][0], group["betas"][1], group["weight_decay"],
                group["eps"])
        if not (self.bf16_stochastic_round and p.dtype is torch.bfloat16):
            update(local_tensor(p.detach()), *args, True, False)
            self._requantize(p, state)
            return
        # torchao's update without its rounding (which draws from this rank's generator),
        # then meshfit's, whose bits depend on the element's place in the whole tensor
        key = rounding_key(group.get("rounding_seed", 0), tensor_id(p), int(state["step"]))
        offset, shape = _block(p)
        rounded(local_tensor(p.detach()), *args,
                *(torch.tensor(k, device=p.device) for k in key),
                offset=offset, shape=shape)
        self._requantize(p, state)

    def _requantize(self, p: torch.Tensor, state: dict) -> None:
        """A dim-0 shard that cuts the whole tensor's blocks: its fp32 moments replaced by
        one process's dequantized ones (`meshfit.optim.edge_blocks`)."""
        if not (_quantized_whole(p, self.block_size) and cuts_blocks(p, self.block_size)):
            return
        moments = [(local_tensor(state[key]), self._qmap(key == "exp_avg"))
                   for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if key in state]
        if all(type(m) is torch.Tensor for m, _ in moments):
            requantize_(p, moments, self.block_size, self.bits)

    def _qmap(self, signed: bool) -> torch.Tensor:
        """The quantization map torchao's state of this kind holds (signed: first moment)."""
        return self._subclass_zeros(torch.zeros(self.block_size), signed, self.block_size).qmap

    def _new_buffer(self, p: torch.Tensor, signed: bool):
        from torch.distributed.tensor import DTensor

        local = local_tensor(p)
        whole = _quantized_whole(p, self.block_size)
        cut = whole and cuts_blocks(p, self.block_size)
        if whole and not cut and _whole_blocks(p, local, self.block_size):
            out = self._subclass_zeros(local, signed, self.block_size)
        else:
            if whole and signed and local.numel():  # (once per tensor: exp_avg is first)
                self.unaligned.append(tuple(p.shape))
            # (one process's dequantized values are fp32 whatever the weight's dtype)
            out = torch.zeros_like(local, dtype=torch.float32 if cut else local.dtype)
        if isinstance(p, DTensor):  # as torchao's: shards of uneven length need the shape
            out = DTensor.from_local(out, device_mesh=p.device_mesh, placements=p.placements,
                                     run_check=False, shape=p.shape, stride=p.stride())
        return out.to(p.device)


def _adam_rounded(p: torch.Tensor, grad, step, exp_avg, exp_avg_sq, most, lr, beta1: float,
                  beta2: float, weight_decay: float, eps: float, key_lo: torch.Tensor,
                  key_hi: torch.Tensor, *, offset: tuple[int, ...], shape: tuple[int, ...]):
    """torchao's AdamW step of bf16 `p` (this rank's block at `offset` of a tensor of
    `shape`) computed on an fp32 copy, rounded back stochastically with counter-based bits
    (`meshfit.optim.rounding`). One function, so that a compiled step fuses the update, the
    bits and the rounding in one pass as torchao's does (the element indices and random
    words are never stored)."""
    from torchao.optim.adam import single_param_adam

    work = p.float()
    single_param_adam(work, grad, step, exp_avg, exp_avg_sq, most, lr, beta1, beta2,
                      weight_decay, eps, True, False)
    index = element_index(p.shape, offset, shape, p.device)
    p.copy_(stochastic_bf16(work, index, key_lo, key_hi))


def _quantized_whole(p: torch.Tensor, block: int) -> bool:
    """Whether one process quantizes `p`'s moments (torchao's rule, on the whole tensor)."""
    return p.numel() >= QUANTIZE_MIN_NUMEL and p.numel() % block == 0


def _whole_blocks(p: torch.Tensor, local: torch.Tensor, block: int) -> bool:
    """Whether this rank's part of `p` (a whole tensor's block count a multiple of `block`)
    is made of the whole tensor's blocks. A plain tensor is the whole tensor. A DTensor
    sharded on dim 0 over one mesh dimension (FSDP2's ZeRO-2/3; the other dimensions
    replicated) holds a contiguous range of the flattened tensor; the ranks before it hold
    equal lengths and the ranks after it hold the rest, so when its own length is a multiple
    of `block` so is its offset (the whole minus the ranks after, or a multiple of its own
    length). Any other placement (a column shard of tensor parallel, dim 0 sharded twice)
    holds strided or nested ranges that this rank alone cannot place: not counted as whole."""
    placements = getattr(p, "placements", None)
    if placements is not None:
        shards = [pl for pl in placements if not pl.is_replicate()]
        if len(shards) > 1 or any(not pl.is_shard(0) for pl in shards):
            return False
    return local.numel() > 0 and local.numel() % block == 0


def unaligned(optimizer: torch.optim.Optimizer) -> list[tuple[int, ...]]:
    """Shapes of the tensors whose shard on this rank keeps fp32 moments though one process
    would quantize them (the shard is not made of the whole tensor's blocks: `_whole_blocks`);
    empty for other optimizers and where every shard is."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local one
    return list(getattr(inner, "unaligned", []))
