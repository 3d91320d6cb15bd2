"""The models a `meshfit calibrate` file's figures belong to, and the fits that find them.

Three models, each used twice: by the probes (`meshfit.plan.probes`), which fit them to
timings, and by the planner (`meshfit.plan.search`), which predicts with the fitted figures.

* a collective: ``time(S) = latency + bus_factor(kind, n) · S / bus_bandwidth``
  (`CollectiveFit`, fitted by `fit_latency_bandwidth`);
* a training step's forward and backward: `STEP_TERMS` over `step_columns` (`TrainStepFit`,
  fitted by `_fit_step`);
* the data-parallel engines' collectives in one optimizer step (`data_parallel_seconds`).

The file's schema and what each figure means: `meshfit.plan.calibrate`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["DDP_BUCKET_BYTES", "DP_ENGINES", "KINDS", "PP_SCHEDULES", "RATE_MAX", "STEP_TERMS",
           "TP_ENGINES",
           "CollectiveFit", "TrainStepFit", "bus_factor", "data_parallel_seconds",
           "fit_latency_bandwidth", "step_columns"]

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
DP_ENGINES = ("ddp", "zero1", "fsdp2")
TP_ENGINES = ("tp", "tp_sp")  # tensor parallel without and with sequence parallel
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
DDP_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb: one all-reduce per bucket
RATE_MAX = 1e18
"""The most FLOP/s or bytes/s a figure may claim: a thousand times the fastest device today
(~1e16 dense FLOP/s, ~1e13 bytes/s of HBM). A rate beyond it is a typo or a broken timer, and
it would make its term of the step vanish unnoticed."""


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_figures(owner: str, rates: dict[str, float | None],
                   seconds: dict[str, float | None], *, nullable: bool = True) -> None:
    """One-line ValueError for the first figure outside its range: a rate (FLOP/s, bytes/s)
    in (0, `RATE_MAX`], seconds finite and >= 0; None passes (not measured) if `nullable`."""
    for name, value in rates.items():
        if (value is not None or not nullable) and not (_finite(value)
                                                         and 0 < value <= RATE_MAX):
            raise ValueError(f"{owner} {name}={value!r} must be a rate > 0 and <= {RATE_MAX:g} "
                             "(a zero or negative one would divide by zero or turn a cost into "
                             "a gain); measure it again with meshfit calibrate")
    for name, value in seconds.items():
        if (value is not None or not nullable) and not (_finite(value) and value >= 0):
            raise ValueError(f"{owner} {name}={value!r} must be seconds >= 0 (finite); measure "
                             "it again with meshfit calibrate")


# ---------------------------------------------------------------------------- collectives
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

    def __post_init__(self):
        _check_figures("CollectiveFit", {"bus_bandwidth": self.bus_bandwidth},
                       {"latency": self.latency})
        if (self.bus_bandwidth is None) != (self.latency is None):
            raise ValueError(f"CollectiveFit bus_bandwidth={self.bus_bandwidth!r} and latency="
                             f"{self.latency!r}: both measured or neither (null)")


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


# ---------------------------------------------------------------------------- training steps
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


@dataclass(frozen=True)
class TrainStepFit:
    """``seconds(forward + backward of a micro-batch) = step_overhead + block_overhead ·
    blocks + FLOPs / flops``, and an AdamW step's seconds per parameter (see
    `meshfit.plan.calibrate`'s docstring)."""

    block_overhead: float
    flops: float
    optimizer_per_param: float
    step_overhead: float = 0.0
    token_width: float = 0.0
    attention_scores: float = 0.0

    def __post_init__(self):
        _check_figures("TrainStepFit", {"flops": self.flops}, {
            k: getattr(self, k) for k in ("step_overhead", "block_overhead", "token_width",
                                          "attention_scores", "optimizer_per_param")},
                       nullable=False)

    def seconds(self, *, d_model: int, n_layer: float, seq_len: int, tokens: float,
                heads: float, flops: float) -> float:
        """One micro-batch's forward and backward (`step_columns`' terms)."""
        cols = step_columns(d_model=d_model, n_layer=n_layer, seq_len=seq_len, tokens=tokens,
                            heads=heads, flops=flops)
        coef = (self.step_overhead, self.block_overhead, self.token_width,
                self.attention_scores, 1.0 / self.flops)
        return sum(c * x for c, x in zip(coef, cols))


def _fit_step(rows: list[dict], peak: float) -> dict[str, float]:
    """Least squares on relative errors (weights 1/seconds) of the rows' seconds against
    `step_columns`, every coefficient >= 0 (a negative one is dropped and the rest refitted)
    and the FLOP rate at most `peak`; with the fit's largest relative error and its R² (on
    the times, as `fit_latency_bandwidth`'s)."""
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
    residual = X @ coef - t
    out = dict(zip(STEP_TERMS, (float(c) for c in coef)))
    out["flops"] = float(1.0 / coef[last])
    out["max_relative_error"] = float(np.max(np.abs(residual) / t))
    ss_tot = float(np.sum((t - t.mean()) ** 2))
    out["r2"] = 1.0 - float(np.sum(residual**2)) / ss_tot if ss_tot > 0 else 1.0
    return out


# ---------------------------------------------------------------------------- data parallel
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
