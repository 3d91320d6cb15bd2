"""Pipeline parallel on a 1-D `pp` mesh, on `torch.distributed.pipelining`.

The model's blocks are cut into contiguous stages (GPipe, Huang et al. 2019); each rank runs
its stage(s) and a torch schedule passes activations forward and gradients backward between
ranks, one micro-batch ("chunk" in the guide) at a time:

- `split_points` chooses where to cut, balancing parameter counts or measured block times
  (embeddings go with the first stage, final norm and head with the last);
- `build_stage_module` prunes the full model to one stage (the reference GPT is written for
  this: a stage is the same class with blocks and ends removed, parameter names unchanged);
- `build_pipeline` builds this rank's stage(s) and a schedule, by name:

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

Layouts: every rank passes the same global batch `inputs` [B, T] and `targets` [B, T] to
`Pipeline.step`; the first stage splits the inputs into `microbatches` chunks of B/m rows, the
last stage the targets. Between stages travel hidden states [B/m, T, d_model]. The step's loss
equals a single process's mean token cross-entropy over the whole batch and is returned on
every rank (broadcast from the last stage's rank).

A weight shared between stages (GPT-2's tied embedding and head) becomes one copy per stage;
their gradients are summed after every step so the copies receive the same update and stay
equal, as Megatron-LM does for its embedding group.

Timings: each stage's forward, backward (zero-bubble: backward_input, backward_weight) per
micro-batch is recorded as {step, rank, stage, microbatch, phase, start, end} (wall-clock
seconds) in `Pipeline.timings`; `gather_timings` collects all ranks', `bubble_fraction`
measures the idle share, `theoretical_bubble` gives the textbook figure beside it.
"""

from __future__ import annotations

import copy
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, \
    ScheduleInterleaved1F1B, ScheduleZBVZeroBubble

__all__ = ["SCHEDULES", "Pipeline", "build_pipeline", "build_stage_module", "split_points",
           "block_times", "check_pipeline", "stage_placement", "gather_timings",
           "bubble_fraction", "bubble_ratio", "theoretical_bubble"]

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
_DEFAULT_V = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zero_bubble": 2}
_TORCH_SCHEDULE = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
                   "interleaved_1f1b": ScheduleInterleaved1F1B,
                   "zero_bubble": ScheduleZBVZeroBubble}
_FIRST_PARTS, _LAST_PARTS = ("tok_emb", "pos_emb"), ("norm", "lm_head")


# ---------------------------------------------------------------------------- validation
def check_pipeline(n_blocks: int, pp: int, *, schedule: str = "1f1b", microbatches: int = 1,
                   virtual_stages: int | None = None, batch_size: int | None = None) -> int:
    """Validate a pipeline layout before anything is built; return the virtual stages per rank.

    Raises a one-line ValueError naming the field, its value and the fix. Usable as a preflight
    check (no process group needed). `virtual_stages=None` takes the schedule's default (1 for
    gpipe/1f1b, 2 for interleaved_1f1b and zero_bubble).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not one of {', '.join(SCHEDULES)}")
    for name, value in (("pp", pp), ("microbatches", microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    v = _DEFAULT_V[schedule] if virtual_stages is None else virtual_stages
    if schedule in ("gpipe", "1f1b") and v != 1:
        raise ValueError(f"virtual_stages={v} needs schedule='interleaved_1f1b' ({schedule!r} "
                         "runs one stage per rank); use virtual_stages=1")
    if schedule == "interleaved_1f1b" and (not isinstance(v, int) or v < 2):
        raise ValueError(f"virtual_stages={v!r} must be >= 2 for schedule='interleaved_1f1b' "
                         "(one stage per rank is plain '1f1b')")
    if schedule == "zero_bubble" and v != 2:
        raise ValueError(f"virtual_stages={v!r} must be 2 for schedule='zero_bubble' (ZB-V runs "
                         "exactly two stages per rank, V-shaped)")
    if pp * v > n_blocks:
        what = f"pp={pp}" if v == 1 else f"pp={pp} x virtual_stages={v} = {pp * v} stages"
        raise ValueError(f"{what} exceeds the model's {n_blocks} blocks (each stage needs at "
                         f"least one); use pp*virtual_stages <= {n_blocks}")
    # torch 2.13's own limits, measured on 2 and 4 ranks: only Schedule1F1B needs m >= pp;
    # the interleaved runtime goes in rounds of m//pp micro-batches; GPipe and ZB-V take any m.
    if schedule == "1f1b" and microbatches < pp:
        raise ValueError(f"microbatches={microbatches} is smaller than pp={pp}, which "
                         "schedule='1f1b' requires (gpipe, interleaved_1f1b and zero_bubble run "
                         f"fewer); use microbatches >= {pp}")
    rounds = max(1, microbatches // pp)
    if schedule == "interleaved_1f1b" and microbatches % rounds:
        raise ValueError(f"microbatches={microbatches} is not a multiple of microbatches//pp="
                         f"{rounds}, which schedule='interleaved_1f1b' requires; use a multiple "
                         f"of pp={pp} (or fewer than {pp})")
    if batch_size is not None:
        _check_batch(batch_size, microbatches)
    return v


def _check_batch(batch_size: int, microbatches: int) -> None:
    if batch_size % microbatches:
        raise ValueError(f"batch size {batch_size} does not divide into microbatches="
                         f"{microbatches}; use a batch that is a multiple of {microbatches} "
                         "(global batch = micro-batch x microbatches x data-parallel degree)")


def stage_placement(schedule: str, pp: int, virtual_stages: int) -> list[list[int]]:
    """Stage indices held by each pp rank: looped (r, r+P, ...) or V-shaped (r, 2P-1-r)."""
    if schedule == "zero_bubble":
        return [[r, 2 * pp - 1 - r] for r in range(pp)]
    return [[r + k * pp for k in range(virtual_stages)] for r in range(pp)]


# ---------------------------------------------------------------------------- splitting
def _part_costs(model_or_cfg) -> tuple[float, list[float], float]:
    """(first-stage extras, per-block, last-stage extras) parameter counts.

    A tied head counts on the last stage too: in a pipeline it is a second copy there.
    """
    from meshfit.models.config import GPTConfig

    if isinstance(model_or_cfg, GPTConfig):
        cfg, parts = model_or_cfg, model_or_cfg.param_breakdown()
        head = cfg.vocab_size * cfg.d_model
        return (parts["tok_emb"] + parts["pos_emb"], [parts["layers"] / cfg.n_layer] * cfg.n_layer,
                parts["norm"] + head)
    _check_layout(model_or_cfg)

    def size(name):
        mod = getattr(model_or_cfg, name, None)
        return 0 if mod is None else sum(p.numel() for p in mod.parameters())

    blocks = [sum(p.numel() for p in b.parameters()) for b in model_or_cfg.layers.values()]
    return (sum(map(size, _FIRST_PARTS)), blocks, sum(map(size, _LAST_PARTS)))


def split_points(model_or_cfg, stages: int, *, balance: str = "params",
                 times: Sequence[float] | None = None,
                 points: Sequence[int] | None = None) -> list[int]:
    """Block indices where stages 1..stages-1 begin (stage s holds blocks [b_s, b_{s+1})).

    `balance="params"`: minimise the largest stage's parameter count (embeddings with the
    first stage, norm and head with the last). `balance="time"`: minimise the largest stage's
    time, from `times` = one measured time per block, or [first extras, blocks..., last
    extras] (see `block_times`). `points` given: validated and returned as a list.
    Among partitions with the same maximum, the most even one (least sum of squares) wins.
    """
    n = len(model_or_cfg.layers) if isinstance(model_or_cfg, nn.Module) else model_or_cfg.n_layer
    if not isinstance(stages, int) or stages < 1 or stages > n:
        raise ValueError(f"stages={stages!r} must be between 1 and the model's {n} blocks")
    if points is not None:
        pts = list(points)
        ints = all(isinstance(p, int) and not isinstance(p, bool) for p in pts)
        if not ints or len(pts) != stages - 1 or pts != sorted(set(pts)) or \
                (pts and not 0 < pts[0] <= pts[-1] < n):
            raise ValueError(f"points={pts} must be {stages - 1} strictly increasing block "
                             f"indices in 1..{n - 1} (where stages 1..{stages - 1} begin)")
        return pts
    if balance == "params":
        first, blocks, last = _part_costs(model_or_cfg)
    elif balance == "time":
        if times is None or len(times) not in (n, n + 2):
            raise ValueError(f"balance='time' needs times= with {n} per-block times (or {n + 2}: "
                             "first extras, blocks, last extras); measure them with block_times()")
        t = [float(x) for x in times]
        first, blocks, last = (t[0], t[1:-1], t[-1]) if len(t) == n + 2 else (0.0, t, 0.0)
    else:
        raise ValueError(f"balance={balance!r} must be 'params' or 'time'")
    costs = list(blocks)
    costs[0] += first
    costs[-1] += last
    return _min_max_partition(costs, stages)


def _min_max_partition(costs: list[float], k: int) -> list[int]:
    # best[s][j]: (max, sum of squares, cuts) for blocks [0, j) in s stages; O(k n^2).
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    best = [{0: (0.0, 0.0, [])}]
    for s in range(1, k + 1):
        row = {}
        for j in range(s, n - (k - s) + 1):
            options = []
            for i, (mx, sq, cuts) in best[s - 1].items():
                if i < j:
                    c = prefix[j] - prefix[i]
                    options.append((max(mx, c), sq + c * c, cuts + [i] if i else cuts))
            row[j] = min(options, key=lambda o: (o[0], o[1]))
        best.append(row)
    return best[k][n][2]


def block_times(model: nn.Module, sample: torch.Tensor, *, repeats: int = 3) -> list[float]:
    """Measured forward+backward seconds of [first extras, each block, last extras] on `sample`
    ids [b, T]: each part run alone (cut out as `build_stage_module` cuts stages), median of
    `repeats` runs after one warm-up, CUDA synchronised. For `split_points(balance="time")`."""
    import statistics

    _check_layout(model)
    n = len(model.layers)
    pieces = [_prune(model, [], first=True, last=False),
              *(_prune(model, [i], first=False, last=False) for i in range(n)),
              _prune(model, [], first=False, last=True)]
    out, x = [], sample
    for piece in pieces:
        runs = []
        for _ in range(repeats + 1):
            inp = x.detach().requires_grad_(x.is_floating_point())
            _sync(x.device)
            t0 = time.perf_counter()
            y = piece(inp)
            y.float().square().mean().backward()
            _sync(x.device)
            runs.append(time.perf_counter() - t0)
        out.append(statistics.median(runs[1:]))
        x = y.detach()
    return out


# ---------------------------------------------------------------------------- stage modules
def _check_layout(model) -> None:
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict) or list(layers) != list(map(str, range(len(layers)))):
        raise ValueError(f"{type(model).__name__} is not laid out like meshfit.models.GPT "
                         "(layers = ModuleDict '0'..'L-1', optional tok_emb, pos_emb, norm, "
                         "lm_head); pipeline stages are cut from that layout")


def _stage_range(stage_index: int, num_stages: int, points: Sequence[int], n: int) -> range:
    bounds = [0, *points, n]
    if len(bounds) != num_stages + 1:
        raise ValueError(f"points={list(points)} gives {len(bounds) - 1} stages, not "
                         f"num_stages={num_stages}; pass split_points(model, {num_stages})")
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"stage_index={stage_index} must be in 0..{num_stages - 1}")
    return range(bounds[stage_index], bounds[stage_index + 1])


def build_stage_module(model: nn.Module, stage_index: int, num_stages: int,
                       points: Sequence[int]) -> nn.Module:
    """A copy of `model` holding only stage `stage_index`'s part; `model` is not changed.

    Keeps the blocks in [points[s-1], points[s]) under their global keys, tok_emb/pos_emb on
    the first stage and norm/lm_head on the last, so parameter names match the full model.
    """
    _check_layout(model)
    points = split_points(model, num_stages, points=points)  # validated
    keep = _stage_range(stage_index, num_stages, points, len(model.layers))
    return _prune(model, keep, first=stage_index == 0, last=stage_index == num_stages - 1)


def _prune(model: nn.Module, keep, *, first: bool, last: bool) -> nn.Module:
    # Only the kept parts are copied: the dropped modules are pre-seeded as None in deepcopy's
    # memo, so a meta-device model stays free and a real one costs one stage of memory. A
    # weight tied between a kept and a dropped module is copied with the kept one.
    keep = {str(i) for i in keep}
    ends = ([] if first else list(_FIRST_PARTS)) + ([] if last else list(_LAST_PARTS))
    drop = [b for k, b in model.layers.items() if k not in keep]
    drop += [getattr(model, n) for n in ends if getattr(model, n, None) is not None]
    stage = copy.deepcopy(model, memo={id(m): None for m in drop})
    for key in [k for k in stage.layers if k not in keep]:
        del stage.layers[key]
    for name in ends:
        if hasattr(stage, name):
            setattr(stage, name, None)
    return stage


def _tied_groups(model: nn.Module) -> list[list[str]]:
    by_tensor = defaultdict(list)
    for name, p in model.named_parameters(remove_duplicate=False):
        by_tensor[id(p)].append(name)
    return [names for names in by_tensor.values() if len(names) > 1]


def _materialize(stages: list[nn.Module], device: torch.device, seed: int) -> None:
    """Meta stages -> real ones holding exactly the values of the full model initialised with
    `init_weights(torch.Generator().manual_seed(seed))`: `GPT.init_weights` derives each
    parameter from one drawn seed and the parameter's name, so a stage gets its slice."""
    if not all(hasattr(s, "init_weights") for s in stages):
        raise ValueError("a meta-device model needs an init_weights(generator) method to be "
                         "materialised per stage; build it on a real device instead")
    for s in stages:
        s.to_empty(device=device)
        s.init_weights(torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------- timings
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _TimedStage(PipelineStage):
    """A PipelineStage that records wall-clock start/end of each forward, backward (or, under
    zero-bubble, backward_input and backward_weight) per micro-batch into `log`."""

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


# ---------------------------------------------------------------------------- the pipeline
class _TokenCrossEntropy:
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


class _MicrobatchMean:
    """A user's per-micro-batch mean loss, weighted 1/microbatches (and the step's scale)."""

    def __init__(self, loss_fn, microbatches: int) -> None:
        self.loss_fn, self.microbatches, self.scale = loss_fn, microbatches, 1.0

    def __call__(self, output, target):
        return self.loss_fn(output, target) * (self.scale / self.microbatches)  # Python float


class Pipeline:
    """This rank's part of a pipeline: `modules` (its stage modules, in the order the schedule
    holds them), `stages` (torch PipelineStages), `schedule` (the torch schedule object),
    `timings` (list of dicts, appended to by every step when recording) and `step`."""

    def __init__(self, modules, stages, schedule, *, name, pp_group, pp_rank, num_stages, points,
                 microbatches, loss_fn, last_rank, tied, timings, step_info, virtual_stages,
                 placement):
        self.modules, self.stages, self.schedule = modules, stages, schedule
        self.virtual_stages, self.placement = virtual_stages, placement
        self.schedule_name, self.pp_group, self.pp_rank = name, pp_group, pp_rank
        self.num_stages, self.points, self.microbatches = num_stages, points, microbatches
        self.stage_indices = [s.stage_index for s in stages]
        self.timings = timings
        self._loss_fn, self._last_rank, self._tied = loss_fn, last_rank, tied
        self._step_info = step_info  # shared with the stages: stamps their timings
        self._tie_shapes: dict[int, tuple] = {}
        self.has_first = 0 in self.stage_indices
        self.has_last = num_stages - 1 in self.stage_indices
        self.device = stages[0].device

    def record_timings(self, on: bool) -> None:
        """Start or stop appending per-micro-batch timings to `timings` (built with
        record_timings=True)."""
        if self.timings is None and on:
            raise ValueError("record_timings(True) needs a pipeline built with "
                             "record_timings=True")
        self._step_info["record"] = bool(on)

    @property
    def wrapped_modules(self) -> list[nn.Module]:
        """The stage modules as the schedule runs them (a data-parallel wrapper, if any)."""
        return [stage.submod for stage in self.stages]

    def meta(self) -> dict:
        """The layout, as `meshfit.train.pipeline_chart` reads it from a run folder."""
        return {"schedule": self.schedule_name, "pp": len(self.placement),
                "microbatches": self.microbatches, "virtual_stages": self.virtual_stages,
                "num_stages": self.num_stages, "points": list(self.points),
                "placement": [list(held) for held in self.placement]}

    def parameters(self):
        for _, p in self.named_parameters():
            yield p

    def named_parameters(self):
        """This rank's parameters under the full model's names (a tied copy under its own)."""
        for m in self.modules:
            yield from m.named_parameters()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers, keyed as in the full model's state_dict."""
        out = {}
        for m in self.modules:
            out.update(m.state_dict())
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict (every stage's part, sharded tensors gathered) on CPU
        on global rank 0, {} elsewhere; a collective: call on every rank."""
        from torch.distributed.tensor import DTensor

        mine = {}
        for m in self.modules:  # full_tensor: collectives inside this stage's tp/dp groups
            for k, v in m.state_dict().items():
                v = v.full_tensor() if isinstance(v, DTensor) else v
                mine[k] = v.detach().cpu()
        # One copy of each stage travels: only the pipeline holding global rank 0 (its pp
        # rank 0) gathers, over its pp group; the other tp/dp replicas keep theirs.
        if 0 not in dist.get_process_group_ranks(self.pp_group):
            return {}
        parts: list = [None] * dist.get_world_size(self.pp_group) if dist.get_rank() == 0 \
            else None
        dist.gather_object(mine, parts, dst=0, group=self.pp_group)
        if dist.get_rank() != 0:
            return {}
        out = {}
        for part in parts:
            out.update(part)
        return out

    def step(self, inputs: torch.Tensor | None, targets: torch.Tensor | None, *,
             scale: float = 1.0) -> torch.Tensor:
        """Forward and backward over the batch; gradients accumulate in `.grad` as one
        `(scale * loss).backward()` of the whole-batch mean loss would leave them (zero them
        yourself; `scale=1/k` for k pipeline steps per optimizer step).

        Pass the same [B, T] batch on every rank of the pipeline (ranks that do not need a
        tensor may pass None), so that a batch that does not divide into micro-batches fails
        on every rank before any communication; with data parallel, each data-parallel rank
        its own batch. Returns the batch's mean loss (a detached 0-dim tensor, unscaled) on
        every pipeline rank: it is broadcast from the last stage's rank. Under a
        data-parallel wrapper the stage gradients are reduced after the last micro-batch of
        every call (torch's schedules force it), so k calls per optimizer step reduce k
        times: prefer more `microbatches` to more calls.
        """
        args, target = self._inputs(inputs, targets)
        if isinstance(self._loss_fn, _TokenCrossEntropy) and self.has_last:
            self._loss_fn.count = (target != self._loss_fn.ignore_index).sum()
        self._loss_fn.scale = scale
        before = self._tied_grads_before()
        losses: list[torch.Tensor] = []
        try:
            self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        finally:
            self._loss_fn.scale = 1.0
        self._step_info["step"] += 1
        self._sum_tied_grads(before)
        return self._broadcast_loss(losses) / scale

    def eval_loss(self, inputs: torch.Tensor | None, targets: torch.Tensor | None
                  ) -> torch.Tensor:
        """The batch's mean loss, leaving no gradients, on every pipeline rank; timings are
        not recorded. Forward only through the schedule's `eval`, except under zero_bubble:
        torch 2.13's eval of the V-shaped schedule fails where a rank hands a micro-batch
        to its own second stage ("can't steal_bwd_input if this stage doesn't have
        backward"), so there a full step runs and its gradients are dropped."""
        by_step = self.schedule_name == "zero_bubble"
        if not by_step and not hasattr(self.schedule, "eval"):
            raise RuntimeError(f"torch {torch.__version__}'s pipeline schedules have no eval(); "
                               "upgrade torch to evaluate a pipeline")
        if any(p.grad is not None for p in self.parameters()):
            # Switching a torch schedule between train and eval re-runs its shape inference,
            # which sets the gradients of FSDP-wrapped stages to None (torch 2.13).
            raise RuntimeError("eval_loss with gradients accumulated: evaluate between "
                               "optimizer steps, after optimizer.zero_grad(set_to_none=True)")
        args, target = self._inputs(inputs, targets)
        if isinstance(self._loss_fn, _TokenCrossEntropy) and self.has_last:
            self._loss_fn.count = (target != self._loss_fn.ignore_index).sum()
        losses: list[torch.Tensor] = []
        recording, self._step_info["record"] = self._step_info["record"], False
        try:
            if by_step:
                with torch.enable_grad():  # (callers evaluate under no_grad)
                    self.schedule.step(*args, target=target, losses=losses,
                                       return_outputs=False)
            else:
                with torch.no_grad():
                    self.schedule.eval(*args, target=target, losses=losses)
        finally:
            self._step_info["record"] = recording
            if by_step:
                for p in self.parameters():
                    p.grad = None
        return self._broadcast_loss(losses)

    def _inputs(self, inputs, targets):
        for t in (inputs, targets):
            if t is not None:
                _check_batch(t.shape[0], self.microbatches)
        for needed, t, what in ((self.has_first, inputs, "inputs"), (self.has_last, targets,
                                                                     "targets")):
            if needed and t is None:
                raise ValueError(f"{what}=None on pp rank {self.pp_rank}, which holds stage(s) "
                                 f"{self.stage_indices}; pass the batch's {what} on every rank")
        args = (inputs.to(self.device),) if self.has_first else ()
        target = targets.to(self.device) if self.has_last else None
        return args, target

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the whole model's gradient norm (every stage, every shard) to `max_norm`;
        returns the norm, equal on every rank. A weight tied across stages counts once."""
        from meshfit.accelerator.runtime import clip_grad_norm_

        counted = [p for n, p in self.named_parameters() if n not in self._duplicate_names]
        return clip_grad_norm_(list(self.parameters()), max_norm, norm_type=norm_type,
                               counted=counted, across=self.pp_group, device=self.device)

    @property
    def _duplicate_names(self) -> set[str]:
        # Every copy of a tied weight but the first name's (held by exactly one stage).
        out = set()
        for tie in self._tied:
            out.update(tie.names[1:])
        return out

    def _broadcast_loss(self, losses) -> torch.Tensor:
        wide = any(p.dtype == torch.float64 for p in self.parameters())
        dtype = torch.float64 if wide else torch.float32  # as the loss: half is upcast
        loss = torch.stack([x.detach() for x in losses]).sum().to(dtype) if losses else \
            torch.zeros((), dtype=dtype, device=self.device)
        dist.broadcast(loss, group=self.pp_group, group_src=self._last_rank)
        return loss

    # Tied weights: one copy per stage; after each step every copy gets g0 + the sum of what
    # this step added to each copy (g0: the gradient accumulated before, equal on all copies).
    def _local_copies(self, names):
        return [p for n, p in self.named_parameters() if n in names]

    # Under tp/FSDP the copies are DTensors laid out alike (the plans shard embedding and
    # head both as Shard(0)), so their local shards are summed; ranks without a copy take
    # part in the all-reduce with zeros of the local shape, learnt once from the holders.
    def _tied_grads_before(self):
        out = []
        for tie in self._tied:
            local = self._local_copies(tie.names)
            g0 = _grad_as_param(local[0]) if local else None
            out.append(None if g0 is None else _local(g0).clone())
        return out

    def _sum_tied_grads(self, before) -> None:
        for i, (tie, g0) in enumerate(zip(self._tied, before)):
            local = self._local_copies(tie.names)
            if not local and not tie.cross_rank:
                continue  # (a rank holding no copy of a tie kept within another rank)
            grads = [g for g in map(_grad_as_param, local) if g is not None]
            layout = self._tie_local_shape(i, tie, grads)
            if layout is None:
                continue  # no copy received a gradient on any rank
            shape, dtype = layout
            added = torch.zeros(shape, dtype=dtype, device=self.device)
            for g in grads:
                added += _local(g) if g0 is None else _local(g) - g0
            if tie.cross_rank:  # ranks without a copy take part with zeros
                dist.all_reduce(added, group=self.pp_group)
            total = added if g0 is None else g0 + added
            for p in local:
                if p.grad is None:
                    continue  # (a stage that received no gradient at all: nothing to add to)
                _local(p.grad).copy_(total)

    def _tie_local_shape(self, i: int, tie, grads):
        """(local shape, dtype) of the tie's gradient, or None when no copy has one yet."""
        if i not in self._tie_shapes:
            mine = (tuple(_local(grads[0]).shape), grads[0].dtype) if grads else None
            if tie.cross_rank:
                everyone: list = [None] * dist.get_world_size(self.pp_group)
                dist.all_gather_object(everyone, mine, group=self.pp_group)
                mine = next((x for x in everyone if x is not None), None)
            if mine is None:
                return None  # asked again next step (every rank agrees: nothing cached)
            self._tie_shapes[i] = mine
        return self._tie_shapes[i]


def _grad_as_param(p: torch.Tensor) -> torch.Tensor | None:
    """`p.grad`, laid out as `p` (a tensor-parallel embedding's gradient can come back
    replicated while its weight is sharded); re-assigned so that writes to it land."""
    from torch.distributed.tensor import DTensor

    g = p.grad
    if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
        p.grad = g = g.redistribute(p.device_mesh, p.placements)
    return g


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


@dataclass(frozen=True)
class _Tie:
    names: tuple[str, ...]  # the full model's names of one shared tensor
    cross_rank: bool  # copies on more than one pp rank
    shape: torch.Size


def _ties(model, placement, num_stages, points) -> list[_Tie]:
    out = []
    for names in _tied_groups(model):
        if not model.get_parameter(names[0]).requires_grad:
            continue  # frozen (e.g. LoRA): no gradients to keep equal
        holders = [(r, s) for r, held in enumerate(placement) for s in held
                   for n in names if _holds(model, n, s, num_stages, points)]
        if len(holders) > 1:
            shape = model.get_parameter(names[0]).shape
            out.append(_Tie(tuple(names), len({r for r, _ in holders}) > 1, shape))
    return out


def build_pipeline(model: nn.Module, pp_mesh, *, schedule: str = "1f1b", microbatches: int,
                   virtual_stages: int | None = None,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                   points: Sequence[int] | None = None, balance: str = "params",
                   times: Sequence[float] | None = None,
                   record_timings: bool = True, init_seed: int = 0,
                   parallelize: Callable[[nn.Module], nn.Module] | None = None) -> Pipeline:
    """Cut `model` into stages over the 1-D `pp_mesh` and return this rank's `Pipeline`.

    `model`: the full model, identical on every rank (built from one seed), or built on the
    meta device: then each stage is materialised on the mesh's device and filled by
    `init_weights(torch.Generator().manual_seed(init_seed))`, the values the full model gets
    from the same call. `model` is not modified. Stages are copied out of it
    (`build_stage_module`) and moved to the mesh's device; build the optimizer afterwards on
    `pipeline.parameters()`.
    `points`: where stages begin (`split_points`), else balanced by `balance`/`times`.
    `loss_fn`: None for token cross-entropy on logits (targets [B, T], ignore_index -100,
    normalised by the whole batch's counted tokens, so the result equals the single-process
    mean exactly); or `loss_fn(output, target)` returning the mean over one micro-batch,
    which is divided by `microbatches` here (equal weight per micro-batch).
    torch's own gradient scaling (`scale_grads`) is turned off: it divides the whole `.grad`,
    including gradients accumulated by earlier steps.
    `record_timings`: append per-micro-batch forward/backward times to `pipeline.timings`
    (with a device synchronisation around each on CUDA, which removes compute/communication
    overlap while on).
    `parallelize`: applied to each stage module once it is on the device, returning the
    module the schedule runs: tensor parallel, checkpointing/compile and a data-parallel
    wrapper (FSDP2; torch's schedules also drive DDP, which meshfit does not use here: see
    `meshfit.accelerator.runtime`), as `Accelerator.prepare_pipeline` passes. The schedule reduces the
    wrapper's gradients once per `step`, after its last micro-batch.
    """
    if pp_mesh.ndim != 1:
        raise ValueError(f"build_pipeline needs a 1-D mesh, got axes {pp_mesh.mesh_dim_names}; "
                         "pass mesh['pp']")
    _check_layout(model)
    pp = pp_mesh.size()
    v = check_pipeline(len(model.layers), pp, schedule=schedule, microbatches=microbatches,
                       virtual_stages=virtual_stages)
    num_stages = pp * v
    points = split_points(model, num_stages, balance=balance, times=times, points=points)
    pp_rank, group = pp_mesh.get_local_rank(), pp_mesh.get_group()
    placement = stage_placement(schedule, pp, v)
    device = torch.device("cuda", torch.cuda.current_device()) \
        if pp_mesh.device_type == "cuda" else torch.device(pp_mesh.device_type)

    modules = [build_stage_module(model, s, num_stages, points) for s in placement[pp_rank]]
    if any(p.is_meta for m in modules for p in m.parameters()):
        _materialize(modules, device, init_seed)
    else:
        _check_same_weights(model, group)
        modules = [m.to(device) for m in modules]
    runs = [parallelize(m) for m in modules] if parallelize is not None else modules
    modules = [r.module if isinstance(r, nn.parallel.DistributedDataParallel) else r
               for r in runs]

    timings = [] if record_timings else None
    anchor_wall, anchor_perf = time.time(), time.perf_counter()
    info = {"step": 0, "rank": pp_rank, "record": True}
    stages = [_TimedStage(m, s, num_stages, device, group=group, log=timings, info=info,
                          clock=lambda: anchor_wall + time.perf_counter() - anchor_perf)
              for m, s in zip(runs, placement[pp_rank])]
    if loss_fn is None:
        loss = _TokenCrossEntropy()
    else:
        loss = _MicrobatchMean(loss_fn, microbatches)
    cls = _TORCH_SCHEDULE[schedule]
    sched = cls(stages[0] if v == 1 else stages, n_microbatches=microbatches, loss_fn=loss,
                scale_grads=False)
    last_rank = next(r for r, held in enumerate(placement) if num_stages - 1 in held)

    return Pipeline(modules, stages, sched, name=schedule, pp_group=group, pp_rank=pp_rank,
                    num_stages=num_stages, points=points, microbatches=microbatches,
                    loss_fn=loss, last_rank=last_rank,
                    tied=_ties(model, placement, num_stages, points), timings=timings,
                    step_info=info, virtual_stages=v, placement=placement)


def _check_same_weights(model: nn.Module, group) -> None:
    # Each rank keeps its own slice of its own copy: ranks that built different weights (an
    # unseeded init) would train a model nobody built, silently. Compare cheap fingerprints.
    with torch.no_grad():
        mine = [round(float(p.double().sum() + p.double().abs().sum()), 6)
                for p in model.parameters()]
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    if any(other != everyone[0] for other in everyone):
        raise ValueError("the pp ranks passed different model weights to build_pipeline; build "
                         "the full model after torch.manual_seed(seed) with one seed on every "
                         "rank, or on the meta device (stages are then initialised from init_seed)")


def _holds(model, name: str, stage: int, num_stages: int, points) -> bool:
    """Whether stage `stage` keeps parameter `name` of the full model."""
    top, *rest = name.split(".")
    if top == "layers":
        return int(rest[0]) in _stage_range(stage, num_stages, points, len(model.layers))
    if top in _FIRST_PARTS:
        return stage == 0
    if top in _LAST_PARTS:
        return stage == num_stages - 1
    return True


# ---------------------------------------------------------------------------- bubbles
def gather_timings(pipeline: Pipeline) -> list[dict]:
    """Every pp rank's timings, on every rank (an all-gather of Python objects)."""
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
