"""Pipeline schedules by name, their validation, timed stages and the exact batch-mean loss.

  ===================  ==========================================  ============================
  name                 torch schedule                              stages per rank (placement)
  ===================  ==========================================  ============================
  `gpipe`              ScheduleGPipe (all F, then all B)           1
  `1f1b`               Schedule1F1B (PipeDream-Flush, Narayanan    1
                       et al. 2019/2021)
  `interleaved_1f1b`   ScheduleInterleaved1F1B (Megatron-LM's      v >= 2, looped: rank r holds
                       virtual stages, Narayanan et al. 2021)      r, r+P, r+2P, ...
  `zero_bubble`        ScheduleZBVZeroBubble (ZB-V, Qi et al.      2, V-shaped: rank r holds r
                       2024: backward split into input and         and 2P-1-r
                       weight parts that fill the bubble)
  ===================  ==========================================  ============================

`gpipe` with `microbatches=1` is the guide's naive model parallelism (one rank works at a
time), kept as the baseline every schedule is measured against. For `zero_bubble`, torch's
ScheduleInterleavedZeroBubble (ZB-H1, looped) also trains correctly here; ZB-V is chosen as
the variant whose ideal bubble is zero at 1F1B's activation memory.

Timings: each stage's forward, backward (zero-bubble: backward_input, backward_weight) per
micro-batch is recorded as {step, rank, stage, microbatch, phase, start, end} (wall-clock
seconds) in `Pipeline.timings` (see `meshfit.parallel.pp.bubble`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, \
    ScheduleZBVZeroBubble

from meshfit._compat import pipelining as pp_internals
from meshfit.parallel.options import SCHEDULES
from meshfit.parallel.rules import namer

__all__ = ["SCHEDULES", "TORCH_SCHEDULES", "TokenCrossEntropy", "check_batch", "check_pipeline",
           "pipeline_problem", "stage_placement"]

_DEFAULT_V = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zero_bubble": 2}
TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
                   "interleaved_1f1b": ScheduleInterleaved1F1B,
                   "zero_bubble": ScheduleZBVZeroBubble}


# ---------------------------------------------------------------------------- validation
def check_pipeline(n_blocks: int, pp: int, *, schedule: str = "1f1b", microbatches: int = 1,
                   virtual_stages: int | None = None, batch_size: int | None = None) -> int:
    """`pipeline_problem` as a ValueError, before anything is built (no process group
    needed); returns the virtual stages per rank (`virtual_stages=None`: the schedule's
    default, 1 for gpipe/1f1b, 2 for interleaved_1f1b and zero_bubble)."""
    problem = pipeline_problem(n_blocks, pp, schedule=schedule, microbatches=microbatches,
                               virtual_stages=virtual_stages)
    if problem:
        raise ValueError(problem)
    if batch_size is not None:
        check_batch(batch_size, microbatches)
    return _DEFAULT_V[schedule] if virtual_stages is None else virtual_stages


def pipeline_problem(n_blocks: int, pp: int, *, schedule: str = "1f1b", microbatches: int = 1,
                     virtual_stages: int | None = None,
                     names: Mapping[str, str] | None = None) -> str | None:
    """The first rule a pipeline layout breaks, as a one-line message (None: it is valid).
    `names`: how the caller spells the fields (e.g. ``{"pp": "parallel.pp"}``)."""
    n = namer(names)
    if schedule not in SCHEDULES:
        return f"{n('schedule')}={schedule!r} is not one of {', '.join(SCHEDULES)}"
    for key, value in (("pp", pp), ("microbatches", microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            return f"{n(key)}={value!r} must be a positive integer"
    v = _DEFAULT_V[schedule] if virtual_stages is None else virtual_stages
    if schedule in ("gpipe", "1f1b") and v != 1:
        return (f"{n('virtual_stages')}={v} needs schedule='interleaved_1f1b' ({schedule!r} "
                "runs one stage per rank); use virtual_stages=1")
    if schedule == "interleaved_1f1b" and (not isinstance(v, int) or v < 2):
        return (f"{n('virtual_stages')}={v!r} must be >= 2 for schedule='interleaved_1f1b' "
                "(one stage per rank is plain '1f1b')")
    if schedule == "zero_bubble" and v != 2:
        return (f"{n('virtual_stages')}={v!r} must be 2 for schedule='zero_bubble' (ZB-V runs "
                "exactly two stages per rank, V-shaped)")
    if pp * v > n_blocks:
        what = (f"{n('pp')}={pp}" if v == 1
                else f"{n('pp')}={pp} x virtual_stages={v} = {pp * v} stages")
        return (f"{what} exceeds the model's {n_blocks} blocks (each stage needs at least "
                f"one); use pp*virtual_stages <= {n_blocks}")
    # torch 2.13's own limits, measured on 2 and 4 ranks: only Schedule1F1B needs m >= pp;
    # the interleaved runtime goes in rounds of m//pp micro-batches; GPipe and ZB-V take any m.
    if schedule == "1f1b" and microbatches < pp:
        return (f"{n('microbatches')}={microbatches} is smaller than pp={pp}, which "
                "schedule='1f1b' requires (gpipe, interleaved_1f1b and zero_bubble run fewer); "
                f"use microbatches >= {pp}")
    rounds = max(1, microbatches // pp)
    if schedule == "interleaved_1f1b" and microbatches % rounds:
        return (f"{n('microbatches')}={microbatches} is not a multiple of microbatches//pp="
                f"{rounds}, which schedule='interleaved_1f1b' requires; use a multiple of "
                f"pp={pp} (or fewer than {pp})")
    return None


def check_batch(batch_size: int, microbatches: int) -> None:
    if batch_size % microbatches:
        raise ValueError(f"batch size {batch_size} does not divide into microbatches="
                         f"{microbatches}; use a batch that is a multiple of {microbatches} "
                         "(global batch = micro-batch x microbatches x data-parallel degree)")


def stage_placement(schedule: str, pp: int, virtual_stages: int) -> list[list[int]]:
    """Stage indices held by each pp rank: looped (r, r+P, ...) or V-shaped (r, 2P-1-r)."""
    if schedule == "zero_bubble":
        return [[r, 2 * pp - 1 - r] for r in range(pp)]
    return [[r + k * pp for k in range(virtual_stages)] for r in range(pp)]


# ---------------------------------------------------------------------------- timings
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TimedStage(pp_internals.LocalPeerStage):
    """A PipelineStage that records its timings (see the module docstring) into `log` (and
    warms up no communicator from its rank to itself: `meshfit._compat.pipelining`)."""

    def __init__(self, *args, log: list | None, clock: Callable[[], float], info: dict, **kwargs):
        super().__init__(*args, **kwargs)
        self._log, self._clock, self._info = log, clock, info

    def _timed(self, phase, mb, fn, *args, **kwargs):
        if self._log is None or not self._info["record"]:
            return fn(*args, **kwargs)
        _sync(self.device)
        start = self._clock()
        out = fn(*args, **kwargs)
        _sync(self.device)
        self._log.append(dict(step=self._info["step"], rank=self._info["rank"],
                              stage=self.stage_index, microbatch=mb, phase=phase,
                              start=start, end=self._clock()))
        return out

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        return self._timed("forward", fwd_chunk_id, super().forward_one_chunk, fwd_chunk_id,
                           *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        phase = "backward" if full_backward else "backward_input"
        return self._timed(phase, bwd_chunk_id, super().backward_one_chunk, bwd_chunk_id,
                           loss=loss, full_backward=full_backward, last_backward=last_backward)

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        return self._timed("backward_weight", bwd_chunk_id, super().backward_weight_one_chunk,
                           bwd_chunk_id, last_backward=last_backward)


# ---------------------------------------------------------------------------- losses
class TokenCrossEntropy:
    """Sum of token losses over the micro-batch divided by the number of counted tokens of
    the whole batch (set per step), so the micro-batch losses add up to the batch mean even
    when micro-batches hold different numbers of ignored targets."""

    def __init__(self, ignore_index: int = -100) -> None:
        self.ignore_index, self.count, self.scale = ignore_index, None, 1.0

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()  # as GPT.forward: log-softmax is unstable in half precision
        loss = F.cross_entropy(logits.flatten(0, -2), targets.flatten(),
                               ignore_index=self.ignore_index, reduction="sum")
        loss = loss / self.count  # (an integer tensor: keeps the loss's own dtype)
        return loss if self.scale == 1 else loss * self.scale


class MicrobatchMean:
    """A user's per-micro-batch mean loss, weighted 1/microbatches (and the step's scale)."""

    def __init__(self, loss_fn, microbatches: int) -> None:
        self.loss_fn, self.microbatches, self.scale = loss_fn, microbatches, 1.0

    def __call__(self, output, target):
        return self.loss_fn(output, target) * (self.scale / self.microbatches)  # Python float
