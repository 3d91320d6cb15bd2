"""Experiment trackers (`meshfit.tracking`) through their real libraries, read back with
those libraries' own readers; bad tracker names and missing libraries refused in one line.
(`meshfit train`'s [log] section and its per-step figures: tests/train/test_train.py.)"""

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


def test_mfu_inputs_from_a_calibration_and_the_model(tmp_path):
    """The MFU figure's two inputs: the peak from a `meshfit calibrate` file for the
    training dtype (none on a CPU without one), and 6N + 12·L·d·T FLOPs per token counted
    here by hand for the tiny preset."""
    import torch

    from meshfit.models import GPT, GPTConfig
    from meshfit.train.run import device_peak_flops, model_flops_per_token

    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps({
        "schema": 1, "device": "cpu", "backend": "gloo", "world_size": 2, "torch": "2.13",
        "time": "2026-01-01T00:00:00+00:00",
        "matmul_flops": {"fp32": 5.75e10, "bf16": 1.37e11, "fp16": None},
        "memory_bandwidth": 1.3e10,
        "collectives": {k: {"bus_bandwidth": 1e9, "latency": 1e-3} for k in
                        ("all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                         "send_recv")}, "raw": {}}))
    cpu = torch.device("cpu")
    assert device_peak_flops(cpu, "no", str(calibration))[0] == 5.75e10
    assert device_peak_flops(cpu, "bf16", str(calibration))[0] == 1.37e11
    assert device_peak_flops(cpu, "fp16", str(calibration))[0] is None  # not measured
    noisy = json.loads(calibration.read_text()) | {"flags": {"machine": "too noisy"}}
    calibration.write_text(json.dumps(noisy))
    assert device_peak_flops(cpu, "no", str(calibration)) == (None, "")  # flagged: no peak
    assert device_peak_flops(cpu, "no")[0] is None  # no data sheet for a CPU
    cfg = GPTConfig.preset("tiny")
    with torch.device("meta"):
        model = GPT(cfg)
    L, d, T, V = cfg.n_layer, cfg.d_model, 128, cfg.vocab_size
    # parameters used in matmuls: everything but the position table (the tied embedding is
    # the head's matmul, so it counts once)
    n = sum(p.numel() for p in model.parameters()) - cfg.max_seq_len * d
    assert model.lm_head.weight is model.tok_emb.weight and V * d > 0
    assert model_flops_per_token(model, T) == 6 * n + 12 * L * d * T
