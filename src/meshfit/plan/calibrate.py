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
     "raw": {...}}

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
  (`meshfit.plan.probes._DP_SHAPES`) under that engine takes beyond the same step alone and
  its optimizer step, divided by what `meshfit.plan.fit.data_parallel_seconds` models for its
  collectives from the figures above: how much of the collectives a real step exposes, with
  its hooks, copies and waits (on a CPU nothing overlaps; on GPUs most of it does). null
  where not measured.
  Beside them "tp" and "tp_sp": a training step under tensor parallel over all N ranks
  (without and with sequence parallel) beyond the planner's prediction of everything else,
  over its modelled TP all-reduces.
* ``pipeline`` (optional; N > 1 only): per schedule (gpipe, 1f1b, interleaved_1f1b,
  zero_bubble), the seconds per micro-batch a pipeline step of the reference GPT
  (`meshfit.plan.measure._PP_SHAPES`, its blocks over all N ranks, 4N micro-batches of one
  sequence) takes beyond what the planner predicts for it from the figures above (compute,
  bubble, sends): the schedule's own work per micro-batch (its Python, the stage wrappers,
  the waits). null where not measured.
* ``raw``: the per-size timings every figure came from, and each fit's R² (on the times)
  and largest relative error under ``raw.collectives.<kind>.r2`` / ``.max_relative_error``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshfit.plan.fit import DP_ENGINES, KINDS, CollectiveFit, TrainStepFit, bus_factor

__all__ = ["DTYPES", "PP_SCHEDULES", "SCHEMA", "TP_ENGINES", "Calibration", "load_calibration"]

SCHEMA = 1
DTYPES = ("fp32", "bf16", "fp16")
TP_ENGINES = ("tp", "tp_sp")  # tensor parallel without and with sequence parallel
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")


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

    def disk_bandwidth(self) -> float | None:
        """The slower of the measured disk's write and read (bytes/s), or None."""
        if not self.disk:
            return None
        return min(float(self.disk["write"]), float(self.disk["read"]))

    def peak_flops(self, dtype: str) -> float | None:
        """The fastest matmul measured for `dtype` (FLOP/s): the peak MFU is counted
        against when a profile is used (no training step can beat it)."""
        rows = self.raw.get("matmul", {}).get(dtype) if isinstance(self.raw, dict) else None
        best = [r["flops"] for r in rows or () if isinstance(r, dict) and _number(r.get("flops"))]
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
# The kinds of value a file holds, each a test of the value as JSON gives it.
def _number(value: Any, *, null: bool = False) -> bool:
    if value is None:
        return null
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _text(value: Any) -> bool:
    return isinstance(value, str)


def _count(value: Any) -> bool:  # (a count of processes: at least one)
    return isinstance(value, int) and value >= 1


def _object(value: Any) -> bool:
    return isinstance(value, dict)


def _figure_or_null(value: Any) -> bool:  # null: not measured here
    return _number(value, null=True)


def _share_or_null(value: Any) -> bool:
    return _number(value, null=True) and (value or 0) >= 0


def _positive(value: Any) -> bool:
    return _number(value) and value > 0


_STEP_FIELDS = ("block_overhead", "flops", "optimizer_per_param")
_STEP_EXTRA = ("step_overhead", "token_width", "attention_scores")  # 0 in older files


def _step_fit_or_null(value: Any) -> bool:
    return value is None or (isinstance(value, dict) and all(
        _number(value.get(k)) for k in _STEP_FIELDS) and value["flops"] > 0 and all(
        _number(value.get(k, 0.0)) for k in _STEP_EXTRA))


_FIELDS = {
    "device": _text, "backend": _text, "world_size": _count, "torch": _text, "time": _text,
    "matmul_flops": dict.fromkeys(DTYPES, _figure_or_null),
    "memory_bandwidth": _number,
    "collectives": {k: dict.fromkeys(("bus_bandwidth", "latency"), _figure_or_null)
                    for k in KINDS},
    "raw": _object,
}
"""Every key a file must hold, with the kind of its value (a dict: an object, its keys)."""
_SECTIONS = {
    "train_step": dict.fromkeys(DTYPES, _step_fit_or_null),
    "data_parallel": dict.fromkeys(DP_ENGINES + TP_ENGINES, _share_or_null),
    "pipeline": dict.fromkeys(PP_SCHEDULES, _share_or_null),
    "disk": {"write": _positive, "read": _positive},
}
"""The objects a file may hold (older files, one process or no ``--offload-dir`` lack them,
or write null); a key of theirs that is absent is checked as null."""


def _check(obj: dict, schema: dict, prefix: str, missing: list | None, bad: list) -> None:
    """Add to `missing` the keys of `schema` that `obj` lacks and to `bad` those whose value is
    not of their kind, each named by its path (``collectives.all_reduce.latency``). `missing`
    None (the optional sections): an absent key is checked as null, a null object passes."""
    for key, kind in schema.items():
        name = prefix + key
        if key not in obj and missing is not None:
            missing.append(name)
        elif isinstance(kind, dict):
            value = obj.get(key)
            if isinstance(value, dict):
                _check(value, kind, name + ".", missing, bad)
            elif value is not None or missing is not None:
                bad.append(name)
        elif not kind(obj.get(key)):
            bad.append(name)


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
        **{k: float(steps[d].get(k, 0.0)) for k in _STEP_FIELDS + _STEP_EXTRA}) for d in DTYPES}


def load_calibration(path: str | os.PathLike) -> Calibration:
    """Read a `meshfit calibrate` file; raises ValueError (one line) if it is missing, of
    another schema or incomplete."""
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
    _check(data, _FIELDS, "", missing, bad)
    _check(data, _SECTIONS, "", None, bad)
    if missing:
        raise ValueError(f"calibration file {path} lacks {', '.join(missing)}; {fix}")
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
        pipeline=_floats(data.get("pipeline"), PP_SCHEDULES), disk=data.get("disk"))
