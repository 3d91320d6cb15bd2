"""`meshfit plot RUN [RUN...] [-o out.png]`: runs of `meshfit train` drawn from their
``metrics.jsonl``, several runs overlaid, each labelled with its folder's name, in four panels
against training tokens (step x ``[train] global_batch_size`` x ``seq_len``, read from each
run's ``config.toml``, so runs with other batch sizes or sequence lengths line up):

- loss (solid) and validation loss (dashed, dots);
- learning rate;
- throughput, ``tokens_per_s`` of all processes together;
- peak memory per logged step, the largest rank's (``peak_memory_bytes``; a run whose
  metrics carry no memory figure is left out of that panel, and the panel says so).

Every problem with a run folder is a one-line ValueError naming the file and the fix.
"""

from __future__ import annotations

import io
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib  # type: ignore[no-redef]

from meshfit._files import atomic_write_bytes

METRICS_FILE, CONFIG_FILE = "metrics.jsonl", "config.toml"
MEMORY_KEYS = ("peak_memory_bytes", "memory_bytes")
"""Memory fields of a logged step, in order of preference (bytes; the first one present)."""
FIGSIZE, DPI = (12.0, 8.0), 100  # The figure's size in inches and its resolution: a 1200 x 800 PNG
_FORMATS = (".png", ".pdf", ".svg")
_GIB = 1024 ** 3


@dataclass
class Run:
    """One run folder's records: logged steps (with ``loss``) and evaluations (``val_loss``)."""

    path: Path
    label: str
    tokens_per_step: int
    steps: list[dict] = field(default_factory=list, repr=False)
    evals: list[dict] = field(default_factory=list, repr=False)

    def tokens(self, record: dict) -> int:
        return int(record["step"]) * self.tokens_per_step

    @property
    def memory_key(self) -> str | None:
        return next((k for k in MEMORY_KEYS if any(k in r for r in self.steps)), None)


def _train_section(run: Path) -> tuple[int, int]:
    config = run / CONFIG_FILE
    if not config.is_file():
        raise ValueError(f"{config} does not exist; the tokens axis needs the run's [train] "
                         "global_batch_size and seq_len (give the --out folder of a meshfit "
                         "train run)")
    try:
        train = tomllib.loads(config.read_text()).get("train", {})
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{config} is not valid TOML ({err})") from None
    values = []
    for key in ("global_batch_size", "seq_len"):
        value = train.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{config}: [train] {key} = {value!r}; the tokens axis needs a "
                             "positive integer")
        values.append(value)
    return values[0], values[1]


def read_run(run_dir, label: str | None = None) -> Run:
    """The records of the run in `run_dir`; one-line ValueErrors for a missing folder or
    file, a line that is not JSON (a run still being written may end in a partial line: that
    one is skipped) and a run with nothing recorded yet."""
    run = Path(run_dir)
    if not run.is_dir():
        raise ValueError(f"run folder {str(run)!r} does not exist; give the --out folder of a "
                         "meshfit train run")
    metrics = run / METRICS_FILE
    if not metrics.is_file():
        raise ValueError(f"{metrics} does not exist; {run} is not a meshfit train run folder "
                         "(or the run has not logged a step yet)")
    batch, seq_len = _train_section(run)
    out = Run(path=run, label=label or run.resolve().name, tokens_per_step=batch * seq_len)
    lines = metrics.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):  # the last line of a run still writing
                continue
            raise ValueError(f"{metrics} line {number} is not JSON: {line[:60]!r}") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError(f"{metrics} line {number} has no integer 'step': {line[:60]!r}")
        if _number(record.get("loss")) is not None:
            out.steps.append(record)
        if _number(record.get("val_loss")) is not None:
            out.evals.append(record)
    if not out.steps and not out.evals:
        raise ValueError(f"{metrics} holds no logged step or evaluation yet")
    return out


def _number(value) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _labels(paths: list[Path]) -> list[str]:
    """Each run's folder name; where two runs share one, enough of their paths to tell apart."""
    parts = [p.resolve().parts for p in paths]
    for depth in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [str(p) for p in paths]  # the same folder twice


def default_output(runs: list[str]) -> Path:
    """RUN/metrics.png for one run; meshfit-plot.png here for several."""
    return Path(runs[0]) / "metrics.png" if len(runs) == 1 else Path("meshfit-plot.png")


def figure_class(what: str):
    """matplotlib's bare `Figure` (no pyplot: it renders to a file with Agg, needs no display,
    and leaves the caller's pyplot backend and open figures alone); without matplotlib, a
    one-line ValueError saying that `what` needs it (the ``chart`` extra)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ValueError(f'{what} needs matplotlib; pip install "meshfit[chart]"') from None
    return Figure


def draw(run_dirs, out=None) -> tuple[Path, list[Run]]:
    """Plot the runs in `run_dirs` (overlaid) to `out` (default: `default_output`); returns
    (the file written, the runs read). Everything is read and checked before drawing."""
    run_dirs = [str(r) for r in run_dirs]
    if not run_dirs:
        raise ValueError("give at least one run folder")
    out = Path(out) if out is not None else default_output(run_dirs)
    if out.suffix.lower() not in _FORMATS:
        raise ValueError(f"-o {str(out)!r}: the file name must end in "
                         f"{', '.join(_FORMATS)} (the format follows the extension)")
    labels = _labels([Path(r) for r in run_dirs])
    runs = [read_run(r, label) for r, label in zip(run_dirs, labels)]
    fig = _figure(figure_class("meshfit plot"), runs)
    out.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, format=out.suffix.lower().lstrip("."), dpi=DPI)
    atomic_write_bytes(out, buf.getvalue())  # a reader never sees half a file
    return out, runs


def _series(run: Run, records: list[dict], key: str, scale: float = 1.0):
    xs, ys = [], []
    for r in records:
        y = _number(r.get(key))
        if y is not None:
            xs.append(run.tokens(r))
            ys.append(y * scale)
    return xs, ys


def _figure(Figure, runs: list[Run]):
    from matplotlib.ticker import EngFormatter, FuncFormatter

    fig = Figure(figsize=FIGSIZE)
    (ax_loss, ax_lr), (ax_tps, ax_mem) = fig.subplots(2, 2, sharex=True)
    colours = [f"C{i % 10}" for i in range(len(runs))]
    for run, c in zip(runs, colours):
        xs, ys = _series(run, run.steps, "loss")
        if xs:
            ax_loss.plot(xs, ys, color=c, linewidth=1.4, label=f"{run.label} loss")
        xs, ys = _series(run, run.evals, "val_loss")
        if xs:
            ax_loss.plot(xs, ys, color=c, linestyle="--", marker="o", markersize=4,
                         linewidth=1.2, label=f"{run.label} val_loss")
        xs, ys = _series(run, run.steps, "lr")
        if xs:
            ax_lr.plot(xs, ys, color=c, linewidth=1.4, label=run.label)
        xs, ys = _series(run, run.steps, "tokens_per_s")
        if xs:
            ax_tps.plot(xs, ys, color=c, linewidth=1.4, label=run.label)
        key = run.memory_key
        if key is not None:
            xs, ys = _series(run, run.steps, key, 1 / _GIB)
            ax_mem.plot(xs, ys, color=c, linewidth=1.4, marker=".", label=run.label)
    ax_loss.set_title("loss (solid) and validation loss (dashed)")
    ax_loss.set_ylabel("cross-entropy")
    ax_lr.set_title("learning rate")
    ax_lr.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.3g}"))
    ax_tps.set_title("throughput, all processes")
    ax_tps.set_ylabel("tokens/s")
    ax_tps.yaxis.set_major_formatter(EngFormatter())
    ax_mem.set_title("peak memory, largest rank")
    ax_mem.set_ylabel("GiB")
    for ax in (ax_tps, ax_mem):  # amounts: from zero, so that runs compare by ratio
        top = ax.dataLim.y1 if ax.has_data() else 0.0
        ax.set_ylim(0, top * 1.1 if math.isfinite(top) and top > 0 else 1.0)
    without = [r.label for r in runs if r.memory_key is None]
    for ax in (ax_loss, ax_lr, ax_tps, ax_mem):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            note = f"no memory figure: {', '.join(without)}" if ax is ax_mem and without \
                else None
            ax.legend(fontsize=8, frameon=False, title=note, title_fontsize=8)
    if len(without) == len(runs):
        ax_mem.text(0.5, 0.5, "no memory figure (peak_memory_bytes)\nin these runs' metrics",
                    transform=ax_mem.transAxes, ha="center", va="center", fontsize=9,
                    color="#555555")
    for ax in (ax_tps, ax_mem):
        ax.set_xlabel("training tokens (step x global batch x seq_len)")
        ax.xaxis.set_major_formatter(EngFormatter())
    ax_loss.tick_params(labelbottom=True)
    ax_lr.tick_params(labelbottom=True)
    fig.suptitle("meshfit plot: " + ", ".join(r.label for r in runs))
    fig.tight_layout()
    return fig


def describe(run: Run) -> str:
    """One line per run: what was plotted, in numbers."""
    parts = [f"{run.label}:"]
    if run.steps:
        last = run.steps[-1]
        parts.append(f"{len(run.steps)} logged steps to step {last['step']} "
                     f"({_eng(run.tokens(last))} tokens), loss {last['loss']:.4f}")
    if run.evals:
        best = min(run.evals, key=lambda r: r["val_loss"])
        parts.append(f"best val_loss {best['val_loss']:.4f} at step {best['step']}")
    tps = [t for t in (_number(r.get("tokens_per_s")) for r in run.steps) if t is not None]
    if tps:
        parts.append(f"median {_eng(statistics.median(tps))} tokens/s")
    key = run.memory_key
    if key is not None:
        peak = max(_number(r.get(key)) or 0.0 for r in run.steps)
        parts.append(f"peak memory {peak / _GIB:.2f} GiB")
    return " ".join(parts[:2]) + (", " + ", ".join(parts[2:]) if parts[2:] else "")


def _eng(value: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{unit}"
    return f"{value:.3g}"
