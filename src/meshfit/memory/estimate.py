"""Per-rank memory of a training step, estimated before anything runs.

    est = estimate(ModelShape.of("llama-7b"), LayoutSpec(dp_shard=8, zero_stage=3,
                   micro_batch_size=1), seq_len=4096, dtype="bf16", optimizer="adamw")
    est.per_rank_bytes      # {"params", "grads", "optimizer", "activations", "buffers", "total"}

**Model states** (what `meshfit.memory.rank_report` measures): parameters and gradients in
fp32 (meshfit keeps fp32 master weights; bf16/fp16 is autocast, or FSDP2's parameter dtype
for the gathered copies), optimizer state per parameter (`OPTIMIZER_BYTES`): AdamW 8 B,
AdamW with bf16 moments 4 B, 8-bit AdamW 2.03 B, 4-bit AdamW 1.06 B, SGD (momentum) 4 B,
Adafactor ~0 (factored row/column statistics: (rows + cols) x 4 B per matrix, counted
exactly from the shape). A rank holds: tensor parallel's share
(`ModelShape.tp_split` split t ways, the rest whole), the worst pipeline stage's blocks
(ceil(L/p) blocks, plus the embedding on the first or the final norm and head on the last,
whichever is larger), then the data-parallel engine's share (`meshfit.parallel.layout.
LayoutCosts`: parameters / dp_shard under FSDP2, gradients / dp_shard from stage 2,
optimizer state / dp_shard from stage 1; nothing on the device with CPU offload).

**Expert parallelism** (`LayoutSpec.ep`, a divisor of dp_shard, carved out of it and not
part of the world size; `meshfit.parallel.ep`): the routed experts (`ModelShape.
expert_params`) are split over the ep ranks, each holding n_experts / ep of every MoE
block's, and FSDP2 shards those over the ranks holding the same experts
(`Layout.expert_fsdp_mesh`): the dp_shard / ep ranks (replicated over dp_replicate: HSDP),
or with ep = dp_shard the dp_replicate ranks (a 1-D mesh); with ep = dp_shard and no
dp_replicate FSDP2 leaves them out (whole on their rank, never gathered, not offloaded).
So the experts' parameters, gradients and optimizer state are divided by ep and then by
that group where the engine shards the state; everything else as without ep. Under
meshfit's engine (FSDP2 whenever ep > 1) a rank's experts at rest are 1/dp_shard of them for
every ep, as without ep at ZeRO-2/3; what ep changes there is the step: FSDP2 gathers only
this rank's experts (the buffers below: one block's experts / ep, none when left out), and
at stage 1 the engine (FSDP2 instead of ZeRO-1's whole parameters and gradients).
`model_state_bytes(..., ep=, expert_params=)` is the same split on the ZeRO paper's formula
(1/dp in all where a stage shards). The activations of an MoE block are counted as a dense
MLP of width d_ff (not yet its top_k experts' and the routing's tensors).

**Adapters** (`Adapters`: LoRA/QLoRA, `meshfit.peft`): the base is frozen, so gradients and
optimizer state exist for the adapters alone (their share of every rank's parameters, spread
over the blocks like the linears they adapt); QLoRA's quantized base linears are held in
4-bit NF4, `NF4_BYTES` per weight (4 + 8/64 + 32/(64·256) bits: the 4-bit codes, one 8-bit
scale per 64 values, one fp32 factor per 256 scales), gathered in that form by FSDP2 and
dequantized one linear at a time in forward and backward (no low-precision copy is kept
from forward to backward). The adapters' own activations (the rank-r intermediate of each
adapted linear) are not counted: r/d of a block's linear inputs.

**Activations** (`meshfit.memory.activations`): Korthikanti et al.'s closed form per saved
tensor, context parallel's share and ring, the micro-batches each pipeline schedule holds,
memory-budget checkpointing's share, and activation offload's move of the blocks' saved
activations from the device to the host (`host`).

**Buffers**: FSDP2's gathered parameters (stage 3: two blocks in the parameter dtype — the
current one and the prefetched next; stage 2 and replicate-only FSDP2: every block, held
from forward to backward) and the reduce-scatter output of one block's gradients; DDP's
buckets alias the gradients (`gradient_as_bucket_view`), so they cost nothing more.

Also counted, found by measuring (tests/memory/test_estimate_measured.py): the loss's
backward holds 3V fp32 per token (log-softmax output, its gradient and the logits'
gradient); FSDP2 under a pipeline accumulates the stage's gradients unsharded until the last
micro-batch (+ the stage's local parameters x 4 B of buffers); autocast (bf16/fp16 over fp32
masters) keeps the residual stream, the norm inputs and a checkpointed block's input in
fp32, casts the normed input once per projection (q, k, v; SwiGLU's gate and up), and keeps
low-precision copies of the weights from forward to backward when FSDP2 does not gather them
in low precision.

Known misses (measured there and in `benchmarks/planner.py`): allocator caching and
fragmentation on CUDA, temporaries inside one op (a matmul's output before it is saved) and
kernel workspaces; what one implementation saves beyond the closed form (norm statistics,
RMSNorm's normalized input, K/V repeated for grouped-query attention before the kernel,
transformers' GPT-2 GELU written out; a fused q|k|v projection casts its input once, not
three times), itemized in the test; zero-bubble pipelines' deferred weight-gradient inputs
(the estimate holds min(m, p) micro-batches: 27-35% low in the benchmark); FSDP2's padding
of dim 0 to a multiple of the shard count (+13% for GPT-2's states at 512 ranks).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from meshfit.memory.activations import (DTYPE_BYTES, ActivationBytes, activation_bytes, in_flight,
                                        peak_activations, ring_bytes)
from meshfit.memory.shape import ModelShape
from meshfit.optim.muon import BUCKET_ELEMENTS
from meshfit.parallel.layout import Layout
from meshfit.parallel.spec import LayoutSpec

__all__ = ["ActivationBytes", "Adapters", "BYTE_UNITS", "Estimate", "LayoutSpec", "NF4_BYTES",
           "activation_bytes", "byte_unit", "estimate", "model_state_bytes"]

OPTIMIZER_BYTES = {"adamw": 8.0, "adamw_fused": 8.0, "adamw_8bit": 2.03125, "sgd": 4.0,
                   "adafactor": 0.0,
                   "muon": 4.0,  # on Muon's matrices; AdamW's 8 on the rest (`_muon_rate`)
                   "adamw_bf16_states": 4.0,  # two bf16 moments
                   "adamw_4bit": 1.0625}  # two 4-bit codes, an fp32 scale per 128
"""Optimizer state per parameter element. The quantized rows count the codes and one fp32
scale per block of 256 (8-bit: 2 + 2 x 4/256) or 128 (4-bit: 1 + 2 x 4/128) elements, not
the lookup tables (1 KiB per 8-bit moment, 64 B per 4-bit one, per tensor) nor the fp32
moments of tensors under 4096 elements: on matrices of 256k elements or more (GPT-2 small's
are 590k) the live optimizer measures within 1.5% of these
(tests/optim/test_low_precision_states.py)."""
DISK_CHUNK_BYTES = 256 * 2**20
"""`meshfit.parallel.disk.DiskOffload`'s default chunk (of state read or written at once)."""
NF4_BYTES = (4 + 8 / 64 + 32 / (64 * 256)) / 8
"""Bytes per weight of QLoRA's NF4 with double quantization (Dettmers et al. 2023: 4.127
bits): what `meshfit.peft.qlora` stores through torchao."""


@dataclass(frozen=True, kw_only=True)
class Adapters:
    """LoRA adapters on a frozen base, as `estimate` counts them: parameter counts of the
    whole model (`meshfit.peft.lora` / `qlora`; `meshfit.train.fits.adapters_of` reads them
    from a model)."""

    trainable: int
    """Adapter parameters (they alone have gradients and optimizer state)."""
    quantized: int = 0
    """Base parameters held in 4 bits (QLoRA's linears; 0 for LoRA)."""

    def __post_init__(self) -> None:
        for name in ("trainable", "quantized"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Adapters.{name}={value!r} must be an integer >= 0")

    @classmethod
    def lora(cls, shape: ModelShape, r: int, *, quantized: bool = False) -> Adapters:
        """LoRA of rank `r` on what `meshfit.peft.lora` adapts by default: every linear layer
        inside the blocks (`ModelShape.block_linears`: q, k, v, o and the MLP's, or a fused
        q|k|v as the model has it), r x (in + out) each; with `quantized` (QLoRA) those
        linears' weights in 4 bits. Dense decoders only."""
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"r={r!r} must be an integer >= 1 (the LoRA rank)")
        if shape.expert_params or shape.active_params not in (None, shape.params):
            raise ValueError(f"{shape.name}: LoRA estimates cover dense models; a mixture of "
                             "experts' stacked expert weights are not linears peft adapts")
        if not shape.block_linears:
            raise ValueError(f"{shape.name}: no linear layer inside its blocks, which is what "
                             "LoRA adapts; the estimate covers models with linear projections")
        trainable = sum(r * (a + b) for a, b in shape.block_linears)
        weights = sum(a * b for a, b in shape.block_linears)
        return cls(trainable=trainable, quantized=weights if quantized else 0)

    def shares(self, params: int) -> tuple[float, float]:
        """(adapter parameters per base parameter, quantized share of the base)."""
        if self.quantized > params:
            raise ValueError(f"Adapters.quantized={self.quantized} exceeds the model's "
                             f"{params} parameters")
        return self.trainable / params, self.quantized / params


def model_state_bytes(n_params: float, dp: int = 1, zero_stage: int = 0, *,
                      optimizer: str = "adamw", precision: str = "mixed", ep: int = 1,
                      expert_params: float = 0) -> dict[str, float]:
    """The ZeRO paper's per-rank model states (Rajbhandari et al. 2020, Fig. 1): Ψ =
    `n_params` on `dp` data-parallel ranks, stage 0 (DDP) to 3; `expert_params` of them
    split over `ep` ranks (see the module docstring).

    precision="mixed": fp16/bf16 parameters and gradients (2 B each) and an fp32 master copy
    counted with the optimizer state (K = 12 for Adam: master, momentum, variance) — the paper's
    accounting: Ψ = 7.5e9, dp = 64 gives 120, 31.4, 16.6 and 1.9 GB. precision="fp32": 4 B
    parameters and gradients, the parameters their own master (K = 8 for Adam). `optimizer`:
    `OPTIMIZER_BYTES` of state per parameter (adafactor 0: its factored statistics are O(rows +
    cols)). Returns {"params", "grads", "optimizer", "total"} in bytes."""
    if precision not in ("mixed", "fp32"):
        raise ValueError(f"precision={precision!r} must be 'mixed' or 'fp32'")
    if optimizer not in OPTIMIZER_BYTES:
        raise ValueError(f"optimizer={optimizer!r} is not one of {', '.join(OPTIMIZER_BYTES)}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage!r} must be 0, 1, 2 or 3")
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp={dp!r} must be an integer >= 1")
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1 or dp % ep:
        raise ValueError(f"ep={ep!r} must be an integer >= 1 that divides dp={dp}")
    if not 0 <= expert_params <= n_params:
        raise ValueError(f"expert_params={expert_params!r} must be in [0, n_params={n_params}]")
    p = g = 2.0 if precision == "mixed" else 4.0
    k = OPTIMIZER_BYTES[optimizer] + (4.0 if precision == "mixed" else 0.0)

    def share(sharded: bool) -> float:
        if ep == 1:  # as written before expert parallelism, to the last bit
            return n_params / (dp if sharded else 1)
        return (n_params - expert_params) / (dp if sharded else 1) + \
            expert_params / (ep * (dp // ep if sharded else 1))

    out = {"params": share(zero_stage == 3) * p, "grads": share(zero_stage >= 2) * g,
           "optimizer": share(zero_stage >= 1) * k}
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """The estimate of one layout: bytes per rank, by part (the worst rank)."""

    layout: LayoutSpec
    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    host: float = 0.0
    """Bytes moved to host memory per rank (CPU offload of the states; activation offload's
    saved activations, ``detail["activations_on_host"]`` of them)."""
    disk: float = 0.0
    """Bytes of optimizer state in files per rank (offload="disk"), streamed through the
    step: about three chunks of it are in memory at a time (`meshfit.parallel.disk`)."""
    detail: dict = field(default_factory=dict)

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers

    @property
    def per_rank_bytes(self) -> dict[str, int]:
        return {"params": round(self.params), "grads": round(self.grads),
                "optimizer": round(self.optimizer), "activations": round(self.activations),
                "buffers": round(self.buffers), "total": round(self.total)}

    def to_json(self) -> dict:
        out = {"layout": self.layout.to_json(), "per_rank_bytes": self.per_rank_bytes}
        if self.disk:
            out["disk_bytes_per_rank"] = round(self.disk)
        return out


BYTE_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def byte_unit(estimates: Iterable[Estimate]) -> tuple[str, int]:
    """(name, bytes) of the unit a table of `estimates` reads in: the largest of GiB, MiB and
    KiB in which the biggest total is at least 1, as `meshfit plan` switches from GiB to MiB,
    so that a small model's cells do not all print as 0.00 GiB."""
    largest = max((e.total for e in estimates), default=0.0)
    return next(((n, b) for n, b in BYTE_UNITS if largest >= b), BYTE_UNITS[-1])


def _stage_params(shape: ModelShape, layout: LayoutSpec) -> tuple[float, int]:
    """Parameters on the worst pipeline rank (before TP/DP division), and its blocks."""
    p, v = layout.pp, max(layout.virtual_stages, 1)
    if p == 1:
        return float(shape.params), shape.n_layer
    chunk = math.ceil(shape.n_layer / (p * v))
    blocks = chunk * v
    ends = max(shape.first_params, shape.last_params)
    return float(blocks * shape.block_params + ends), blocks


def _stage_experts(shape: ModelShape, layout: LayoutSpec, blocks: int) -> float:
    """Routed-expert parameters among the worst pipeline rank's (`_stage_params`), before
    the ep split; 0 without expert parallelism."""
    if layout.ep == 1 or not shape.expert_params:
        return 0.0
    if layout.pp == 1:
        return float(shape.expert_params)
    return float(min(blocks, shape.moe_layers) * shape.block_expert_params)


def _expert_group(layout: LayoutSpec) -> int:
    """Under ep, the ranks FSDP2 shards one rank's experts over (see the module docstring);
    1 when no other rank holds them (FSDP2 leaves them out)."""
    inner = layout.dp_shard // layout.ep
    return inner if inner > 1 else layout.dp_replicate


def estimate(shape: ModelShape | str, layout: LayoutSpec, *, seq_len: int,
             dtype: str = "fp32", optimizer: str = "adamw",
             attention: str = "flash", adapters: Adapters | None = None) -> Estimate:
    """Per-rank bytes of `layout` training `shape` (a `ModelShape` or what
    `ModelShape.of` takes) on sequences of `seq_len` tokens with activations in `dtype`
    ("fp32", or "bf16"/"fp16" autocast) and `optimizer`; `adapters`: LoRA/QLoRA on the
    frozen base `shape` describes. The model states follow meshfit's engines
    (`meshfit.parallel.layout`); see the module docstring for every term."""
    if isinstance(shape, str):
        shape = ModelShape.of(shape)
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype={dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    if optimizer not in OPTIMIZER_BYTES:
        raise ValueError(f"optimizer={optimizer!r} is not one of {', '.join(OPTIMIZER_BYTES)}")
    resolved = resolve_layout(layout, dtype)
    _check_experts(shape, layout.ep)
    rank = _RankParams.of(shape, layout)
    adapted = adapters.shares(shape.params) if adapters is not None else None
    if adapted is not None and layout.ep > 1:
        raise ValueError(f"adapters with ep={layout.ep}: LoRA adapts linear layers, not the "
                         "experts' stacked weights; use ep=1")
    params, grads, optimizer_bytes, on_host = _model_states(shape, rank, resolved.costs,
                                                            optimizer, adapted)
    host, disk, params_on_disk = sum(on_host), 0.0, 0.0
    if layout.offload == "disk" and layout.offload_params:
        # ZeRO-3's parameter shards and the state in files; the host keeps the gradient
        # shards and three chunks of state (the parameters' pages are the page cache's)
        params_on_disk, host_grads, host_state = on_host
        disk = params_on_disk + host_state
        host = host_grads + min(host_state, 3 * DISK_CHUNK_BYTES)
    elif layout.offload == "disk":  # the state goes to files; three chunks stay in memory
        disk = optimizer_bytes
        optimizer_bytes = min(optimizer_bytes, 3 * DISK_CHUNK_BYTES)
    activations, acts = peak_activations(shape, layout, rank.blocks, seq_len, dtype, attention)
    host += acts.host  # activation offload: the blocks' saved activations
    # Context parallel's ring holds its buffers in a block's backward, after the head's
    # backward has freed the loss's tensors: the step's peak is the larger of the two
    buffers = _buffers(shape, layout, rank, resolved, dtype, adapted) + max(
        0.0, ring_bytes(shape, layout, seq_len, dtype) - acts.outside)
    if optimizer == "muon":  # the step's buffers: the backward has freed the activations
        # and the forward's buffers by then, so the peak is the larger of the two
        buffers += max(0.0, _muon_buffers(shape, layout, rank, resolved)
                       - activations - buffers)
    return Estimate(layout=layout, params=params, grads=grads, optimizer=optimizer_bytes,
                    activations=activations, buffers=buffers, host=host, disk=disk,
                    detail={"blocks_on_rank": rank.blocks,
                            "per_block_activation": acts.per_block,
                            "activations_on_host": acts.host,
                            "in_flight": in_flight(layout), "engine": resolved.engine.value,
                            "params_on_disk": params_on_disk,
                            "expert_params_on_rank": rank.experts / rank.ep if rank.ep > 1
                            else None})


def _check_experts(shape: ModelShape, ep: int) -> None:
    if ep > 1 and not shape.expert_params:
        raise ValueError(f"ep={ep} needs a mixture-of-experts model whose routed experts "
                         f"meshfit splits (the reference GPT's MoE blocks, e.g. the moe-tiny "
                         "preset, or a transformers MoE's routed experts); "
                         f"{shape.name} has none, set ep=1")
    if ep > 1 and shape.n_experts % ep:
        raise ValueError(f"ep={ep} must divide the number of experts ({shape.n_experts}): "
                         f"each ep rank holds n_experts / ep of them")


@dataclass(frozen=True)
class _RankParams:
    """The parameter counts of the worst rank, before the data-parallel engine divides them
    (under ep, tp = 1: Layout refuses ep with tp)."""

    blocks: int  # transformer blocks on the worst pipeline rank
    local: float  # its parameters after the tensor-parallel split
    block_local: float  # one block's, after the tensor-parallel split
    experts: float  # its routed-expert parameters, before the ep split
    block_experts: float  # one block's routed experts (0 without ep)
    group: int  # ranks that shard one rank's experts (`_expert_group`)
    ep: int

    @property
    def dense(self) -> float:
        return self.local - self.experts

    @classmethod
    def of(cls, shape: ModelShape, layout: LayoutSpec) -> _RankParams:
        stage_params, blocks = _stage_params(shape, layout)
        kept = shape.tp_split / layout.tp + (1 - shape.tp_split)
        return cls(blocks=blocks, local=stage_params * kept,
                   block_local=shape.block_params * kept,
                   experts=_stage_experts(shape, layout, blocks),
                   block_experts=float(shape.block_expert_params) if layout.ep > 1 else 0.0,
                   group=_expert_group(layout), ep=layout.ep)


def _model_states(shape: ModelShape, rank: _RankParams, costs, optimizer: str,
                  adapted: tuple[float, float] | None = None
                  ) -> tuple[float, float, float, tuple[float, float, float]]:
    """(params, grads, optimizer state) bytes on the device of the worst rank, and the same
    three on its host (CPU offload); `adapted`: (adapter share, quantized share) of
    `Adapters.shares`."""
    dense, experts, ep, group = rank.dense, rank.experts, rank.ep, rank.group
    if adapted is not None:  # ep = 1 (refused above): no expert part
        t, q = adapted
        parts = [(dense * ((1 - q) * 4 + q * NF4_BYTES + t * 4), costs.param_shards),
                 (dense * t * 4, costs.grad_shards),
                 (dense * t * (4 * 2 / shape.d_model if optimizer == "adafactor"
                               else OPTIMIZER_BYTES[optimizer]), costs.optimizer_shards)]
        states = [nbytes / divisor for nbytes, divisor in parts]
        if costs.host_offload:
            return 0.0, 0.0, 0.0, tuple(states)
        return states[0], states[1], states[2], (0.0, 0.0, 0.0)

    def shares(nbytes, divisor: int) -> list[float]:
        """This rank's bytes (`nbytes` of a parameter count) of a state the engine splits
        over `divisor` ranks: [dense part, experts' part (over ep x group when the engine
        shards the state, else over ep)]."""
        return [nbytes(dense) / divisor,
                nbytes(experts) / (ep * (group if divisor > 1 else 1))]

    states = [shares(lambda n: n * 4, costs.param_shards),
              shares(lambda n: n * 4, costs.grad_shards),
              shares(lambda n: n * OPTIMIZER_BYTES[optimizer], costs.optimizer_shards)]
    if optimizer == "adafactor":  # factored statistics: (rows + cols) x 4 B per matrix
        states[2] = shares(lambda n: n * 4 * 2 / shape.d_model, costs.optimizer_shards)
    if optimizer == "muon":  # experts are all Muon matrices; the dense part is mixed
        dense_part, expert_part = states[2]
        states[2] = [dense_part / OPTIMIZER_BYTES["muon"] * _muon_rate(shape, experts > 0),
                     expert_part]
    host = (0.0, 0.0, 0.0)
    if costs.host_offload:
        # FSDP2 offloads what it shards; experts it leaves out (group 1: no other rank
        # holds them) stay on the device
        on_device = ep > 1 and group == 1
        host = tuple(dense_part + (0.0 if on_device else expert_part)
                     for dense_part, expert_part in states)
        states = [[0.0, expert_part if on_device else 0.0] for _, expert_part in states]
    params, grads, optimizer_bytes = (sum(parts) for parts in states)
    return params, grads, optimizer_bytes, host


def _buffers(shape: ModelShape, layout: LayoutSpec, rank: _RankParams, resolved,
             dtype: str, adapted: tuple[float, float] | None = None) -> float:
    """Gathered parameters, whole gradients and low-precision weight copies of the step."""
    costs, ep, group = resolved.costs, rank.ep, rank.group
    gathered_dtype = DTYPE_BYTES[dtype] if resolved.param_dtype is not None else 4
    if adapted is not None:
        return _adapted_buffers(layout, rank, resolved, dtype, gathered_dtype, *adapted)
    # One block as FSDP2 gathers it: under ep its unit of experts gathers this rank's
    # n_experts / ep (none when FSDP2 leaves them out)
    block_gathered = rank.block_local - rank.block_experts + (
        rank.block_experts / ep if group > 1 else 0.0)
    buffers = 0.0
    if costs.gathered_params == "one_block":  # the current block and the prefetched next
        buffers += 2 * block_gathered * gathered_dtype + block_gathered * 4  # + reduce-scatter
    elif costs.gathered_params == "all_blocks" or costs.extra_param_copies:
        buffers += rank.blocks * block_gathered * gathered_dtype + block_gathered * 4
    if layout.pp > 1 and resolved.is_fsdp:
        # torch's schedules turn gradient sync off until the last micro-batch: the stage's
        # unsharded gradients accumulate whole beside the sharded ones
        buffers += (rank.dense + (rank.experts / ep if group > 1 else 0.0)) * 4
    if DTYPE_BYTES[dtype] < 4 and resolved.param_dtype is None:
        # autocast's low-precision copies of the weights, kept from forward to backward
        # (FSDP2 gathers in the low precision instead: counted above)
        buffers += rank.local * DTYPE_BYTES[dtype]
    elif resolved.param_dtype is not None and ep > 1 and group == 1:
        # experts FSDP2 leaves out stay fp32; the MoE casts them to the activations' dtype
        # in forward and keeps the copies for backward
        buffers += rank.experts / ep * DTYPE_BYTES[dtype]
    return buffers


def _adapted_buffers(layout: LayoutSpec, rank: _RankParams, resolved, dtype: str,
                     gathered_dtype: int, t: float, q: float) -> float:
    """`_buffers` with adapters on a frozen base: FSDP2 gathers the base (its 4-bit part in
    4 bits) and the adapters, and reduce-scatters the adapters' gradients alone; autocast
    keeps low-precision copies of the full-precision weights only (a 4-bit linear saves its
    NF4 tensor and dequantizes again in backward)."""
    costs = resolved.costs
    block = rank.block_local
    gathered = block * ((1 - q + t) * gathered_dtype + q * NF4_BYTES)
    buffers = 0.0
    if costs.gathered_params == "one_block":
        buffers += 2 * gathered + block * t * 4
    elif costs.gathered_params == "all_blocks" or costs.extra_param_copies:
        buffers += rank.blocks * gathered + block * t * 4
    if layout.pp > 1 and resolved.is_fsdp:
        buffers += rank.dense * t * 4
    if DTYPE_BYTES[dtype] < 4 and resolved.param_dtype is None:
        buffers += rank.local * (1 - q + t) * DTYPE_BYTES[dtype]
    return buffers


def _muon_matrices(shape: ModelShape) -> tuple[float, float]:
    """(elements of the dense Muon matrices: every block's linears, largest matrix) of
    `shape`; without `ModelShape.block_linears`, the blocks' parameters less 4 d_model per
    block (norms and biases)."""
    linears = shape.block_linears  # (in, out) of the linears of all the blocks
    if linears:
        return (float(sum(a * b for a, b in linears)),
                float(max(a * b for a, b in linears)))
    dense_block = shape.block_params - shape.block_expert_params
    return (float(shape.n_layer * max(0, dense_block - 4 * shape.d_model)),
            float(shape.d_model * max(shape.d_ff, shape.d_model)))


def _muon_share(shape: ModelShape, experts_apart: bool) -> float:
    """The share of Muon's matrices among the parameters the estimate calls dense: without
    the routed experts where they are counted apart (under ep), else with them (3-D expert
    weights are Muon's, one matrix per expert)."""
    matrices = _muon_matrices(shape)[0]
    if experts_apart:
        dense = shape.params - shape.expert_params
    else:
        dense, matrices = shape.params, matrices + shape.expert_params
    return min(1.0, matrices / dense) if dense else 1.0


def _muon_rate(shape: ModelShape, experts_apart: bool) -> float:
    """Optimizer bytes per dense parameter under Muon: 4 B (one fp32 momentum) on the
    blocks' matrices, 8 B (AdamW's two moments) on embeddings, head, norms, biases
    (`meshfit.optim.muon.split_groups`)."""
    share = _muon_share(shape, experts_apart)
    return OPTIMIZER_BYTES["muon"] * share + OPTIMIZER_BYTES["adamw"] * (1 - share)


def _muon_buffers(shape: ModelShape, layout: LayoutSpec, rank: _RankParams,
                  resolved) -> float:
    """Muon's step (`meshfit.optim.muon`) works through its matrices one bucket at a time
    (`BUCKET_ELEMENTS` local elements, or one larger matrix): for a bucket it holds the
    Nesterov updates (fp32) and their orthogonalised results (bf16), 6 B per element, and
    under sharding (FSDP2, tp) the owner strategy's padded send and receive buffers and the
    owned matrices gathered whole (they add up to the bucket's share), +8 B per element;
    and the Newton-Schulz temporaries of the largest matrix (bf16 copy, Gram matrix and
    polynomial, next iterate: <= 8 B per element)."""
    largest = _muon_matrices(shape)[1]
    shards = resolved.costs.param_shards
    sharded = shards > 1 or layout.tp > 1
    local = rank.dense * _muon_share(shape, rank.experts > 0) / shards + \
        rank.experts / (rank.ep * (rank.group if shards > 1 else 1))
    bucket = min(local, max(BUCKET_ELEMENTS, largest / max(shards, layout.tp)))
    return bucket * (6.0 + (8.0 if sharded else 0.0)) + largest * 8.0


def resolve_layout(layout: LayoutSpec, dtype: str = "fp32"):
    """The `meshfit.parallel.layout.Layout` of `layout` (its rules; a one-line ValueError
    for a layout meshfit refuses)."""
    return Layout.resolve(layout, layout.world_size, distributed=layout.world_size > 1,
                          mixed_precision="no" if dtype == "fp32" else dtype)
