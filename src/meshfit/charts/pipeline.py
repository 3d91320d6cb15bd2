"""A pipeline-parallel run's schedule drawn as a Gantt chart, with its measured bubble.

A pipeline run of `meshfit train` (``[parallel] pp > 1``) records its schedule in its run
folder (`meshfit.train.pipeline_record`: ``pipeline.json`` and ``pipeline_timings.jsonl``).
`draw` plots one step (one row per pp rank, one bar per stage x micro-batch x phase, idle time
left blank) and sets the measured bubble (`measure`) beside the textbook one. Both definitions
in use are given: Megatron-LM's ratio idle/busy (Narayanan et al. 2021, sec. 2.2: (p-1)/m for
GPipe and 1F1B, (p-1)/(v m) interleaved) and the idle share of the step, r/(1+r) (GPipe,
Huang et al. 2019, quotes this one).
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path

from meshfit._files import atomic_write_bytes
from meshfit.charts.plot import figure_class
from meshfit.parallel.pp import bubble_fraction, bubble_ratio, theoretical_bubble
from meshfit.train.pipeline_record import PHASES, TIMINGS_FILE, read_run

CHART_FILE = "pipeline_chart.png"
_COLOURS = {"forward": "#3b6fb6", "backward": "#e07b39", "backward_input": "#c0392b",
            "backward_weight": "#2e9d5b"}
_HATCHES = ("", "//", "..", "xx", "\\\\", "oo")  # one per virtual stage (chunk) of a rank
_DPI = 110


def _shade(colour: str, chunk: int) -> tuple[float, float, float]:
    """`colour` for a rank's first stage, mixed with white for its later ones."""
    rgb = [int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    mix = 0.0 if chunk == 0 else 0.45 + 0.1 * min(chunk - 1, 3)
    return tuple(c + (1 - c) * mix for c in rgb)


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
