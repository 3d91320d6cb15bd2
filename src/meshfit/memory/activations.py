"""Saved activations of one micro-batch on one rank, estimated before anything runs (the
activation terms of `meshfit.memory.estimate`).

**Activations**: the closed form of Korthikanti et al. (2022, "Reducing Activation
Recomputation in Large Transformer Models", eq. 1-4), written per saved tensor so that it
covers the model at hand. Per block and token, in elements (x the activation dtype's bytes,
b x s tokens):

    norms           2h                    (the inputs of the two norms)
    attention       h + (h + 2·kv) + h    (q/k/v input, q, k, v, the attention output)
                    + a·s scores          only for the math kernel (flash/efficient save
                                          4 B x a of log-sum-exp instead; with dropout,
                                          its output a·s and mask a·s bytes too)
    MLP             h + 2f (GELU)  or  h + 4f (SwiGLU: gate, its SiLU, up, product)
    dropout masks   2h bytes (the two residual dropouts) when dropout > 0

For GPT-2's shape (f = 4h, kv = h, dropout, math attention, 2-byte activations) this is
the paper's 34·s·b·h + 5·a·s²·b bytes. Tensor parallel t divides everything but the norm
inputs, the two linear inputs and the dropout masks (the paper's 10·s·b·h replicated) by t.
Sequence parallel divides the norm inputs and the masks too, but in `estimate` not the two
linear inputs: torch's SequenceParallel (what meshfit runs) all-gathers a block's
sequence-sharded input before the column-parallel linears and autograd saves the gathered
tensor (measured in tests/memory/test_estimate_measured.py); the paper's eq. 4 assumes
Megatron-LM, which saves the shard and gathers again in backward (`activation_bytes`'s
default, ``gathered_linear_inputs=False``, gives that form). Full checkpointing keeps each block's
input (h) and recomputes one block at a time in backward (one block's activations more at
the peak); "selective" (meshfit's default policy: every 2nd block) keeps the inputs of half
the blocks.
Outside the blocks, on the last stage: the final norm's and the head's inputs (2h) and the
loss (3V fp32 elements per token, / t under loss_parallel; below).

**Context parallel** (cp, `meshfit.parallel.cp`): each rank holds seq_len / cp of every
sequence, so every activation above is of those tokens; the ring's attention saves q, k, v,
its output (in fp32 under bf16/fp16) and the fp32 log-sum-exp, never the score matrix,
whatever the kernel asked for; during a block's attention backward the ring holds two blocks
of keys and values, the accumulators of their gradients and the queries' gradient
(`_ring_bytes`), after the head's backward has freed the loss's tensors (so only what the
ring needs beyond those counts). Under ZeRO the states are sharded over dp_shard x cp (`LayoutCosts`).

**Memory-budget checkpointing** ("budget", a share b): torch.compile's min-cut partitioner
keeps each block's input and b of the rest of its activations, and recomputes the other
1 - b in the backward (an estimate: the partitioner chooses per graph what to keep).

**Activation offload** (`activation_offload`, `meshfit.parallel.activation_offload`): what
the blocks keep from forward to backward (after checkpointing) is in host memory instead, of
every micro-batch in flight; the device holds two blocks' worth of it (the block in use and
the one being copied in or out), besides what stays (outside the blocks, the recompute).

Pipelines hold several micro-batches at once on their first stage (Narayanan et al. 2021):
GPipe all m of them, 1F1B min(m, p), interleaved 1F1B p·(1 + (p-1)/(p·v)) stage-chunks,
zero-bubble (ZB-V) min(m, p).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from meshfit.memory.shape import ModelShape
from meshfit.parallel.spec import LayoutSpec

__all__ = ["ActivationBytes", "DTYPE_BYTES", "activation_bytes", "in_flight",
           "peak_activations", "ring_bytes"]

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class ActivationBytes:
    """Saved activations of one micro-batch on one rank, by part (bytes)."""

    per_block: float
    blocks: float
    outside: float
    recompute_peak: float
    host: float = 0.0
    """Saved activations in host memory (activation offload: `peak_activations`)."""

    @property
    def total(self) -> float:
        return self.blocks + self.outside + self.recompute_peak


def _block_elements(shape: ModelShape, seq_len: int, attention: str) -> dict[str, float]:
    """What one block saves per token: elements in the activation dtype that tensor
    parallel keeps whole ("replicated": the norm inputs, "linear_inputs") or splits
    ("split"), and raw bytes of masks and log-sum-exp likewise ("replicated_bytes",
    "split_bytes")."""
    h, f, kv, a = shape.d_model, shape.d_ff, shape.kv_dim, shape.n_head
    out = {"replicated": 2 * h, "linear_inputs": h + h,  # norm inputs; attention, MLP input
           "split": (h + 2 * kv) + h + (4 * f if shape.gated_mlp else 2 * f),
           "replicated_bytes": 0.0, "split_bytes": 0.0}
    if attention == "math":
        out["split"] += a * seq_len  # softmax output
        if shape.dropout:
            out["split"] += a * seq_len  # dropout output
            out["split_bytes"] += a * seq_len  # its mask
    else:
        out["split_bytes"] += 4 * a  # flash / efficient: fp32 log-sum-exp per head
    if shape.dropout:
        out["replicated_bytes"] += 2 * h  # masks of the two residual dropouts
    return out


def activation_bytes(shape: ModelShape, layout: LayoutSpec, *, seq_len: int,
                     dtype: str = "fp32", attention: str = "flash",
                     blocks_on_rank: int | None = None,
                     gathered_linear_inputs: bool = False,
                     autocast: bool = False) -> ActivationBytes:
    """Saved activations of one micro-batch of `layout.micro_batch_size` sequences on one
    rank (the closed form of the module docstring). `attention`: "flash" (or "efficient",
    "cudnn": no score matrix saved) or "math". `gathered_linear_inputs` (`estimate` passes
    True): under sequence parallel the attention and MLP inputs are saved all-gathered, as
    torch's SequenceParallel does, not sharded (the paper's eq. 4). `autocast` (`estimate`
    passes it for bf16/fp16): fp32 residual stream and per-projection casts, as the module
    docstring says; off, every activation is in `dtype` as in the paper."""
    act = DTYPE_BYTES[dtype]
    residual = 4 if autocast and act < 4 else act
    t, sp = layout.tp, layout.sequence_parallel
    tokens = layout.micro_batch_size * seq_len // layout.cp  # this rank's (context parallel)
    e = _block_elements(shape, seq_len, "flash" if layout.cp > 1 else attention)
    h = shape.d_model
    if layout.cp > 1 and act < 4:  # the ring keeps its output in fp32 for backward
        e["split_bytes"] += h * (4 - act)
    if autocast and act < 4:
        e["replicated_bytes"] += 2 * h * (residual - act)  # norm inputs in fp32
        e["linear_inputs"] += 2 * h + (h if shape.gated_mlp else 0)  # per-projection casts
    per_token = ((e["replicated"] * act + e["replicated_bytes"]) / (t if sp else 1)
                 + e["linear_inputs"] * act / (t if sp and not gathered_linear_inputs else 1)
                 + (e["split"] * act + e["split_bytes"]) / t)
    per_block = per_token * tokens
    n = blocks_on_rank if blocks_on_rank is not None else math.ceil(shape.n_layer / layout.pp)
    block_input = shape.d_model * residual * tokens / (t if sp else 1)
    mode = layout.activation_checkpointing
    if mode == "full":
        blocks, recompute = n * block_input, per_block
    elif mode == "budget":  # the partitioner keeps `budget` of what it may drop
        kept = layout.activation_checkpointing_budget * (per_block - block_input)
        budget = layout.activation_checkpointing_budget  # (0: full's recompute, 1: none)
        blocks, recompute = n * (block_input + kept), (1 - budget) * per_block
    elif mode == "selective":
        kept = n - n // 2  # every 2nd block checkpointed
        blocks, recompute = kept * per_block + (n // 2) * block_input, per_block if n > 1 else 0
    else:
        blocks, recompute = n * per_block, 0.0
    outside = _head_bytes(shape, layout, tokens, act, residual) if layout.pp == 1 else 0.0
    return ActivationBytes(per_block=per_block, blocks=blocks, outside=outside,
                           recompute_peak=recompute)


def _head_bytes(shape: ModelShape, layout: LayoutSpec, tokens: int, act: int,
                residual: int) -> float:
    """The last stage's activations outside the blocks (see the module docstring)."""
    t = layout.tp
    inputs = shape.d_model * (residual + act) * tokens / (t if layout.sequence_parallel else 1)
    return inputs + 3 * shape.vocab_size * 4 * tokens / (t if layout.loss_parallel else 1)


def in_flight(layout: LayoutSpec) -> float:
    """Micro-batches (in units of one stage's activations) the first pipeline stage holds."""
    p, m, v = layout.pp, layout.microbatches, layout.virtual_stages
    if p == 1:
        return 1.0
    if layout.schedule == "gpipe":
        return float(m)
    if layout.schedule == "interleaved_1f1b":
        return min(m, p) * (1 + (p - 1) / (p * v))
    return float(min(m, p))


def ring_bytes(shape: ModelShape, layout: LayoutSpec, seq_len: int, dtype: str) -> float:
    """Context parallel's ring during one block's attention backward (the step's peak): the
    keys and values in use and the next ones arriving (2 x 2 kv, the activations' dtype), the
    accumulators of their gradients travelling with them (2 x 2 kv in fp32) and the queries'
    and the output's gradients (2 h in fp32), for this rank's tokens; 0 without cp."""
    if layout.cp == 1:
        return 0.0
    tokens = layout.micro_batch_size * seq_len // layout.cp
    kv, h = shape.kv_dim / layout.tp, shape.d_model / layout.tp
    act, acc = DTYPE_BYTES[dtype], 4
    return tokens * (2 * 2 * kv * act + 2 * 2 * kv * acc + 2 * h * acc)


def peak_activations(shape: ModelShape, layout: LayoutSpec, blocks: int, seq_len: int,
                 dtype: str, attention: str) -> tuple[float, ActivationBytes]:
    """Peak saved activations of the worst rank, and their parts."""
    autocast = DTYPE_BYTES[dtype] < 4
    acts = activation_bytes(shape, layout, seq_len=seq_len, dtype=dtype, attention=attention,
                            blocks_on_rank=blocks, gathered_linear_inputs=True,
                            autocast=autocast)
    kept = acts.blocks  # what the blocks keep on the device from forward to backward
    if layout.activation_offload:  # all in host memory; two blocks' worth on the device
        n = blocks if blocks else 1
        kept = min(n, 2) * acts.blocks / n
        acts = dataclasses.replace(acts, host=acts.blocks * in_flight(layout))
    activations = kept * (1.0 if layout.activation_offload else in_flight(layout)) \
        + acts.outside + acts.recompute_peak
    if layout.pp > 1:  # the last stage's head and loss, when it is the worst rank
        residual = 4 if autocast else DTYPE_BYTES[dtype]
        head = _head_bytes(shape, layout, layout.micro_batch_size * seq_len // layout.cp,
                           DTYPE_BYTES[dtype], residual)
        activations = max(activations, kept + acts.recompute_peak + head)
    return activations, acts


