"""Experiment trackers (`meshfit.tracking`) through their real libraries, read back with
those libraries' own readers; bad tracker names and missing libraries refused in one line.
(`meshfit train`'s [log] section and its per-step figures: tests/test_train.py.)"""

from __future__ import annotations

import csv
import json

import pytest

from meshfit.tracking import build_trackers, flatten_config, resolve_names

CONFIG = {"train": {"lr": 3e-4, "steps": 10}, "model": {"preset": "tiny"}, "with": ["csv"]}
STEPS = [(1, {"loss": 2.5, "lr": 1e-3}), (2, {"loss": 2.25, "lr": 2e-3, "note": "x"})]


def _log(trackers):
    for t in trackers:
        t.store_init_configuration(CONFIG)
        for step, values in STEPS:
            t.log(values, step=step)
        t.finish()


def test_flatten_config():
    assert flatten_config(CONFIG) == {"train.lr": 3e-4, "train.steps": 10,
                                      "model.preset": "tiny", "with": '["csv"]'}


def test_tensorboard_scalars_and_hparams(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _log(build_trackers("tensorboard", logging_dir=tmp_path, project_name="run"))
    events = EventAccumulator(str(tmp_path / "run"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 2.5), (2, 2.25)]
    assert "config/text_summary" in events.Tags()["tensors"]  # the run's configuration


def test_csv_rows_widen_when_a_key_appears(tmp_path):
    _log(build_trackers(["csv"], logging_dir=tmp_path))
    with (tmp_path / "metrics.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [r["loss"] for r in rows] == ["2.5", "2.25"] and rows[1]["note"] == "x"
    assert rows[0]["note"] == ""  # written before the column existed
    assert json.loads((tmp_path / "config.json").read_text())["train.lr"] == 3e-4


def test_wandb_offline_run(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    trackers = build_trackers(["wandb"], logging_dir=tmp_path, project_name="run")
    run = trackers[0].tracker
    assert run.settings.mode == "offline"  # nothing leaves the machine by default
    _log(trackers)
    assert run.config["train.lr"] == 3e-4
    assert list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))


def test_mlflow_local_store(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    _log(build_trackers(["mlflow"], logging_dir=tmp_path, project_name="run"))
    client = mlflow.tracking.MlflowClient((tmp_path / "mlruns").as_uri())
    run = client.search_runs([client.get_experiment_by_name("run").experiment_id])[0]
    assert run.data.params["train.steps"] == "10"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] \
        == [(1, 2.5), (2, 2.25)]


@pytest.mark.parametrize("log_with, match", [
    ("comet", r"log_with='comet' is not a tracker meshfit knows; use one of all, tensorboard"),
    ([3], r"log_with=3: a tracker name"),
])
def test_bad_tracker_names(log_with, match):
    with pytest.raises(ValueError, match=match) as err:
        resolve_names(log_with)
    assert "\n" not in str(err.value)


def test_missing_library_names_the_package(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ValueError, match=r"log.with='wandb' needs the 'wandb' package, which is "
                                         r"not installed; pip install wandb"):
        resolve_names(["wandb"], field="log.with")
    assert "wandb" not in resolve_names("all")  # "all": the installed ones
