"""`LayoutCosts`: how a layout's data-parallel engine divides and copies the model states,
the multipliers a memory estimate or a planner reads (`meshfit.memory`, `meshfit.plan`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from meshfit.distributed.dims import ParallelDims
from meshfit.parallel.rules import Engine

__all__ = ["LayoutCosts", "costs_for"]


@dataclass(frozen=True, kw_only=True)
class LayoutCosts:
    """Multipliers of the model's own sizes on one rank (tensor parallel divides them further
    by the TP plan; `meshfit.memory.zero_formula` is the same arithmetic without tp/pp)."""

    param_shards: int
    """Ranks a parameter is split over between steps (FSDP2: dp_shard, at stage 2 too)."""
    grad_shards: int
    """Ranks a synchronised gradient is split over after the reduction."""
    optimizer_shards: int
    """Ranks the optimizer state is split over (stage >= 1: dp_shard)."""
    optimizer_partition: Literal["none", "whole_parameters", "elements"]
    """ZeRO-1 partitions whole parameters greedily (uneven when a few tensors dominate);
    FSDP2 splits every parameter per element (balanced)."""
    whole_grads_until_boundary: bool
    """Gradients are kept whole while accumulating micro-batches (reduced on the last)."""
    gathered_params: Literal["none", "one_block", "all_blocks"]
    """Parameters gathered during the step: one block at a time (stage 3) or every block
    from its forward to its backward (stage 2, stage 1 under tp/pp)."""
    extra_param_copies: int
    """Parameter copies held beyond the engine's own during the step (replicate-only FSDP2
    copies the parameters into an unsharded buffer from forward to backward: 1)."""
    host_offload: bool
    """Sharded parameters, gradients and optimizer state live in host memory."""
    grad_reduction: Literal["none", "all_reduce", "reduce_scatter", "reduce_scatter+all_reduce"]
    """The gradient collective of one optimizer step (HSDP: reduce-scatter inside a shard
    group, all-reduce across the replicas)."""


def costs_for(dims: ParallelDims, engine: Engine, stage: int, offload: bool) -> LayoutCosts:
    fsdp = engine in (Engine.FSDP2, Engine.FSDP2_REPLICATE)
    shards = dims.dp_shard * dims.cp if fsdp else 1  # (under cp ZeRO shards over dp_shard x cp)
    if engine is Engine.NONE:
        reduction = "none"
    elif engine is Engine.FSDP2 and dims.dp_replicate > 1:
        reduction = "reduce_scatter+all_reduce"
    elif engine is Engine.FSDP2:
        reduction = "reduce_scatter"
    else:
        reduction = "all_reduce"
    gathered = "none"
    if engine is Engine.FSDP2:
        gathered = "one_block" if stage == 3 else "all_blocks"
    return LayoutCosts(
        param_shards=shards, grad_shards=shards,
        optimizer_shards=dims.dp_shard * dims.cp if stage >= 1 else 1,
        optimizer_partition="elements" if engine is Engine.FSDP2 else
        "whole_parameters" if engine is Engine.ZERO1 else "none",
        whole_grads_until_boundary=not fsdp or stage < 2, gathered_params=gathered,
        extra_param_copies=1 if engine is Engine.FSDP2_REPLICATE else 0,
        host_offload=offload, grad_reduction=reduction)

