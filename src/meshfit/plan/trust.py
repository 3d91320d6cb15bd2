"""Which figures of a `meshfit calibrate` file can be told from noise.

`meshfit calibrate` writes its figures and, beside them, ``flags``: the figures it does not
vouch for, each with the reason (`judge`); `meshfit.plan.calibrate.load_calibration` judges
the file again (so a file written before the flags existed is judged too) and the planner
(`meshfit.plan.cost.Cluster`) uses no flagged figure: it falls back to what it assumes
without a profile (the device and link tables, the assumed overlap) and says so.

A figure is flagged when:

* its fit explains nothing: a collective's ``latency + factor · S / bus_bandwidth`` or a
  training step's `meshfit.plan.fit.STEP_TERMS` with R² (on the times) at most `R2_MIN`,
  or a collective whose latency came out negative and was refitted through the origin (the
  file's 0 s latency: the times do not grow as the model says);
* it is a difference that the noise covers: the data-parallel engines' exposed seconds (a
  step under the engine minus the step alone and its optimizer), tensor parallel's and the
  pipeline schedules' seconds beyond the planner's prediction, each at most the noise of
  the timings it was taken from (``noise_seconds``: half of each timing's range over its
  repeats, plus the drift of the step alone timed before and after the engines), or below
  0 (written as 0). Such figures were written silently before the flags existed: DDP
  "x0.00", then "x21.47" the next run;
* the whole machine is too noisy to measure (``"machine"``): the repeats of a timing
  spread (max - min over their median) by more than `NOISE_MAX` in the median over all
  timings. Then no figure of the file is used.
"""

from __future__ import annotations

import statistics
from typing import Any

from meshfit.plan.fit import DP_ENGINES, KINDS, PP_SCHEDULES, TP_ENGINES

__all__ = ["NOISE_MAX", "R2_MIN", "judge", "spread"]

R2_MIN = 0.9
"""A fit whose R² is at most this explains too little of the times it was fitted to: one
tenth of their variance or more is noise or another law than the model's."""
NOISE_MAX = 0.25
"""The largest median spread of a timing's repeats ((max - min) / median) a machine may have
for its figures to be used: beyond it, two runs disagree by as much as the effects measured
(the differences above are a few percent of a step)."""


def spread(samples: list[float]) -> float:
    """(max - min) / median of a timing's repeats: 0 for one sample."""
    middle = statistics.median(samples)
    return (max(samples) - min(samples)) / middle if middle > 0 else 0.0


def judge(data: dict[str, Any]) -> dict[str, str]:
    """The flags of a calibration file's contents (its figures and ``raw``, already checked
    for their kinds and ranges): {figure path: why it is not used}; "machine" flags all."""
    raw = data.get("raw") or {}
    flags = {}
    noise = raw.get("noise") or {}
    if noise.get("median_spread") is not None and noise["median_spread"] > NOISE_MAX:
        flags["machine"] = (f"too noisy to measure: the {noise.get('repeats', 'few')} repeats "
                            f"of a timing spread by {noise['median_spread']:.0%} of their "
                            f"median (the median over {noise.get('timings', 'all')} timings; "
                            f"more than {NOISE_MAX:.0%}); rerun meshfit calibrate when the "
                            "machine is idle")
    flags.update(_fits(data, raw))
    flags.update(_differences(data, raw))
    for figure, bases in _MEASURED_AGAINST.items():  # a difference from a flagged figure
        base = next((b for b in bases if b in flags), None)
        if figure not in flags and base is not None and _present(data, figure):
            flags[figure] = f"measured against {base}, which is not used"
    return flags


_MEASURED_AGAINST = {
    "data_parallel.ddp": ("collectives.all_reduce",),
    "data_parallel.zero1": ("collectives.all_reduce", "collectives.all_gather"),
    "data_parallel.fsdp2": ("collectives.all_gather", "collectives.reduce_scatter"),
    **{f"data_parallel.{e}": ("collectives.all_reduce", "train_step.fp32")
       for e in TP_ENGINES},
    **{f"pipeline.{s}": ("collectives.send_recv", "train_step.fp32") for s in PP_SCHEDULES}}
"""The figures each difference was modelled with: the engines' collectives, tensor
parallel's all-reduces and the pipeline's sends, and for these two the planner's
prediction of all else (the fp32 training-step fit)."""


def _present(data: dict, figure: str) -> bool:
    section, _, key = figure.partition(".")
    return (data.get(section) or {}).get(key) is not None


def _fits(data: dict, raw: dict) -> dict[str, str]:
    """Collective and training-step fits that explain nothing."""
    flags = {}
    for kind in KINDS:
        fit = (data.get("collectives") or {}).get(kind) or {}
        r2 = ((raw.get("collectives") or {}).get(kind) or {}).get("r2")
        if fit.get("latency") is None:
            continue  # (not measured: one process)
        if r2 is not None and r2 <= R2_MIN:
            flags[f"collectives.{kind}"] = (f"its fit explains little of the times (R² "
                                            f"{r2:.2f} <= {R2_MIN})")
        elif fit["latency"] == 0:
            flags[f"collectives.{kind}"] = ("its latency came out negative and was set to 0 "
                                            "(a fit through the origin): the times do not "
                                            "grow as latency + size / bandwidth")
    for dtype, fit in (data.get("train_step") or {}).items():
        r2 = ((raw.get("train_step") or {}).get(dtype) or {}).get("r2")
        if fit is not None and r2 is not None and r2 <= R2_MIN:
            flags[f"train_step.{dtype}"] = (f"its fit explains little of the step times (R² "
                                            f"{r2:.2f} <= {R2_MIN})")
    return flags


def _differences(data: dict, raw: dict) -> dict[str, str]:
    """The engines', tensor parallel's and the schedules' seconds beyond a baseline, where
    the noise covers them (`noise_seconds`; 0 in files written before it was recorded, so
    that a difference clamped at 0 there is flagged too)."""
    flags = {}
    timed = raw.get("data_parallel") or {}
    for name in DP_ENGINES + TP_ENGINES:
        row = timed.get(name)
        if (data.get("data_parallel") or {}).get(name) is None or not isinstance(row, dict):
            continue
        if name in TP_ENGINES:
            beyond, what = (row["seconds"] - row["predicted_without_tp"],
                            "a step beyond the prediction of all but its all-reduces")
        else:
            beyond, what = row["exposed_seconds"], "a step beyond the step alone and its optimizer"
        flag = _covered(beyond, row.get("noise_seconds", 0.0), what)
        if flag:
            flags[f"data_parallel.{name}"] = flag
    timed = raw.get("pipeline") or {}
    for schedule in PP_SCHEDULES:
        row = timed.get(schedule)
        if (data.get("pipeline") or {}).get(schedule) is None or not isinstance(row, dict):
            continue
        flag = _covered(row["seconds"] - row["predicted_seconds"],
                        row.get("noise_seconds", 0.0), "a step beyond its prediction")
        if flag:
            flags[f"pipeline.{schedule}"] = flag
    return flags


def _covered(beyond: float, noise: float, what: str) -> str | None:
    """The reason a difference of `beyond` seconds is not used, or None."""
    if beyond > noise:
        return None
    if beyond <= 0:
        return (f"{what}: {beyond * 1e3:+.2f} ms, none (the figure is 0, clamped): not "
                "measured here")
    return (f"{what}: {beyond * 1e3:+.2f} ms, within the timings' spread (±{noise * 1e3:.2f} "
            "ms): not told from noise here")
