"""Bubbles: how long pipeline ranks sit idle, measured from a pipeline's timings and as
the textbook figure (Megatron-LM's definition, Narayanan et al. 2021, sec. 2.2)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from meshfit.parallel.options import SCHEDULES

__all__ = ["bubble_fraction", "bubble_ratio", "gather_timings", "theoretical_bubble"]


def gather_timings(pipeline) -> list[dict]:
    """Every pp rank's timings, on every rank (an all-gather of Python objects)."""
    import torch.distributed as dist  # here: the bubble figures of a finished run need no torch

    out: list = [None] * dist.get_world_size(pipeline.pp_group)
    dist.all_gather_object(out, pipeline.timings or [], group=pipeline.pp_group)
    return [t for rank_timings in out for t in rank_timings]


def _idle_busy(timings: Sequence[dict]) -> tuple[float, float]:
    by_step = defaultdict(list)
    for t in timings:
        by_step[t["step"]].append(t)
    idle = busy = 0.0
    for entries in by_step.values():
        span = max(t["end"] for t in entries) - min(t["start"] for t in entries)
        work = sum(t["end"] - t["start"] for t in entries)
        idle += len({t["rank"] for t in entries}) * span - work
        busy += work
    return idle, busy


def bubble_fraction(timings: Sequence[dict]) -> float:
    """Measured share of the step during which ranks sat idle: idle / (ranks x step span),
    summed over the steps in `timings` (pass every rank's, see `gather_timings`; drop the first
    step, which also infers shapes, for steady numbers). In [0, 1)."""
    idle, busy = _idle_busy(timings)
    return idle / (idle + busy) if idle + busy else 0.0


def bubble_ratio(timings: Sequence[dict]) -> float:
    """Measured idle time over busy time: the quantity `theoretical_bubble` predicts."""
    idle, busy = _idle_busy(timings)
    return idle / busy if busy else 0.0


def theoretical_bubble(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Bubble time over ideal compute time, Megatron-LM's definition (Narayanan et al. 2021,
    sec. 2.2): (p-1)/m for GPipe and 1F1B, (p-1)/(v*m) interleaved; as a share of the whole
    step it is r/(1+r). For zero_bubble it is 0: ZB-V fills the bubble with weight-gradient
    work when forward, input-backward and weight-backward take equal time (Qi et al. 2024),
    which real models only approach.

    The interleaved and zero-bubble figures assume at least as many micro-batches as ranks
    (m >= p). With fewer, interleaving has no second micro-batch to fill a rank's gap and
    the step is as sequential as GPipe's: (p-1)/m is returned for interleaved_1f1b
    (measured on 2 CPU ranks at m=1: 1.05); zero_bubble's 0 is not reached either (measured
    0.75 on 2 ranks, 2.4 on 4 at m=1; benchmarks/results/pipeline_*ranks.md)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not one of {', '.join(SCHEDULES)}")
    if schedule == "zero_bubble":
        return 0.0
    interleaved = schedule == "interleaved_1f1b" and m >= p
    return (p - 1) / (m * (v if interleaved else 1))
