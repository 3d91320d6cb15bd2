"""`meshfit train`: config handling, the run folder, and bad input before any launch."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from meshfit.train.config import RunConfig
from meshfit.train.configfile import load_config, to_toml

MESHFIT = [sys.executable, "-m", "meshfit"]
SMALL = ["--train.steps=12", "--train.eval_every=6", "--train.log_every=3",
         "--train.global_batch_size=8", "--train.micro_batch_size=4", "--train.seq_len=64",
         "--train.eval_batches=2", "--model.n_layer=2"]


def test_train_two_processes_writes_metrics_and_config(tmp_path, subprocess_env):
    out = tmp_path / "run"
    cache = tmp_path / "cache"
    proc = subprocess.run([*MESHFIT, "train", "--nproc", "2", "--out", str(out), *SMALL,
                           f"--data.cache_dir={cache}", '--log.with=["tensorboard", "csv"]'],
                          env=subprocess_env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    train_lines = [l for l in lines if "loss" in l]
    evals = [l for l in lines if "val_loss" in l]
    assert [l["step"] for l in train_lines] == [3, 6, 9, 12]
    assert all(l["tokens_per_s"] > 0 and l["loss"] > 0 for l in train_lines)
    for l in train_lines:  # the figures of every logged step
        assert l["grad_norm"] > 0  # measured although train.grad_clip would not clip it
        assert l["tokens_per_s_per_device"] == pytest.approx(l["tokens_per_s"] / 2, abs=0.1)
        assert l["mfu"] is None  # a CPU without [log] calibration: no peak to divide by
        assert len(l["peak_memory_bytes_per_rank"]) == 2
        assert l["peak_memory_bytes"] == max(l["peak_memory_bytes_per_rank"]) > 2**20
        assert 0 <= l["data_wait_share"] < 1
    # Not a terminal: plain lines, one per logged step and evaluation, with every figure.
    plain = [x for x in proc.stdout.splitlines() if x.startswith("step ")]
    assert len(plain) == 4 + 3 and "grad_norm" in plain[1] and "mfu n/a" in plain[1], plain
    # The trackers got the same numbers, and the configuration.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tracking" / "meshfit"))
    events.Reload()
    assert [(e.step, round(e.value, 5)) for e in events.Scalars("loss")] == \
        [(l["step"], l["loss"]) for l in train_lines]
    assert [(e.step, round(e.value, 5)) for e in events.Scalars("val_loss")] == \
        [(l["step"], l["val_loss"]) for l in evals]
    with (out / "tracking" / "metrics.csv").open() as fh:
        import csv

        assert [float(r["grad_norm"]) for r in csv.DictReader(fh) if r["grad_norm"]] == \
            [l["grad_norm"] for l in train_lines]
    assert [l["step"] for l in evals] == [0, 6, 12]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.5  # it learns
    resolved = load_config(out / "config.toml")
    assert resolved.train.steps == 12 and resolved.model.n_layer == 2
    assert resolved.data.cache_dir == str(cache)


def test_config_file_and_overrides(tmp_path):
    cfg_file = tmp_path / "run.toml"
    cfg_file.write_text('[model]\npreset = "tiny"\n[train]\nsteps = 7\n[optim]\nlr = 1e-3\n'
                        'betas = [0.8, 0.9]\n[peft]\nmethod = "lora"\ntarget_modules = ["wq"]\n')
    cfg = load_config(cfg_file, ["--train.steps=9", "--data.path=" + str(tmp_path),
                                 "--train.activation_checkpointing=full"])
    assert cfg.train.steps == 9 and cfg.optim.lr == 1e-3 and cfg.data.path == str(tmp_path)
    assert cfg.optim.betas == (0.8, 0.9) and cfg.peft.target_modules == ("wq",)
    assert cfg.train.activation_checkpointing == "full"
    assert load_config(None, []) == RunConfig()
    again = tmp_path / "again.toml"
    again.write_text(to_toml(cfg))
    assert load_config(again) == cfg  # the resolved config round-trips


@pytest.mark.parametrize("text", [
    "run 🚀",  # outside the Basic Multilingual Plane: JSON's "\ud83d\ude80" is no TOML
    'quote " and \\ backslash', "tab\tnewline\nbell\x07", "ünïcödé ∑ 漢字", "it's 'quoted'",
    "trailing \\"])
def test_any_string_setting_round_trips_through_config_toml(text, tmp_path):
    """config.toml is written by a TOML library and read back before it is used: every
    string a setting can hold comes back as itself (the run folder, a resume and the workers
    all read this file)."""
    cfg = load_config(None, [f"--log.project={text}", f"--data.cache_dir={tmp_path / text}"])
    assert cfg.log.project == text
    path = tmp_path / "config.toml"
    path.write_text(to_toml(cfg), encoding="utf-8")
    assert load_config(path) == cfg


@pytest.mark.parametrize("steps, warmup", [(20, 2), (5, 0), (150, 15), (400, 20), (5000, 20)])
def test_the_default_warm_up_is_a_tenth_of_a_short_run(steps, warmup):
    """Unset, train.warmup_steps is a tenth of train.steps, at most 20 (before: 20 whatever
    the length, so a 20-step run only warmed up and never decayed). It is written into
    config.toml as a number, which a resume to more steps keeps."""
    from meshfit.train.trainer import lr_lambda

    cfg = load_config(None, [f"--train.steps={steps}"])
    assert cfg.train.warmup_steps == warmup
    factor = lr_lambda(cfg)
    peak = max(range(steps), key=factor)
    assert peak == max(warmup - 1, 0) and factor(steps - 1) < factor(peak)  # it decays
    assert f"warmup_steps = {warmup}" in to_toml(cfg)
    assert load_config(None, ["--train.steps=50", "--train.warmup_steps=30"]).train \
        .warmup_steps == 30  # as given


def test_a_warm_up_over_the_whole_run_is_said():
    """Given, a warm-up as long as the run is a warning before launch: the rate would only
    rise."""
    from meshfit.train.preflight import preflight

    cfg = load_config(None, ["--train.steps=10", "--train.warmup_steps=10", "--model.n_layer=1"])
    assert ("train.warmup_steps=10 covers the whole run of train.steps=10: the learning rate "
            "only rises, never decays; lower it, or leave it unset (a tenth of the run, at "
            "most 20)") in preflight(cfg)


@pytest.mark.parametrize("tokens, shown", [(0, "0"), (3_211, "3,211"), (48_377, "48,377"),
                                           (999_999, "999,999"), (12_096_417, "12.1M")])
def test_the_banner_counts_training_tokens_as_they_are(tokens, shown):
    """A chat data set of a few thousand trained tokens was "0.0M training tokens": below a
    million the count is exact, in millions above."""
    from meshfit.train.trainer import _token_count

    assert _token_count(tokens) == shown


def test_accumulation_from_global_batch():
    cfg = load_config(None, ["--train.global_batch_size=64", "--train.micro_batch_size=8"])
    assert cfg.grad_accumulation(1) == 8 and cfg.grad_accumulation(2) == 4
    with pytest.raises(ValueError, match="multiple of micro_batch_size x data-parallel ranks"):
        cfg.grad_accumulation(16)


@pytest.mark.parametrize("args,match", [
    (["--train.stepz=3"], r"unknown key\(s\) in \[train\]: stepz; known keys: .*steps"),
    (["--optimizer.lr=3"], r"unknown config section\(s\) optimizer"),
    (["--optim.optimizer=adam9"], "optim.optimizer='adam9' is not one of adamw, adamw_fused"),
    (["--data.prefetch_factor=0"], "data.prefetch_factor=0 must be an integer >= 1"),
    (["--optim.betas=[0.9]"], r"optim.betas=\[0.9\] must be two numbers"),
    (["--peft.method=lora", "--peft.target_modules=[\"nope\"]"], "target_modules"),
    (["--train.activation_checkpointing=some"], "train.activation_checkpointing='some'"),
    (["--train.compile=true", "--train.compile_backend=fast"], "compile_backend='fast'"),
    (["--model.attention_backend=efficient"], "model.attention_backend='efficient' is not "
                                              "available on cpu"),
    (["--train.steps=0"], "train.steps=0 must be an integer >= 1"),
    (["--train.mixed_precision=fp8"], "train.mixed_precision='fp8'"),
    (["--model.preset=gpt5"], "model.preset='gpt5' is not a preset"),
    (["--parallel.dp_replicate=3"], "product 3 but the world size is 2"),
    (["--train.global_batch_size=6", "--train.micro_batch_size=6"],
     "global_batch_size=6 must be a multiple of micro_batch_size x data-parallel ranks"),
    (["--data.path=/no/such/place"], "data.path='/no/such/place' does not exist"),
    (["--gpus", "9"], r"--gpus names device\(s\) 9"),
    (["steps=3"], "unknown argument 'steps=3'"),
    (["--log.with=[\"comet\"]"], "log.with='comet' is not a tracker meshfit knows"),
    (["--log.calibration=/no/such.json"], "calibration file /no/such.json does not exist"),
])
def test_bad_train_input_fails_before_launch(args, match, tmp_path, cli_refusal):
    out = tmp_path / "run"
    line = cli_refusal("train", "--nproc", "2", "--out", str(out), *args)
    assert re.search(match, line), line
    assert not out.exists()  # nothing written, nothing launched


# The entry points themselves, in a fresh interpreter: the installed `meshfit` command and
# `python -m meshfit` (every other bad input calls main() in-process, above and in
# test_zero.py, test_train_parallel.py and test_launch.py).
@pytest.mark.parametrize("entry", ["meshfit", "python -m meshfit"])
def test_entry_points_refuse_bad_input_in_one_line(entry, tmp_path, subprocess_env):
    if entry == "meshfit":
        script = Path(sys.executable).with_name("meshfit")
        assert script.is_file(), f"{script} missing: install the package (pip install -e .)"
        command = [str(script)]
    else:
        command = MESHFIT
    out = tmp_path / "run"
    proc = subprocess.run([*command, "train", "--nproc", "2", "--out", str(out),
                           "--train.steps=0"], env=subprocess_env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert re.fullmatch(r"meshfit train: error: train\.steps=0 must be an integer >= 1",
                        lines[0]), lines[0]
    assert not out.exists()


def test_single_device_options_train_end_to_end(tmp_path, subprocess_env):
    """Config keys reach the Accelerator and the optimizer: LoRA adapters only, Adafactor,
    full checkpointing, compiled blocks, worker processes, the empty-cache schedule — and the
    loss still falls."""
    out = tmp_path / "run"
    proc = subprocess.run(
        [*MESHFIT, "train", "--nproc", "1", "--out", str(out), "--train.steps=20",
         "--train.eval_every=0", "--train.log_every=4", "--train.seq_len=64",
         "--train.warmup_steps=2",
         "--train.activation_checkpointing=full", "--train.compile=true",
         "--train.compile_backend=aot_eager", "--train.empty_cache_steps=2",
         "--optim.optimizer=adafactor", "--optim.lr=0.05",
         "--peft.method=lora",
         "--peft.r=4", "--data.num_workers=1"],
        env=subprocess_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # r x (in + out) per adapted linear: tiny has 4 blocks of wq, wk, wv, wo (128->128),
    # w_in (128->512), w_out (512->128).
    trainable = 4 * 4 * (4 * (128 + 128) + 2 * (128 + 512))
    assert f"({trainable / 1e6:.3f}M trainable)" in proc.stdout, proc.stdout
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r["val_loss"] for r in rows if "val_loss" in r]
    # Only rank-4 adapters train (the embeddings and head stay random): a modest but clear
    # drop over 20 steps (5.41 -> 5.08 when written).
    assert evals[-1] < evals[0] - 0.15, evals
    resolved = load_config(out / "config.toml")
    assert resolved.optim.optimizer == "adafactor" and resolved.peft.r == 4
