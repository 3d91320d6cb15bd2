"""This machine measured: its compute, memory and collective speeds (`meshfit calibrate`).

`meshfit.plan.measure.measure` runs on every rank of a job at once (the command,
`meshfit.cli.calibrate`, starts N processes through meshfit's launcher, or runs one here),
and rank 0 writes one JSON file
that the layout planner reads with `load_calibration`. Device and backend are chosen as
`meshfit.distributed.init` does: CUDA and NCCL where CUDA is available, the CPU and gloo
otherwise or with ``--cpu`` / ``MESHFIT_CPU=1``.

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
  attention_scores · tokens · positions · heads · blocks + FLOPs / flops`` (`STEP_TERMS`):
  what a micro-batch and a block cost besides their FLOPs (the framework, kernel launches),
  the memory-bound elementwise work, the attention scores, and the FLOP/s of the matrix
  products (at most the fastest matmul); ``optimizer_per_param``: the seconds per parameter
  of one AdamW step (foreach) on the largest shape. null where the dtype is not timed.
* ``data_parallel`` (optional; N > 1 only): per engine ("ddp", "zero1": DDP with
  ZeroRedundancyOptimizer, "fsdp2": ZeRO-3), the seconds a training step of the reference GPT
  (`_DP_SHAPE`) under that engine takes beyond the same step alone and its optimizer step,
  divided by what `data_parallel_seconds` models for its collectives from the figures
  above: how much of the collectives a real step exposes, with its hooks, copies and waits
  (on a CPU nothing overlaps; on GPUs most of it does). null where not measured.
  Beside them "tp" and "tp_sp": a training step under tensor parallel over all N ranks
  (without and with sequence parallel) beyond the planner's prediction of everything else,
  over its modelled TP all-reduces.
* ``pipeline`` (optional; N > 1 only): per schedule (gpipe, 1f1b, interleaved_1f1b,
  zero_bubble), the seconds per micro-batch a pipeline step of the reference GPT
  (`_PP_SHAPES`, its blocks over all N ranks, 4N micro-batches of one sequence) takes beyond
  what the planner predicts for it from the figures above (compute, bubble, sends): the
  schedule's own work per micro-batch (its Python, the stage wrappers, the waits). null
  where not measured.
* ``raw``: the per-size timings every figure came from, and each fit's R² (on the times)
  and largest relative error under ``raw.collectives.<kind>.r2`` / ``.max_relative_error``.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


__all__ = ["DP_ENGINES", "PP_SCHEDULES", "TP_ENGINES", "DTYPES", "KINDS", "SCHEMA", "STEP_TERMS", "Calibration",
           "CollectiveFit", "TrainStepFit", "bus_factor", "data_parallel_seconds", "step_columns",
           "fit_latency_bandwidth", "load_calibration"]

SCHEMA = 1
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
DTYPES = ("fp32", "bf16", "fp16")
_MATMUL_SECONDS = 0.5  # no matmul size whose single product would take longer than this
_CPU_SIZES = tuple(4096 * 4**i for i in range(8))  # 4 KiB ... 64 MiB
_GPU_SIZES = tuple(16384 * 4**i for i in range(9))  # 16 KiB ... 1 GiB
DP_ENGINES = ("ddp", "zero1", "fsdp2")
TP_ENGINES = ("tp", "tp_sp")  # tensor parallel without and with sequence parallel
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
DDP_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb: one all-reduce per bucket


def data_parallel_seconds(engine: str, collective, *, params: float, units: int, shard: int,
                          replicate: int, spans: tuple[int, int], gathers: int,
                          gathered_bytes: float) -> float:
    """The modelled seconds of one optimizer step's data-parallel collectives on this rank's
    `params` (elements) over `shard` x `replicate` ranks: DDP, one all-reduce of the fp32
    gradients per 25 MiB bucket (ZeRO-1: then the parameters' all-gather); FSDP2 ("fsdp2"),
    per unit (`units`: the blocks and the root) `gathers` all-gathers of the parameters at
    `gathered_bytes` each, a reduce-scatter of the fp32 gradients and, with replicas, their
    all-reduce. `collective(kind, nbytes, n, span)`: one collective's seconds; `spans`: the
    ranks the data-parallel and the shard groups span."""
    dp_span, shard_span = spans
    grads = params * 4
    if engine in ("ddp", "zero1"):
        buckets = max(1, math.ceil(grads / DDP_BUCKET_BYTES))
        out = buckets * collective("all_reduce", grads / buckets, replicate * shard, dp_span)
        if engine == "zero1":
            out += collective("all_gather", grads, shard, shard_span)
        return out
    if engine != "fsdp2":
        raise ValueError(f"engine={engine!r} is not one of {', '.join(DP_ENGINES)}")
    units = max(1, units)
    out = gathers * units * collective("all_gather", params * gathered_bytes / units, shard,
                                       shard_span)
    out += units * collective("reduce_scatter", grads / units, shard, shard_span)
    if replicate > 1:
        out += units * collective("all_reduce", grads / shard / units, replicate, dp_span)
    return out


def bus_factor(kind: str, n: int) -> float:
    """The bytes a collective of `kind` moves over the busiest link, per byte of S."""
    if kind not in KINDS:
        raise ValueError(f"collective kind={kind!r} is unknown; use one of {', '.join(KINDS)}")
    if kind == "send_recv":
        return 1.0
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n
    return (n - 1) / n


@dataclass(frozen=True)
class CollectiveFit:
    """``time(S) = latency + factor · S / bus_bandwidth``; None where nothing was measured."""

    bus_bandwidth: float | None
    """bytes/s"""
    latency: float | None
    """seconds"""


@dataclass(frozen=True)
class TrainStepFit:
    """``seconds(forward + backward of a micro-batch) = step_overhead + block_overhead ·
    blocks + FLOPs / flops``, and an AdamW step's seconds per parameter (see the module
    docstring)."""

    block_overhead: float
    flops: float
    optimizer_per_param: float
    step_overhead: float = 0.0
    token_width: float = 0.0
    attention_scores: float = 0.0

    def seconds(self, *, d_model: int, n_layer: float, seq_len: int, tokens: float,
                heads: float, flops: float) -> float:
        """One micro-batch's forward and backward (`step_columns`' terms)."""
        cols = step_columns(d_model=d_model, n_layer=n_layer, seq_len=seq_len, tokens=tokens,
                            heads=heads, flops=flops)
        coef = (self.step_overhead, self.block_overhead, self.token_width,
                self.attention_scores, 1.0 / self.flops)
        return sum(c * x for c, x in zip(coef, cols))


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


def _number(value: Any, *, null: bool = False) -> bool:
    if value is None:
        return null
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


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
    missing = [k for k in ("device", "backend", "world_size", "torch", "time", "matmul_flops",
                           "memory_bandwidth", "collectives", "raw") if k not in data]
    flops, colls = data.get("matmul_flops"), data.get("collectives")
    if isinstance(flops, dict):
        missing += [f"matmul_flops.{d}" for d in DTYPES if d not in flops]
    if isinstance(colls, dict):
        for kind in KINDS:
            entry = colls.get(kind)
            missing += [f"collectives.{kind}.{f}" for f in ("bus_bandwidth", "latency")
                        if not isinstance(entry, dict) or f not in entry]
    if missing:
        raise ValueError(f"calibration file {path} lacks {', '.join(missing)}; {fix}")
    bad = [k for k in ("device", "backend", "torch", "time") if not isinstance(data[k], str)]
    if not (isinstance(data["world_size"], int) and data["world_size"] >= 1):
        bad.append("world_size")
    if not _number(data["memory_bandwidth"]):
        bad.append("memory_bandwidth")
    if not isinstance(flops, dict):
        bad.append("matmul_flops")
    else:
        bad += [f"matmul_flops.{d}" for d in DTYPES if not _number(flops[d], null=True)]
    if not isinstance(colls, dict):
        bad.append("collectives")
    else:
        bad += [f"collectives.{kind}.{f}" for kind in KINDS for f in ("bus_bandwidth", "latency")
                if not _number(colls[kind][f], null=True)]
    if not isinstance(data["raw"], dict):
        bad.append("raw")
    if bad:
        raise ValueError(f"calibration file {path} has invalid {', '.join(bad)}; {fix}")
    steps = data.get("train_step")
    fits = None
    if isinstance(steps, dict):
        fits = {}
        for d in DTYPES:
            entry = steps.get(d)
            keys = ("block_overhead", "flops", "optimizer_per_param")
            extra = ("step_overhead", "token_width", "attention_scores")  # 0 when absent
            if isinstance(entry, dict) and all(_number(entry.get(k)) for k in keys) \
                    and entry["flops"] > 0 and all(_number(entry.get(k, 0.0)) for k in extra):
                fits[d] = TrainStepFit(**{k: float(entry[k]) for k in keys},
                                       **{k: float(entry.get(k, 0.0)) for k in extra})
            elif entry is None:
                fits[d] = None
            else:
                raise ValueError(f"calibration file {path} has invalid train_step.{d}; {fix}")
    engines = data.get("data_parallel")
    if engines is not None:
        if not isinstance(engines, dict) or not all(
                _number(engines.get(e), null=True) and (engines.get(e) or 0) >= 0
                for e in DP_ENGINES + TP_ENGINES):
            raise ValueError(f"calibration file {path} has invalid data_parallel; {fix}")
        engines = {e: None if engines.get(e) is None else float(engines[e])
                   for e in DP_ENGINES + TP_ENGINES}
    schedules = data.get("pipeline")
    if schedules is not None:
        if not isinstance(schedules, dict) or not all(
                _number(schedules.get(k), null=True) and (schedules.get(k) or 0) >= 0
                for k in PP_SCHEDULES):
            raise ValueError(f"calibration file {path} has invalid pipeline; {fix}")
        schedules = {k: None if schedules.get(k) is None else float(schedules[k])
                     for k in PP_SCHEDULES}
    disk = data.get("disk")
    if disk is not None and not (isinstance(disk, dict) and all(
            _number(disk.get(k)) and disk[k] > 0 for k in ("write", "read"))):
        raise ValueError(f"calibration file {path} has invalid disk; {fix}")
    return Calibration(
        schema=SCHEMA, device=data["device"], backend=data["backend"], train_step=fits,
        data_parallel=engines, pipeline=schedules, disk=disk,
        world_size=data["world_size"], torch=data["torch"], time=data["time"],
        matmul_flops={d: None if flops[d] is None else float(flops[d]) for d in DTYPES},
        memory_bandwidth=float(data["memory_bandwidth"]),
        collectives={k: CollectiveFit(
            bus_bandwidth=None if colls[k]["bus_bandwidth"] is None
            else float(colls[k]["bus_bandwidth"]),
            latency=None if colls[k]["latency"] is None else float(colls[k]["latency"]))
            for k in KINDS},
        raw=data["raw"])


def fit_latency_bandwidth(nbytes, seconds, factor: float = 1.0) -> dict[str, Any]:
    """Least-squares fit of ``seconds = latency + factor · nbytes / bus_bandwidth``, weighted
    by 1/seconds² and redone with latency 0 when the latency comes out negative (or the slope
    not positive). Returns ``{"latency", "bus_bandwidth", "r2", "max_relative_error",
    "method"}``; r2 is on the times themselves."""
    x = [factor * float(s) for s in nbytes]
    t = [float(v) for v in seconds]
    if len(x) != len(t) or not x or min(t) <= 0 or min(x) <= 0:
        raise ValueError("fit_latency_bandwidth needs as many positive sizes as positive times")
    w = [1.0 / v**2 for v in t]
    sw = sum(w)
    mx = sum(wi * xi for wi, xi in zip(w, x)) / sw
    mt = sum(wi * ti for wi, ti in zip(w, t)) / sw
    sxx = sum(wi * (xi - mx) ** 2 for wi, xi in zip(w, x))
    sxt = sum(wi * (xi - mx) * (ti - mt) for wi, xi, ti in zip(w, x, t))
    slope = sxt / sxx if sxx > 0 else 0.0
    latency = mt - slope * mx
    method = "weighted least squares"
    if slope <= 0 or latency < 0:
        slope = sum(wi * xi * ti for wi, xi, ti in zip(w, x, t)) / sum(
            wi * xi * xi for wi, xi in zip(w, x))
        latency = 0.0
        method = "weighted least squares through the origin"
    mean = sum(t) / len(t)
    ss_res = sum((latency + slope * xi - ti) ** 2 for xi, ti in zip(x, t))
    ss_tot = sum((ti - mean) ** 2 for ti in t)
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    worst = max(abs(latency + slope * xi - ti) / ti for xi, ti in zip(x, t))
    return {"latency": latency, "bus_bandwidth": 1.0 / slope, "r2": r2,
            "max_relative_error": worst, "method": method}


# ---------------------------------------------------------------------------------------
# measuring (every rank runs the same steps, so sizes and repeat counts must agree)


class _Ranks:
    def __init__(self, env):
        import torch
        import torch.distributed as dist

        self.torch, self.dist, self.env = torch, dist, env
        self.device = env.device
        self.group = env.is_distributed and dist.is_initialized()

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        self.sync()
        if self.group:
            self.dist.barrier()

    def max(self, values: list[float]) -> list[float]:
        """Elementwise maximum over the ranks."""
        if not self.group:
            return list(values)
        t = self.torch.tensor(values, dtype=self.torch.float64, device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return t.tolist()

    def time(self, op, *, target: float, repeats: int = 5, warmup: int = 1) -> tuple[float, int]:
        """Median seconds per call of `op` on the slowest rank, and the calls per timing."""
        for _ in range(warmup):
            op()
        self.barrier()
        t0 = time.perf_counter()
        op()
        self.sync()
        once = self.max([time.perf_counter() - t0])[0]
        iters = max(1, min(200, int(target / max(once, 1e-7))))
        samples = []
        for _ in range(repeats):
            self.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                op()
            self.sync()
            samples.append((time.perf_counter() - t0) / iters)
        return self.max([statistics.median(samples)])[0], iters


def _matmul_once(r: _Ranks, n: int, dtype) -> dict[str, Any] | None:
    """One n×n product of `dtype` timed on every rank; None on every rank if any failed."""
    torch = r.torch
    a = b = None
    try:
        a = torch.randn(n, n, device=r.device).to(dtype)
        b = torch.randn(n, n, device=r.device).to(dtype)
        torch.mm(a, b)  # warm-up
        r.sync()
        failed = 0.0
    except (RuntimeError, NotImplementedError):  # no kernel for the dtype, or out of memory
        failed = 1.0
    if r.max([failed])[0] > 0:
        return None
    # `r.time` runs one more untimed product to choose its loop length
    seconds, iters = r.time(lambda: torch.mm(a, b), target=0.02, repeats=3, warmup=0)
    return {"n": n, "seconds": seconds, "iters": iters, "flops": 2.0 * n**3 / seconds}


def _matmul(r: _Ranks) -> tuple[dict[str, float | None], dict[str, Any]]:
    torch = r.torch
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    cuda = r.device.type == "cuda"
    sizes = [2**k for k in (range(10, 15) if cuda else range(7, 13))]  # GPU 1K..16K, CPU 128..4K
    flops, raw = {}, {"fp32_precision": torch.get_float32_matmul_precision()}
    for name, dtype in dtypes.items():
        rows = []
        for n in sizes:
            row = _matmul_once(r, n, dtype)
            if row is None:
                break
            rows.append(row)
            if row["seconds"] * 8 > _MATMUL_SECONDS:  # the next size (8x the work): too slow
                break
        raw[name] = rows
        flops[name] = rows[-1]["flops"] if rows else None
    return flops, raw


def _memory(r: _Ranks) -> tuple[float, dict[str, Any]]:
    torch = r.torch
    nbytes = (1 << 30) if r.device.type == "cuda" else (256 << 20)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=r.device).fill_(1.0)
    dst = torch.empty_like(src)
    seconds, iters = r.time(lambda: dst.copy_(src), target=0.1, repeats=5)
    return 2.0 * nbytes / seconds, {"bytes": nbytes, "seconds": seconds, "iters": iters,
                                    "counted": "2 x bytes (read + write)"}


def _collective_op(r: _Ranks, kind: str, size: int):
    """The callable for one collective of about `size` bytes, and S as it really is."""
    torch, dist = r.torch, r.dist
    n, rank = r.env.world_size, r.env.rank
    per_rank = max(1, size // (4 * n))  # fp32 elements in one rank's chunk

    def new(numel: int):
        return torch.ones(numel, dtype=torch.float32, device=r.device)

    if kind == "all_reduce":
        t = new(max(1, size // 4))
        return (lambda: dist.all_reduce(t)), t.numel() * 4
    if kind == "all_gather":
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        inp, out = new(per_rank), new(per_rank * n)
        return (lambda: gather(out, inp)), out.numel() * 4
    if kind == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        inp, out = new(per_rank * n), new(per_rank)
        return (lambda: scatter(out, inp)), inp.numel() * 4
    if kind == "all_to_all":
        inp, out = new(per_rank * n), new(per_rank * n)
        return (lambda: dist.all_to_all_single(out, inp)), inp.numel() * 4
    t = new(max(1, size // 4))  # send_recv: 0->1, 2->3, ...; an odd last rank waits
    if rank % 2 == 0 and rank + 1 < n:
        return (lambda: dist.send(t, rank + 1)), t.numel() * 4
    if rank % 2 == 1:
        return (lambda: dist.recv(t, rank - 1)), t.numel() * 4
    return (lambda: None), t.numel() * 4


def _collectives(r: _Ranks, sizes: tuple[int, ...]) -> tuple[dict, dict]:
    n = r.env.world_size
    if not r.group or n < 2:
        return ({k: {"bus_bandwidth": None, "latency": None} for k in KINDS},
                {"note": "one process: no collectives measured"})
    target = 0.01 if r.device.type == "cuda" else 0.02
    fits, raw = {}, {}
    for kind in KINDS:
        nbytes, seconds, iters = [], [], []
        for size in sizes:
            op, s_bytes = _collective_op(r, kind, size)
            sec, it = r.time(op, target=target, repeats=5, warmup=1)
            nbytes.append(s_bytes)
            seconds.append(sec)
            iters.append(it)
            del op
        factor = bus_factor(kind, n)
        fit = fit_latency_bandwidth(nbytes, seconds, factor)
        fits[kind] = {"bus_bandwidth": fit["bus_bandwidth"], "latency": fit["latency"]}
        raw[kind] = {"nbytes": nbytes, "seconds": seconds, "iters": iters, "factor": factor,
                     "r2": fit["r2"], "max_relative_error": fit["max_relative_error"],
                     "fit": fit["method"]}
    return fits, raw


_STEP_SHAPES = ((64, 2, 64, 8), (64, 6, 64, 8), (128, 2, 256, 8), (128, 4, 128, 8),
                (256, 2, 128, 8), (256, 4, 256, 4), (64, 2, 256, 8), (192, 3, 192, 4))
"""(d_model, n_layer, seq_len, batch) of the reference GPT the training steps are timed on:
widths, depths and lengths varied apart, so that each term of the fit is seen."""
STEP_TERMS = ("step_overhead", "block_overhead", "token_width", "attention_scores", "flops")
"""The fit's terms, each a column of `step_columns`: seconds per micro-batch, per block, per
token x width x block (memory-bound elementwise work: norms, activations, residuals), per
token x position x head x block (the attention score matrices), and FLOPs at the rate
``flops`` (FLOP/s)."""


def step_columns(*, d_model: int, n_layer: float, seq_len: int, tokens: float, heads: float,
                 flops: float) -> list[float]:
    """The fit's regressors for one micro-batch of `tokens` tokens on `n_layer` blocks."""
    return [1.0, n_layer, tokens * d_model * n_layer, tokens * seq_len * heads * n_layer,
            flops]


def _train_steps(r: _Ranks, flops: dict) -> tuple[dict, dict]:
    """Per dtype that ran a matmul: the training-step fit (module docstring) and its rows.
    fp16 is timed on CUDA only (on a CPU its autocast is an emulation nobody trains with)."""
    torch = r.torch
    from meshfit.models import GPT, GPTConfig

    dtypes = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
    fits, raw = {}, {}
    for name, dtype in dtypes.items():
        if flops.get(name) is None or (name == "fp16" and r.device.type != "cuda"):
            fits[name] = None
            continue
        rows = []
        for d, layers, seq, batch in _STEP_SHAPES:
            torch.manual_seed(0)
            heads = max(1, d // 32)
            model = GPT(GPTConfig(vocab_size=256, d_model=d, n_layer=layers, n_head=heads,
                                  d_ff=4 * d, max_seq_len=seq))
            model.to(r.device)
            x = torch.randint(0, 256, (batch, seq + 1), device=r.device)

            def fwd_bwd():
                with torch.autocast(r.device.type, dtype=dtype, enabled=dtype is not None):
                    loss = model(x[:, :-1], x[:, 1:])
                loss.backward()
                for p in model.parameters():
                    p.grad = None

            seconds, iters = r.time(fwd_bwd, target=0.05, repeats=3, warmup=1)
            rows.append({"d_model": d, "n_layer": layers, "seq_len": seq, "batch": batch,
                         "heads": heads,
                         "flops": model.config.flops_per_token(seq) * batch * seq,
                         "seconds": seconds, "iters": iters})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt_seconds, _ = r.time(opt.step, target=0.05, repeats=3, warmup=1)
        n_params = sum(p.numel() for p in model.parameters())
        fit = _fit_step(rows, peak=flops[name])
        fit["optimizer_per_param"] = opt_seconds / n_params
        fits[name] = fit
        raw[name] = {"rows": rows, "optimizer_seconds": opt_seconds, "params": n_params,
                     "max_relative_error": fit.pop("max_relative_error")}
    return fits, raw


def _fit_step(rows: list[dict], peak: float) -> dict[str, float]:
    """Least squares on relative errors (weights 1/seconds) of the rows' seconds against
    `step_columns`, every coefficient >= 0 (a negative one is dropped and the rest refitted)
    and the FLOP rate at most `peak`."""
    import numpy as np

    X = np.array([step_columns(d_model=r["d_model"], n_layer=r["n_layer"],
                               seq_len=r["seq_len"], tokens=r["batch"] * r["seq_len"],
                               heads=r.get("heads", max(1, r["d_model"] // 32)),
                               flops=r["flops"]) for r in rows])
    t = np.array([r["seconds"] for r in rows])
    w = 1.0 / t
    scale = X.max(axis=0)  # columns of one size (FLOPs are ~1e10 times the intercept)
    last = len(STEP_TERMS) - 1

    def solve(free, target):
        coef = np.zeros(len(STEP_TERMS))
        while free:  # drop a term that comes out negative, refit the rest
            sol, *_ = np.linalg.lstsq(X[:, free] / scale[free] * w[:, None], target * w,
                                      rcond=None)
            if (sol >= 0).all():
                coef[free] = sol / scale[free]
                return coef
            free = [f for k, f in enumerate(free) if k != int(np.argmin(sol))]
        return coef

    coef = solve(list(range(len(STEP_TERMS))), t)
    if coef[last] < 1.0 / peak:  # no faster than the fastest matmul: the rest refitted
        coef = solve(list(range(last)), t - X[:, last] / peak)
        coef[last] = 1.0 / peak
    err = float(np.max(np.abs(X @ coef - t) / t))
    out = dict(zip(STEP_TERMS, (float(c) for c in coef)))
    out["flops"] = float(1.0 / coef[last])
    out["max_relative_error"] = err
    return out


_DP_SHAPES = {"cpu": (192, 3, 192, 4), "cuda": (1024, 4, 1024, 8)}
"""(d_model, n_layer, seq_len, batch) of the reference GPT the engines are timed on."""


def _data_parallel(r: _Ranks, colls: dict, fit: dict | None) -> tuple[dict | None, dict]:
    """Per engine, the exposed share of its modelled collectives (module docstring) and the
    timings it came from; (None, {}) on one process or without an fp32 step fit."""
    if not r.group or fit is None or any(colls[k]["latency"] is None for k in
                                         ("all_reduce", "all_gather", "reduce_scatter")):
        return None, {}
    torch = r.torch
    from torch.distributed.device_mesh import init_device_mesh

    from meshfit.models import GPT, GPTConfig
    from meshfit.parallel.ddp import apply_ddp
    from meshfit.parallel.fsdp import apply_fsdp
    from meshfit.parallel.zero1 import apply_zero1

    n = r.env.world_size
    d, layers, seq, batch = _DP_SHAPES["cuda" if r.device.type == "cuda" else "cpu"]
    mesh = init_device_mesh(r.device.type, (n,))
    x = torch.randint(0, 256, (batch, seq + 1), device=r.device)

    def model():
        torch.manual_seed(0)
        return GPT(GPTConfig(vocab_size=256, d_model=d, n_layer=layers, n_head=d // 32,
                             d_ff=4 * d, max_seq_len=seq)).to(r.device)

    def fwd_bwd(m):
        m(x[:, :-1], x[:, 1:]).backward()

    plain = model()
    params = sum(p.numel() for p in plain.parameters())

    def alone():
        fwd_bwd(plain)
        for p in plain.parameters():
            p.grad = None

    base, _ = r.time(alone, target=0.3, repeats=3, warmup=1)

    def collective(kind, nbytes, k, span):
        fit = colls[kind]
        return 0.0 if k <= 1 or nbytes <= 0 else \
            fit["latency"] + bus_factor(kind, k) * nbytes / fit["bus_bandwidth"]

    scales, raw = {}, {"shape": {"d_model": d, "n_layer": layers, "seq_len": seq,
                                 "batch": batch, "params": params}, "alone_seconds": base}
    for engine in DP_ENGINES:
        m = model()
        m = apply_fsdp(m, mesh, reshard_after_forward=True) if engine == "fsdp2" else \
            apply_ddp(m, mesh, device=r.device)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=True)
        if engine == "zero1":
            opt = apply_zero1(opt, mesh.get_group())

        def step(m=m, opt=opt):
            fwd_bwd(m)
            opt.step()
            opt.zero_grad(set_to_none=True)

        seconds, _ = r.time(step, target=0.3, repeats=3, warmup=2)
        optimizer = params / (1 if engine == "ddp" else n) * fit["optimizer_per_param"]
        exposed = max(0.0, seconds - base - optimizer)
        modelled = data_parallel_seconds(engine, collective, params=params, units=layers + 1,
                                         shard=n, replicate=1, spans=(n, n), gathers=2,
                                         gathered_bytes=4)
        scales[engine] = exposed / modelled
        raw[engine] = {"seconds": seconds, "optimizer_seconds": optimizer,
                       "exposed_seconds": exposed, "modelled_seconds": modelled}
        del m, opt
    return scales, raw
