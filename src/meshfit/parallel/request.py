"""`LayoutRequest`: what a user asks of a layout, one type for every way of asking.

`Accelerator(parallel=..., zero_stage=...)`, `meshfit train`'s ``[parallel]`` section
(`meshfit.train.config.ParallelConfig`, this type with its errors spelled as config keys)
and the estimator's `meshfit.memory.LayoutSpec` all carry one;
`meshfit.parallel.layout.Layout.of` turns it into the resolved `Layout`. No torch: a request
is read and refused before torch loads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from meshfit.distributed.dims import MeshSizes, ParallelDims
from meshfit.parallel.options import SCHEDULES
from meshfit.parallel.rules import Offload, namer, options_problem

__all__ = ["LayoutRequest"]


@dataclass(frozen=True, kw_only=True)
class LayoutRequest(MeshSizes):
    """Mesh sizes (`MeshSizes`: pp, dp_replicate, dp_shard, cp, tp, ep) and the layout's
    options, validated when built (errors use the keyword names; `check` takes others)."""

    zero_stage: int | None = None
    """0 (DDP), 1 (optimizer state sharded), 2 (+ gradients), 3 (+ parameters) over the
    dp_shard ranks; unset: 3 when dp_shard > 1, else 0."""
    offload: Offload = "none"
    """"cpu": sharded parameters, gradients and optimizer state in host memory (stage 3);
    "disk": the optimizer state in files of ``offload_dir``, streamed through each step
    (`meshfit.parallel.disk`; every stage)."""
    offload_params: bool = False
    """offload="disk" under zero_stage 3: the sharded fp32 parameters (the master weights)
    in memory-mapped files of ``offload_dir`` too, held on the host (FSDP2's CPU offload
    policy): each block's shard is paged in when FSDP2 all-gathers it, ahead of use, and the
    optimizer's updates are written back to the files."""
    sync_each_batch: bool | str = False
    """Stages 2/3 under accumulation: reduce-scatter every micro-batch (true: less memory),
    only on the last (false: fewer collectives), or "auto" (decided from free memory)."""
    schedule: str = "1f1b"
    """pp > 1: "gpipe", "1f1b", "interleaved_1f1b" or "zero_bubble"."""
    microbatches: int | None = None
    """pp > 1: micro-batches ("chunks") per pipeline step; the global batch is
    micro_batch_size x microbatches x data-parallel ranks x accumulation. Unset: all of the
    accumulation (`meshfit train`), i.e. global_batch_size / (micro_batch_size x
    data-parallel ranks)."""
    virtual_stages: int | None = None
    """pp > 1: stages per rank (unset: 1, or 2 for interleaved_1f1b and zero_bubble)."""
    sequence_parallel: bool = False
    """tp > 1: norms and dropout on a sequence shard (the sequence length must divide by tp)."""
    loss_parallel: bool = False
    """tp > 1: the loss on vocabulary-sharded logits, never gathering them (not with pp)."""

    def __post_init__(self) -> None:
        self.check()

    def check(self, names: Mapping[str, str] | None = None) -> None:
        """One-line ValueError for a value that is wrong whatever the world size; `names`
        spell the fields as the caller's user writes them (e.g. "parallel.zero_stage")."""
        self.dims()  # ParallelDims checks each size
        n = namer(names)
        problem = options_problem(
            zero_stage=self.zero_stage, offload=self.offload,
            sync_each_batch=self.sync_each_batch, mixed_precision="no",
            sequence_parallel=self.sequence_parallel, loss_parallel=self.loss_parallel, n=n)
        if problem:
            raise ValueError(problem)
        if not isinstance(self.offload_params, bool):
            raise ValueError(f"{n('offload_params')}={self.offload_params!r} must be true or "
                             "false")
        if self.offload_params and self.offload != "disk":
            raise ValueError(f"{n('offload_params')}=true puts the parameters in the files of "
                             f"offload='disk', and {n('offload')}={self.offload!r}; set "
                             f"{n('offload')}='disk' (with an offload_dir) or drop it")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"{n('schedule')}={self.schedule!r} is not one of "
                             f"{', '.join(SCHEDULES)}")
        for key in ("microbatches", "virtual_stages"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{n(key)}={value!r} must be a positive integer (or unset)")

    def dims(self, world_size: int | None = None) -> ParallelDims:
        """The mesh sizes as a validated `ParallelDims` (checked against `world_size`)."""
        return ParallelDims(world_size=world_size, **self.sizes())

    @classmethod
    def of(cls, dims: ParallelDims | None = None, **options) -> LayoutRequest:
        """The request of `dims` (default: every rank on dp_replicate) with `options`."""
        sizes = (dims or ParallelDims()).sizes()
        return cls(**sizes, **options)
