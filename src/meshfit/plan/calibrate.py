"""This machine measured: its compute, memory and collective speeds (`meshfit calibrate`),
as the file holds them and the layout planner reads them (`load_calibration`).

`meshfit.plan.measure.measure` runs the probes (`meshfit.plan.probes`) on every rank of a job
at once (the command, `meshfit.cli.calibrate`, starts N processes through meshfit's launcher,
or runs one here), fits their models (`meshfit.plan.fit`), and rank 0 writes one JSON file.
Device and backend are chosen as `meshfit.distributed.init` does: CUDA and NCCL where CUDA
is available, the CPU and gloo otherwise or with ``--cpu`` / ``MESHFIT_CPU=1``.

The file (schema 1)::

    {"schema": 1,
     "device": "cpu" | "cuda:<name>",     # torch.cuda.get_device_name on CUDA
     "backend": "gloo" | "nccl",          # the backend N > 1 processes use here
     "world_size": N,                     # processes that ran at once
     "torch": "<version>",
     "time": "<ISO 8601, UTC>",
     "matmul_flops": {"fp32": F, "bf16": F, "fp16": F},
     "memory_bandwidth": B,
     "collectives": {"all_reduce": {"bus_bandwidth": B, "latency": s},
                     "all_gather": {...}, "reduce_scatter": {...},
                     "all_to_all": {...}, "send_recv": {...}},
     "train_step": {"fp32": {"step_overhead": s, "block_overhead": s,   # optional: older
                             "token_width": s, "attention_scores": s,  # files lack it
                             "flops": F, "optimizer_per_param": s}, ...},
     "data_parallel": {"ddp": x, "zero1": x, "fsdp2": x},                # optional
     "pipeline": {"gpipe": s, "1f1b": s, "interleaved_1f1b": s, "zero_bubble": s},  # optional
     "disk": {"folder": "<path>", "write": B, "read": B},                # optional
     "flags": {"<figure>": "<why it is not used>", ...},                 # optional
     "raw": {...}}

Every timing is repeated (``meshfit calibrate --repeats R``, default 5, on every rank at
once): its figure is the slowest rank's median, its spread the widest rank's (max - min) /
median, kept beside it in ``raw`` (``spread``) and summed up in ``raw.noise`` (``repeats``,
``timings``, ``median_spread``, ``max_spread``).

* ``matmul_flops``: achieved FLOP/s (2·n³ per n×n matmul) of one process while all N run
  matmuls at once, at the largest size that ran (sizes double until one matmul would take
  more than about 0.5 s, or a cap is reached); the median of repeats, of the slowest rank.
  fp32 runs at torch's current precision setting (``raw.matmul.fp32_precision``: TF32 is off
  by default). null where the dtype cannot run here.
* ``memory_bandwidth``: bytes/s of one process copying a large tensor (bytes read plus
  bytes written), all N copying at once; median of repeats, slowest rank.
* ``collectives``: per kind, ``time(S) = latency + factor · S / bus_bandwidth`` (seconds,
  bytes/s) with ``factor`` = 2(n−1)/n for all_reduce (S: the tensor), (n−1)/n for
  all_gather and reduce_scatter (S: the full, gathered tensor) and all_to_all (S: each
  rank's whole input, of which (n−1)/n leaves the rank), 1 for send_recv (S: the message;
  ranks 0→1, 2→3, ... send at once, one direction). The bus bandwidth is the figure that
  does not depend on n, so `Calibration.collective_time` applies it to any group size.
  Fitted by least squares on the per-size medians (slowest rank), each size weighted by
  1/time² so that small sizes (latency) count as much as large ones (bandwidth); a fit
  with a negative latency is redone through the origin. With N=1 nothing is measured:
  both figures are null.
* ``train_step``: what a training step achieves, which a bare matmul does not tell: per
  dtype, the forward and backward of the reference GPT at eight shapes (widths 64 to 256,
  2 to 6 blocks, 64 to 256 positions; fp32 weights, autocast for bf16, fp16 on CUDA only),
  all N processes at once, fitted by least squares on relative errors to ``seconds =
  step_overhead + block_overhead · blocks + token_width · tokens · width · blocks +
  attention_scores · tokens · positions · heads · blocks + FLOPs / flops``
  (`meshfit.plan.fit.STEP_TERMS`): what a micro-batch and a block cost besides their FLOPs
  (the framework, kernel launches), the memory-bound elementwise work, the attention scores,
  and the FLOP/s of the matrix products (at most the fastest matmul);
  ``optimizer_per_param``: the seconds per parameter of one AdamW step (foreach) on the
  largest shape. null where the dtype is not timed.
* ``data_parallel`` (optional; N > 1 only): per engine ("ddp", "zero1": DDP with
  ZeroRedundancyOptimizer, "fsdp2": ZeRO-3), the seconds a training step of the reference GPT
  (`meshfit.plan.probes._DP_SHAPES`) under that engine takes beyond the same step alone
  (timed before and after the engines; its AdamW step on the engine's share of the
  parameters), divided by what `meshfit.plan.fit.data_parallel_seconds` models for its
  collectives from the figures above: how much of the collectives a real step exposes, with
  its hooks, copies and waits (on a CPU nothing overlaps; on GPUs most of it does). null
  where not measured.
  Beside them "tp" and "tp_sp": a training step under tensor parallel over all N ranks
  (without and with sequence parallel) beyond the planner's prediction of everything else,
  over its modelled TP all-reduces. A difference below 0 is written as 0, and flagged.
* ``pipeline`` (optional; N > 1 only): per schedule (gpipe, 1f1b, interleaved_1f1b,
  zero_bubble), the seconds per micro-batch a pipeline step of the reference GPT
  (`meshfit.plan.measure._PP_SHAPES`, its blocks over all N ranks, 4N micro-batches of one
  sequence) takes beyond what the planner predicts for it from the figures above (compute,
  bubble, sends): the schedule's own work per micro-batch (its Python, the stage wrappers,
  the waits). null where not measured.
* ``disk``: ``meshfit calibrate --offload-dir PATH``'s sequential write (fsync'd) and read.
* ``flags``: the figures `meshfit.plan.trust.judge` finds cannot be told from noise (a fit
  with R² <= 0.9 or a 0 s latency, a difference within the spread of its timings, or
  "machine": every timing too noisy), each with the reason; the planner uses none of them.
* ``raw``: the per-size timings every figure came from with their spreads, each fit's R²
  (on the times) and largest relative error under ``raw.collectives.<kind>.r2`` /
  ``.max_relative_error`` and ``raw.train_step.<dtype>.r2``; per difference its unclamped
  seconds (``exposed_seconds``; ``seconds`` and ``predicted_*``) and ``noise_seconds``
  (half its timings' ranges, and the drift of the step it is measured against); the
  seconds each probe took (``phases``).

Every number the loader reads (the figures, and the raw ones the planner and the flags
read back) is checked for its kind and physical range (rates in (0, 1e18], seconds and
multiples >= 0, R² <= 1, all finite): a refusal is one line naming the key and its value.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from meshfit.plan.fit import (DP_ENGINES, KINDS, PP_SCHEDULES, RATE_MAX, TP_ENGINES,
                              CollectiveFit, TrainStepFit, bus_factor)
from meshfit.plan.trust import judge

__all__ = ["DTYPES", "PP_SCHEDULES", "SCHEMA", "TP_ENGINES", "Calibration", "load_calibration"]

SCHEMA = 1
DTYPES = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class Calibration:
    """A `meshfit calibrate` file (see the module docstring for each field's meaning)."""

    schema: int
    device: str
    backend: str
    world_size: int
    torch: str
    time: str
    matmul_flops: dict[str, float | None]
    memory_bandwidth: float
    collectives: dict[str, CollectiveFit]
    raw: dict[str, Any]
    train_step: dict[str, TrainStepFit | None] | None = None
    """None in a file written before meshfit measured training steps."""
    data_parallel: dict[str, float | None] | None = None
    """Per engine of `DP_ENGINES`: the exposed share of the modelled collectives (module
    docstring); None in a file without it (one process, or written before)."""
    pipeline: dict[str, float | None] | None = None
    """Per schedule of `PP_SCHEDULES`: seconds per micro-batch beyond the prediction
    (module docstring); None in a file without it."""
    disk: dict[str, Any] | None = None
    """``meshfit calibrate --offload-dir PATH``: {"folder", "write", "read"}, the sequential
    write (fsync'd) and read bytes/s of that folder's disk, for offload="disk"; None
    without it."""
    flags: dict[str, str] = field(default_factory=dict)
    """{figure path ("collectives.all_reduce", "data_parallel.ddp", ...; "machine": all of
    them): why it is not used} (`meshfit.plan.trust`)."""

    def trusted(self, figure: str) -> bool:
        """Whether the planner may use `figure` (a path as in `flags`)."""
        return "machine" not in self.flags and figure not in self.flags

    def disk_bandwidth(self) -> float | None:
        """The slower of the measured disk's write and read (bytes/s), or None."""
        if not self.disk:
            return None
        return min(float(self.disk["write"]), float(self.disk["read"]))

    def peak_flops(self, dtype: str) -> float | None:
        """The fastest matmul measured for `dtype` (FLOP/s): the peak MFU is counted
        against when a profile is used (no training step can beat it)."""
        rows = self.raw.get("matmul", {}).get(dtype) if isinstance(self.raw, dict) else None
        best = [r["flops"] for r in rows or () if isinstance(r, dict) and _rate(r.get("flops"))]
        measured = self.matmul_flops.get(dtype)
        return max(best + ([measured] if measured else [])) if best or measured else None

    def collective_time(self, kind: str, nbytes: float, n: int) -> float:
        """Seconds one collective of `kind` on `nbytes` takes in a group of `n` processes
        (S as in the module docstring; send_recv: one message between two ranks)."""
        factor = bus_factor(kind, max(n, 1))
        if n < 1:
            raise ValueError(f"group size n={n} must be >= 1")
        if nbytes < 0:
            raise ValueError(f"nbytes={nbytes} must be >= 0")
        if n == 1:
            return 0.0
        fit = self.collectives[kind]
        if fit.bus_bandwidth is None or fit.latency is None:
            raise ValueError(f"this calibration ran on {self.world_size} process(es) and has no "
                             f"{kind} figures; run `meshfit calibrate --nproc 2` (or more)")
        return fit.latency + factor * nbytes / fit.bus_bandwidth


# ---------------------------------------------------------------------------- reading a file
# Every value a file holds is checked before it is used: its kind and its physical range,
# each refusal naming the key, its value and the range (a negative bandwidth once turned a
# collective into a gain and lifted a plan's MFU from 44% to 85%; a zero one divided by zero).
@dataclass(frozen=True)
class _Kind:
    test: Callable[[Any], bool]
    what: str
    """What the value must be, as a refusal says it."""


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _rate(value: Any) -> bool:
    return _finite(value) and 0 < value <= RATE_MAX


def _or_null(kind: _Kind) -> _Kind:
    return _Kind(lambda v: v is None or kind.test(v), kind.what + " or null")


_TEXT = _Kind(lambda v: isinstance(v, str), "text")
_COUNT = _Kind(lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
               "a whole number >= 1")
_RATE = _Kind(_rate, f"a rate > 0 and <= {RATE_MAX:g} per second")
_SECONDS = _Kind(lambda v: _finite(v) and v >= 0, "seconds >= 0")
_NUMBER = _Kind(_finite, "a finite number")
_MULTIPLE = _Kind(lambda v: _finite(v) and v >= 0, "a multiple >= 0")
_R2 = _Kind(lambda v: _finite(v) and v <= 1, "an R² <= 1")


@dataclass(frozen=True)
class _Object:
    """A JSON object with these keys; `sections`: an absent key is read as null (sections
    older files lack); `nullable`: null stands for the whole object (not measured)."""

    keys: dict[str, Any]
    sections: bool = False
    nullable: bool = False


@dataclass(frozen=True)
class _Optional:
    """A key that may be absent (but, present, is of its kind: not null unless it says)."""

    kind: Any


@dataclass(frozen=True)
class _Each:
    """A list (`mapping` False) or an object of any keys (True), each value of `kind`."""

    kind: Any
    mapping: bool = False


def _section(keys: dict, nullable: bool = True) -> _Optional:
    return _Optional(_Object(keys, sections=True, nullable=nullable))


def _rows(keys: dict) -> dict:  # the raw rows meshfit reads back (`meshfit.plan.trust`)
    return {k: _Optional(_Object(v)) for k, v in keys.items()}


_STEP = _Object({"block_overhead": _SECONDS, "flops": _RATE, "optimizer_per_param": _SECONDS,
                 **{k: _Optional(_SECONDS)  # (older files lack them: 0)
                    for k in ("step_overhead", "token_width", "attention_scores")}},
                nullable=True)
_NOISE = {"noise_seconds": _Optional(_SECONDS)}
_RAW = _Object({
    "matmul": _section({d: _Optional(_Each(_Object({"flops": _RATE}))) for d in DTYPES}),
    "collectives": _section(_rows(dict.fromkeys(KINDS, {"r2": _Optional(_R2)}))),
    "train_step": _section(_rows(dict.fromkeys(DTYPES, {"r2": _Optional(_R2)}))),
    "data_parallel": _section(_rows({
        **dict.fromkeys(DP_ENGINES, {"exposed_seconds": _NUMBER, **_NOISE}),
        **dict.fromkeys(TP_ENGINES, {"seconds": _SECONDS, "predicted_without_tp": _NUMBER,
                                     **_NOISE})})),
    "pipeline": _section(_rows(dict.fromkeys(PP_SCHEDULES, {
        "seconds": _SECONDS, "predicted_seconds": _NUMBER, **_NOISE}))),
    "noise": _section({"median_spread": _MULTIPLE, "repeats": _Optional(_COUNT),
                       "timings": _Optional(_COUNT)})})
_FILE = _Object({
    "device": _TEXT, "backend": _TEXT, "world_size": _COUNT, "torch": _TEXT, "time": _TEXT,
    "matmul_flops": _Object(dict.fromkeys(DTYPES, _or_null(_RATE))),
    "memory_bandwidth": _RATE,
    "collectives": _Object({k: _Object({"bus_bandwidth": _or_null(_RATE),
                                        "latency": _or_null(_SECONDS)}) for k in KINDS}),
    "raw": _RAW,
    "train_step": _section(dict.fromkeys(DTYPES, _STEP)),
    "data_parallel": _section(dict.fromkeys(DP_ENGINES + TP_ENGINES, _or_null(_MULTIPLE))),
    "pipeline": _section(dict.fromkeys(PP_SCHEDULES, _or_null(_SECONDS))),
    "disk": _section({"folder": _Optional(_TEXT), "write": _RATE, "read": _RATE}),
    "flags": _Optional(_Each(_TEXT, mapping=True)),
})
"""Every key a file holds, with its kind: the figures, the raw timings meshfit reads back,
and the flags (`meshfit.plan.trust`)."""


def _shown(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def _check(value: Any, kind: Any, name: str, missing: list, bad: list) -> None:
    """Add to `missing` the keys `value` lacks and to `bad` those outside their kind, each
    named by its path (``collectives.all_reduce.latency``) with its value."""
    if isinstance(kind, _Kind):
        if not kind.test(value):
            bad.append(f"{name}={_shown(value)} ({kind.what})")
        return
    if value is None and isinstance(kind, _Object) and kind.nullable:
        return
    if isinstance(kind, _Each):
        if not isinstance(value, dict if kind.mapping else list):
            bad.append(f"{name}={_shown(value)} ({'an object' if kind.mapping else 'a list'})")
            return
        items = value.items() if kind.mapping else enumerate(value)
        for key, item in items:
            _check(item, kind.kind, f"{name}.{key}" if kind.mapping else f"{name}[{key}]",
                   missing, bad)
        return
    if not isinstance(value, dict):
        bad.append(f"{name}={_shown(value)} (an object{' or null' if kind.nullable else ''})")
        return
    for key, sub in kind.keys.items():
        path = f"{name}.{key}" if name else key
        if key in value:
            _check(value[key], sub.kind if isinstance(sub, _Optional) else sub, path, missing,
                   bad)
        elif kind.sections and not isinstance(sub, _Optional):
            _check(None, sub, path, missing, bad)
        elif not isinstance(sub, _Optional):
            missing.append(path)


def _pairs(data: dict) -> list[str]:
    """The collectives whose bandwidth and latency are not both measured or both null."""
    return [f"collectives.{k} (bus_bandwidth and latency: both measured or both null)"
            for k in KINDS if (data["collectives"][k]["bus_bandwidth"] is None)
            != (data["collectives"][k]["latency"] is None)]


def _floats(obj: dict | None, keys: tuple[str, ...]) -> dict[str, float | None] | None:
    """`obj`'s figures under `keys` as floats (absent: None), or None without `obj`."""
    if obj is None:
        return None
    return {k: None if obj.get(k) is None else float(obj[k]) for k in keys}


def _step_fits(steps: dict | None) -> dict[str, TrainStepFit | None] | None:
    """The training-step fits of a checked ``train_step`` object (absent terms: 0)."""
    if steps is None:
        return None
    return {d: None if steps.get(d) is None else TrainStepFit(
        **{k: float(steps[d].get(k, 0.0)) for k in ("block_overhead", "flops",
                                                    "optimizer_per_param", "step_overhead",
                                                    "token_width", "attention_scores")})
        for d in DTYPES}


def load_calibration(path: str | os.PathLike) -> Calibration:
    """Read a `meshfit calibrate` file; raises ValueError (one line) if it is missing, of
    another schema, incomplete, or holds a value outside its kind or range. The flags it
    holds and those `meshfit.plan.trust.judge` finds in it now are the `Calibration`'s."""
    path = Path(path)
    fix = f"run `meshfit calibrate --out {path}` on the machine to plan for"
    if not path.is_file():
        raise ValueError(f"calibration file {path} does not exist; {fix}")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"calibration file {path} is not readable JSON "
                         f"({str(err).splitlines()[0]}); {fix}") from None
    if not isinstance(data, dict):
        raise ValueError(f"calibration file {path} holds no JSON object; {fix}")
    if data.get("schema") != SCHEMA:
        raise ValueError(f"calibration file {path} has schema {data.get('schema')!r}, this "
                         f"meshfit reads schema {SCHEMA}; {fix}")
    missing, bad = [], []
    _check(data, _FILE, "", missing, bad)
    if missing:
        raise ValueError(f"calibration file {path} lacks {', '.join(missing)}; {fix}")
    bad += _pairs(data) if not bad else []
    if bad:
        raise ValueError(f"calibration file {path} has invalid {', '.join(bad)}; {fix}")
    colls = data["collectives"]
    return Calibration(
        schema=SCHEMA, device=data["device"], backend=data["backend"],
        world_size=data["world_size"], torch=data["torch"], time=data["time"],
        matmul_flops=_floats(data["matmul_flops"], DTYPES),
        memory_bandwidth=float(data["memory_bandwidth"]),
        collectives={k: CollectiveFit(**_floats(colls[k], ("bus_bandwidth", "latency")))
                     for k in KINDS},
        raw=data["raw"], train_step=_step_fits(data.get("train_step")),
        data_parallel=_floats(data.get("data_parallel"), DP_ENGINES + TP_ENGINES),
        pipeline=_floats(data.get("pipeline"), PP_SCHEDULES), disk=data.get("disk"),
        flags={**(data.get("flags") or {}), **judge(data)})
