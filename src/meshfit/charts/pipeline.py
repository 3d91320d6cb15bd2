"""A pipeline-parallel run's schedule drawn as a Gantt chart, with its measured bubble.

A pipeline run of `meshfit train` (``[parallel] pp > 1``) writes two files into its run folder
(`write_run`):

- ``pipeline.json``: {"schedule", "pp", "microbatches", "virtual_stages", "num_stages",
  "points" (block indices where stages 1.. begin), "placement" (stage indices held by each pp
  rank)} (`Pipeline.meta()` gives it);
- ``pipeline_timings.jsonl``: one {"step", "rank", "stage", "microbatch", "phase", "start",
  "end"} per line, wall-clock seconds, as `meshfit.parallel.pp.Pipeline.timings` records them.

`draw` plots one step (one row per pp rank, one bar per stage x micro-batch x phase, idle time
left blank) and sets the measured bubble (`measure`) beside the textbook one. Both definitions
in use are given: Megatron-LM's ratio idle/busy (Narayanan et al. 2021, sec. 2.2: (p-1)/m for
GPipe and 1F1B, (p-1)/(v m) interleaved) and the idle share of the step, r/(1+r) (GPipe,
Huang et al. 2019, quotes this one).
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path

from meshfit._files import atomic_write_bytes, atomic_write_text
from meshfit.parallel.pp import SCHEDULES, bubble_fraction, bubble_ratio, theoretical_bubble
from meshfit.train.plot import figure_class

META_FILE, TIMINGS_FILE, CHART_FILE = "pipeline.json", "pipeline_timings.jsonl", \
    "pipeline_chart.png"
PHASES = ("forward", "backward", "backward_input", "backward_weight")
_META_KEYS = ("schedule", "pp", "microbatches", "virtual_stages", "num_stages", "points",
              "placement")
_TIMING_KEYS = ("step", "rank", "stage", "microbatch", "phase", "start", "end")
_COLOURS = {"forward": "#3b6fb6", "backward": "#e07b39", "backward_input": "#c0392b",
            "backward_weight": "#2e9d5b"}
_HATCHES = ("", "//", "..", "xx", "\\\\", "oo")  # one per virtual stage (chunk) of a rank
_DPI = 110


def _shade(colour: str, chunk: int) -> tuple[float, float, float]:
    """`colour` for a rank's first stage, mixed with white for its later ones."""
    rgb = [int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    mix = 0.0 if chunk == 0 else 0.45 + 0.1 * min(chunk - 1, 3)
    return tuple(c + (1 - c) * mix for c in rgb)


# ---------------------------------------------------------------------------- files
def write_run(out_dir, meta: dict, timings: Sequence[dict]) -> None:
    """Write `pipeline.json` and `pipeline_timings.jsonl` into `out_dir` (created if needed),
    each atomically: a reader never sees half a file."""
    _check_meta(meta, "meta")
    _check_timings(timings, meta, "timings")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / META_FILE,
                      json.dumps({k: meta[k] for k in _META_KEYS}, indent=1) + "\n")
    atomic_write_text(out / TIMINGS_FILE, "".join(
        json.dumps({k: t[k] for k in _TIMING_KEYS}) + "\n" for t in timings))


def read_run(run_dir) -> tuple[dict, list[dict]]:
    """(meta, timings) of a pipeline run folder; one-line ValueErrors name the file and fix."""
    run = Path(run_dir)
    if not run.is_dir():
        what = "is not a folder" if run.exists() else "does not exist"
        raise ValueError(f"run folder {str(run)!r} {what}; pass the folder given to "
                         "`meshfit train --out`")
    meta_path, timings_path = run / META_FILE, run / TIMINGS_FILE
    if not meta_path.is_file():
        raise ValueError(f"{meta_path} not found: the run in {str(run)!r} was not pipeline-"
                         "parallel; train with `[parallel] pp > 1` (e.g. --parallel.pp=2) to "
                         "record a pipeline schedule")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{meta_path} is not valid JSON ({_short(err)}); rerun the training "
                         "or restore the file") from None
    _check_meta(meta, str(meta_path))
    if not timings_path.is_file():
        raise ValueError(f"{timings_path} not found beside {META_FILE}; rerun the training to "
                         "record the timings")
    try:
        lines = timings_path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise ValueError(f"{timings_path} is not UTF-8 text (byte {err.start}); rerun the "
                         "training or restore the file") from None
    timings = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{timings_path} line {n} is not valid JSON ({_short(err)}); "
                             "delete the line or rerun the training") from None
        _check_timings([entry], meta, f"{timings_path} line {n}")
        timings.append(entry)
    if not timings:
        raise ValueError(f"{timings_path} holds no timings; rerun the training for at least "
                         "one step")
    return meta, timings


def _short(err: Exception) -> str:
    return str(err).splitlines()[0]


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_meta(meta, where: str) -> None:
    if not isinstance(meta, dict):
        raise ValueError(f"{where} must be a JSON object with keys {', '.join(_META_KEYS)}")
    missing = [k for k in _META_KEYS if k not in meta]
    unknown = sorted(set(meta) - set(_META_KEYS))
    if missing or unknown:
        raise ValueError(f"{where}: missing keys {missing}, unknown keys {unknown}; expected "
                         f"exactly {', '.join(_META_KEYS)}")
    if meta["schedule"] not in SCHEDULES:
        raise ValueError(f"{where}: schedule={meta['schedule']!r} is not one of "
                         f"{', '.join(SCHEDULES)}")
    for k in ("pp", "microbatches", "virtual_stages", "num_stages"):
        if not _is_int(meta[k]) or meta[k] < 1:
            raise ValueError(f"{where}: {k}={meta[k]!r} must be a positive integer")
    pp, v, n = meta["pp"], meta["virtual_stages"], meta["num_stages"]
    if n != pp * v:
        raise ValueError(f"{where}: num_stages={n} must equal pp x virtual_stages = {pp * v}")
    points, placement = meta["points"], meta["placement"]
    if not isinstance(points, list) or len(points) != n - 1 or not all(map(_is_int, points)):
        raise ValueError(f"{where}: points={points!r} must be a list of {n - 1} block indices "
                         "(where stages 1.. begin)")
    held = sorted(s for ranks in placement for s in ranks) if isinstance(placement, list) and \
        all(isinstance(r, list) for r in placement) else None
    if held != list(range(n)) or len(placement) != pp:
        raise ValueError(f"{where}: placement={placement!r} must list, for each of the {pp} "
                         f"pp ranks, the stages it holds (together 0..{n - 1}, each once)")


def _check_timings(timings: Sequence[dict], meta: dict, where: str) -> None:
    for t in timings:
        if not isinstance(t, dict) or not set(_TIMING_KEYS) <= set(t):
            raise ValueError(f"{where}: a timing must be an object with keys "
                             f"{', '.join(_TIMING_KEYS)}, got {t!r:.120}")
        bad = [k for k in ("step", "rank", "stage", "microbatch") if not _is_int(t[k])] + \
            [k for k in ("start", "end") if not isinstance(t[k], (int, float))
             or isinstance(t[k], bool)]
        if bad:
            raise ValueError(f"{where}: {', '.join(bad)} must be numbers (integers for step, "
                             f"rank, stage, microbatch), got {t!r:.120}")
        if t["phase"] not in PHASES:
            raise ValueError(f"{where}: phase={t['phase']!r} is not one of {', '.join(PHASES)}")
        if not 0 <= t["rank"] < meta["pp"] or t["stage"] not in meta["placement"][t["rank"]]:
            raise ValueError(f"{where}: rank={t['rank']} stage={t['stage']} does not match "
                             f"the placement {meta['placement']} (pp={meta['pp']})")
        if t["end"] < t["start"]:
            raise ValueError(f"{where}: end={t['end']} is before start={t['start']}")


# ---------------------------------------------------------------------------- figures
def measure(meta: dict, timings: Sequence[dict]) -> dict:
    """Measured and theoretical bubble of a run (the first step left out when later ones exist:
    it also infers shapes and sets up communication, which is not the schedule's idle time)."""
    steps = sorted({t["step"] for t in timings})
    measured = steps[1:] if len(steps) > 1 else steps
    kept = [t for t in timings if t["step"] in set(measured)]
    p, m, v = meta["pp"], meta["microbatches"], meta["virtual_stages"]
    theory = theoretical_bubble(meta["schedule"], p, m, v)
    return {"schedule": meta["schedule"], "pp": p, "microbatches": m, "virtual_stages": v,
            "steps_recorded": steps, "steps_measured": measured,
            "measured_bubble_ratio": bubble_ratio(kept),
            "measured_bubble_fraction": bubble_fraction(kept),
            "theoretical_bubble_ratio": theory,
            "theoretical_bubble_fraction": theory / (1 + theory),
            "theoretical_formula": _formula(meta["schedule"], p, m, v)}


def _formula(schedule: str, p: int, m: int, v: int) -> str:
    if schedule == "zero_bubble":
        return "0 (ZB-V, when forward, input- and weight-backward take equal time)"
    if schedule == "interleaved_1f1b" and m >= p:
        return f"(p-1)/(v m) = {p - 1}/({v}x{m}) = {Fraction(p - 1, v * m)}"
    gap = " (m < p: nothing to interleave)" if schedule == "interleaved_1f1b" else ""
    f = Fraction(p - 1, m)
    reduced = "" if (f.numerator, f.denominator) == (p - 1, m) else f" = {f}"
    return f"(p-1)/m = {p - 1}/{m}{reduced}{gap}"


def _steps_text(s: dict) -> str:
    measured, recorded = s["steps_measured"], s["steps_recorded"]
    span = f"step {measured[0]}" if len(measured) == 1 else \
        f"steps {measured[0]}-{measured[-1]}"
    if measured == recorded:  # a single step: it includes the setup
        return span + ", the only one recorded, setup included"
    return f"{span}; step {recorded[0]} left out: shape inference"


def describe(summary: dict) -> list[str]:
    """Two lines: the measured bubble (both definitions) and the theoretical one."""
    s = summary
    return [f"measured bubble ({_steps_text(s)}): idle/busy = {s['measured_bubble_ratio']:.3f}, "
            f"idle share of the step = {s['measured_bubble_fraction']:.1%}",
            f"theoretical bubble of {s['schedule']}, {s['theoretical_formula']}: idle/busy = "
            f"{s['theoretical_bubble_ratio']:.3f}, idle share r/(1+r) = "
            f"{s['theoretical_bubble_fraction']:.1%}"]


# ---------------------------------------------------------------------------- the chart
def draw(run_dir, out_png=None, step: int | None = None) -> tuple[Path, dict]:
    """Draw one step of the run in `run_dir` (default: the last recorded) to `out_png` (default
    RUN/pipeline_chart.png); returns (png path, summary: `measure`'s figures and the `step`)."""
    meta, timings = read_run(run_dir)
    summary = measure(meta, timings)
    steps = summary["steps_recorded"]
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise ValueError(f"step={step} is not in {Path(run_dir) / TIMINGS_FILE}; recorded "
                         f"steps: {', '.join(map(str, steps))}")
    summary["step"] = step
    out = Path(out_png) if out_png is not None else Path(run_dir) / CHART_FILE
    _check_out(out)
    entries = [t for t in timings if t["step"] == step]
    fig = _figure(figure_class("drawing the chart"), meta, entries, summary)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"--out={str(out)!r}: cannot create its folder ({err.strerror or err}); "
                         "give a writable path") from None
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=_DPI)
    try:
        atomic_write_bytes(out, buf.getvalue())
    except OSError as err:  # `WriteFailed`, with the errno of the failed write
        reason = os.strerror(err.errno) if err.errno else err
        raise ValueError(f"--out={str(out)!r}: cannot write the chart ({reason}); "
                         "give a writable path") from None
    return out, summary


def _check_out(out: Path) -> None:
    """One-line ValueError, before drawing, for a chart path that cannot be a file."""
    if out.is_dir():
        raise ValueError(f"--out={str(out)!r} is a folder; give the chart's file name, e.g. "
                         f"{out / CHART_FILE}")
    above = next((p for p in out.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise ValueError(f"--out={str(out)!r}: {above} is a file, not a folder; give a path in "
                         "a folder")


def _figure(Figure, meta: dict, entries: list[dict], summary: dict):
    from matplotlib.patches import Patch

    p, placement = meta["pp"], meta["placement"]
    chunks = max(len(held) for held in placement)  # stages per rank
    t0 = min(t["start"] for t in entries)
    span = (max(t["end"] for t in entries) - t0) * 1e3 or 1.0
    fig = Figure(figsize=(12, 2.2 + 0.55 * p))
    ax = fig.subplots()
    height = fig.get_figheight()  # margins in inches: title above, x label and text below
    fig.subplots_adjust(left=0.09, right=0.8, top=1 - 0.5 / height, bottom=1.05 / height)
    px_per_ms = fig.get_figwidth() * (0.8 - 0.09) * _DPI / span
    for t in entries:
        x, w = (t["start"] - t0) * 1e3, (t["end"] - t["start"]) * 1e3
        chunk = placement[t["rank"]].index(t["stage"])  # a rank's later stages: light, hatched
        colour = _COLOURS[t["phase"]]
        ax.barh(t["rank"], w, left=x, height=0.7, color=_shade(colour, chunk), linewidth=0.6,
                hatch=_HATCHES[chunk % len(_HATCHES)], edgecolor=colour if chunk else "white")
        label = str(t["microbatch"])
        if w * px_per_ms >= 6 + 7 * len(label):  # the number fits inside the bar (8 pt)
            ax.text(x + w / 2, t["rank"], label, ha="center", va="center", fontsize=8,
                    fontweight="bold", color="#222222" if chunk else "white",
                    bbox=dict(boxstyle="square,pad=0.1", fc=_shade(colour, chunk), ec="none")
                    if chunk else None)
    ax.set_yticks(range(p), [f"rank {r}\n" + ("stage " if len(held) == 1 else "stages ") +
                             ", ".join(map(str, held)) for r, held in enumerate(placement)])
    ax.set_ylim(p - 0.5, -0.5)  # rank 0 on top
    ax.set_xlim(0, span * 1.01)
    ax.set_xlabel(f"ms from the start of step {summary['step']} (numbers: micro-batch)")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(f"{meta['schedule']}: p={p}, m={meta['microbatches']}, "
                 f"v={meta['virtual_stages']} (step {summary['step']}, {span:.1f} ms)")
    handles = [Patch(color=_COLOURS[ph], label=ph) for ph in PHASES
               if any(t["phase"] == ph for t in entries)]
    for k in range(chunks if chunks > 1 else 0):  # which shading marks which of a rank's stages
        stages = ", ".join(str(held[k]) for held in placement if k < len(held))
        handles.append(Patch(facecolor=_shade("#666666", k), hatch=_HATCHES[k % len(_HATCHES)],
                             edgecolor="#666666" if k else "white", label=f"stages {stages}"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False,
              fontsize=9)
    fig.text(0.01, 0.1 / height, "\n".join(describe(summary)), fontsize=9, va="bottom",
             ha="left", family="monospace")
    return fig
