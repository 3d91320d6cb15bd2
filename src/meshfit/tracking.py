"""Experiment trackers: TensorBoard, Weights & Biases, MLflow and a CSV file, behind one small
interface (Accelerate's `GeneralTracker`'s: ``store_init_configuration``, ``log``,
``finish``, ``tracker``), used by `Accelerator(log_with=...)` and by ``meshfit train``'s
``[log] with``. Every tracker writes through its real library; only the main process builds
them.

    trackers = build_trackers(["tensorboard", "csv"], logging_dir="runs/x")
    for t in trackers:
        t.store_init_configuration({"lr": 3e-4})
        t.log({"loss": 2.1}, step=10)
        t.finish()

Names: "tensorboard" (``torch.utils.tensorboard``: the ``tensorboard`` package), "wandb"
(offline unless ``WANDB_MODE`` says otherwise: nothing leaves the machine by default),
"mlflow" (a local folder store, ``mlruns/`` in the logging folder, unless
``MLFLOW_TRACKING_URI`` is set; ``mlflow-skinny`` is enough), "csv" (`CSVTracker`), and
"all": each of them whose library is installed. Values that are not numbers are left out of
the number-only trackers (TensorBoard scalars, MLflow metrics).
"""

from __future__ import annotations

import csv
import enum
import importlib.util
import io
import json
import math
import numbers
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from meshfit._files import append_line, atomic_write_text

__all__ = ["CSVTracker", "LoggerType", "MLflowTracker", "TensorBoardTracker", "Tracker",
           "WandBTracker", "build_trackers", "flatten_config", "TRACKERS"]


class LoggerType(str, enum.Enum):
    """Tracker names (Accelerate's `LoggerType` values that meshfit supports, plus csv)."""

    ALL = "all"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    MLFLOW = "mlflow"
    CSV = "csv"


def _numbers(values: Mapping[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in values.items():
        if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
            value = value.item()
        if isinstance(value, numbers.Number) and not isinstance(value, bool) and \
                math.isfinite(float(value)):
            out[key] = float(value)
    return out


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 1}} -> {"train.lr": 1}; lists and None become strings (what
    hyperparameter tables accept)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten_config(value, name + "."))
        elif isinstance(value, (bool, int, float, str)):
            out[name] = value
        else:
            out[name] = json.dumps(value) if isinstance(value, (list, tuple)) else str(value)
    return out


class Tracker:
    """One experiment tracker. `tracker` is the library's own object (a SummaryWriter, a
    wandb run, ...)."""

    name = ""
    requires = ""  # the import name of the library it needs

    def __init__(self, run_name: str, logging_dir: str | os.PathLike, **kwargs) -> None:
        self.run_name, self.logging_dir = run_name, Path(logging_dir)

    @property
    def tracker(self):
        raise NotImplementedError

    def store_init_configuration(self, config: Mapping[str, Any]) -> None:
        raise NotImplementedError

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        pass


class TensorBoardTracker(Tracker):
    name, requires = "tensorboard", "tensorboard"

    def __init__(self, run_name: str, logging_dir, **kwargs) -> None:
        super().__init__(run_name, logging_dir)
        from torch.utils.tensorboard import SummaryWriter  # optional: needs tensorboard

        self.writer = SummaryWriter(str(self.logging_dir / run_name), **kwargs)

    @property
    def tracker(self):
        return self.writer

    def store_init_configuration(self, config) -> None:
        flat = flatten_config(config)
        self.writer.add_hparams(flat, {}, run_name=".")
        self.writer.add_text("config", "```\n" + json.dumps(flat, indent=1) + "\n```")
        self.writer.flush()

    def log(self, values, step=None, **kwargs) -> None:
        for key, value in _numbers(values).items():
            self.writer.add_scalar(key, value, global_step=step, **kwargs)
        for key, value in values.items():
            if isinstance(value, str):
                self.writer.add_text(key, value, global_step=step)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


class WandBTracker(Tracker):
    name, requires = "wandb", "wandb"

    def __init__(self, run_name: str, logging_dir, **kwargs) -> None:
        super().__init__(run_name, logging_dir)
        import wandb

        kwargs.setdefault("mode", os.environ.get("WANDB_MODE", "offline"))
        kwargs.setdefault("settings", wandb.Settings(silent=True))  # no console summary
        kwargs.setdefault("dir", str(self.logging_dir))
        self.logging_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=run_name, **kwargs)

    @property
    def tracker(self):
        return self.run

    def store_init_configuration(self, config) -> None:
        self.run.config.update(flatten_config(config), allow_val_change=True)

    def log(self, values, step=None, **kwargs) -> None:
        self.run.log(dict(values), step=step, **kwargs)

    def finish(self) -> None:
        self.run.finish()


class MLflowTracker(Tracker):
    name, requires = "mlflow", "mlflow"

    def __init__(self, run_name: str, logging_dir, **kwargs) -> None:
        super().__init__(run_name, logging_dir)
        import mlflow

        if "MLFLOW_TRACKING_URI" not in os.environ:
            # A local folder store: it needs no database package (mlflow-skinny has none);
            # MLflow 3 keeps it working behind this opt-in.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri((self.logging_dir / "mlruns").resolve().as_uri())
        mlflow.set_experiment(run_name)
        self._mlflow = mlflow
        self.run = mlflow.start_run(**kwargs)

    @property
    def tracker(self):
        return self.run

    def store_init_configuration(self, config) -> None:
        flat = flatten_config(config)
        for i in range(0, len(flat), 100):  # MLflow takes at most 100 params per call
            self._mlflow.log_params(dict(list(flat.items())[i:i + 100]))

    def log(self, values, step=None, **kwargs) -> None:
        self._mlflow.log_metrics(_numbers(values), step=step)

    def finish(self) -> None:
        self._mlflow.end_run()


class CSVTracker(Tracker):
    """``<logging_dir>/metrics.csv``: a ``step`` column and one column per key seen so far;
    a new key rewrites the file once with the wider header (atomically: a temporary file,
    then a rename), other rows are appended whole or not at all."""

    name, requires = "csv", ""

    def __init__(self, run_name: str, logging_dir, **kwargs) -> None:
        super().__init__(run_name, logging_dir)
        self.logging_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.logging_dir / "metrics.csv"
        self.columns: list[str] = ["step"]
        self.rows: list[dict[str, Any]] = []
        atomic_write_text(self.path, "step\n")

    @property
    def tracker(self):
        return self.path

    def store_init_configuration(self, config) -> None:
        atomic_write_text(self.logging_dir / "config.json",
                          json.dumps(flatten_config(config), indent=1) + "\n")

    def log(self, values, step=None, **kwargs) -> None:
        row = {"step": step, **{k: v for k, v in values.items()
                                if isinstance(v, (numbers.Number, str))}}
        new = [k for k in row if k not in self.columns]
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, fieldnames=self.columns + new)
        if new:
            writer.writeheader()
            writer.writerows(self.rows + [row])
            atomic_write_text(self.path, text.getvalue())
            self.columns += new
        else:
            writer.writerow(row)
            append_line(self.path, text.getvalue().encode("utf-8"))
        self.rows.append(row)


TRACKERS: dict[str, type[Tracker]] = {t.name: t for t in (
    TensorBoardTracker, WandBTracker, MLflowTracker, CSVTracker)}


def _name(item) -> str:
    value = getattr(item, "value", item)
    if not isinstance(value, str):
        raise ValueError(f"log_with={item!r}: a tracker name or meshfit.tracking.Tracker "
                         f"instance, one of {', '.join(['all', *TRACKERS])}")
    return value.lower()


def available(name: str) -> bool:
    """Whether the library tracker `name` writes through is installed."""
    lib = TRACKERS[name].requires
    return not lib or importlib.util.find_spec(lib) is not None


def resolve_names(log_with, field: str = "log_with") -> list:
    """The tracker names (or Tracker instances) `log_with` asks for, checked: one-line
    ValueError for an unknown name or a missing library (with what to install)."""
    if log_with is None:
        return []
    items = [log_with] if isinstance(log_with, (str, enum.Enum, Tracker)) else list(log_with)
    out: list = []
    for item in items:
        if isinstance(item, Tracker):
            out.append(item)
            continue
        name = _name(item)
        if name == "all":
            out += [n for n in TRACKERS if available(n) and n not in out]
            continue
        if name not in TRACKERS:
            raise ValueError(f"{field}={name!r} is not a tracker meshfit knows; use one of "
                             f"{', '.join(['all', *TRACKERS])}")
        if not available(name):
            raise ValueError(f"{field}={name!r} needs the {TRACKERS[name].requires!r} package, "
                             f"which is not installed; pip install {TRACKERS[name].requires}")
        if name not in out:
            out.append(name)
    return out


def build_trackers(log_with, *, project_dir: str | os.PathLike | None = None,
                   logging_dir: str | os.PathLike | None = None,
                   init_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
                   project_name: str = "meshfit") -> list[Tracker]:
    """The trackers `log_with` names (a name, a `LoggerType`, a `Tracker`, or a list of
    them), each started for run `project_name` under `logging_dir` (default: `project_dir`,
    else the current folder). `init_kwargs`: {tracker name: keyword arguments for its
    library's start call} (``SummaryWriter``, ``wandb.init``, ``mlflow.start_run``)."""
    folder = Path(logging_dir or project_dir or ".")
    init_kwargs = dict(init_kwargs or {})
    out: list[Tracker] = []
    for item in resolve_names(log_with):
        if isinstance(item, Tracker):
            out.append(item)
            continue
        out.append(TRACKERS[item](project_name, folder, **dict(init_kwargs.get(item, {}))))
    return out


def finish_all(trackers: Iterable[Tracker]) -> None:
    for t in trackers:
        t.finish()
