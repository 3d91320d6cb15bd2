"""`meshfit train` with tensor and pipeline parallel layouts against a one-process run.

The same seed, data order and schedule: a one-process run with micro-batch 2 and
accumulation 4 sees, in each optimizer step, exactly the 8 sequences that a pp=2 run cuts
into 4 pipeline micro-batches, or that a tp=2 run feeds both TP ranks. Dropout is off (the
layouts draw random numbers differently), so the logged losses must agree. fp32 (the
trainer's dtype): the layouts sum in other orders (~1e-7 relative per op), and over 8
AdamW steps with gradient clipping the logged mean losses stay within 1e-4 relative of each
other (measured: a few 1e-6), while a layout that drops a micro-batch, double-counts the
tied weights or skips the loss scaling differs from the first step by > 1e-2.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from conftest import make_subprocess_env

MESHFIT = [sys.executable, "-m", "meshfit"]
BASE = ["--train.steps=8", "--train.eval_every=0", "--train.log_every=1",
        "--train.global_batch_size=8", "--train.micro_batch_size=2", "--train.seq_len=32",
        "--train.eval_batches=1", "--model.n_layer=4", "--model.d_model=64",
        "--model.d_ff=128", "--model.dropout=0.0", "--train.warmup_steps=2"]
RTOL = 1e-4


def _run(tmp_path, name, nproc, args, env):
    out = tmp_path / name
    proc = subprocess.run([*MESHFIT, "train", "--nproc", str(nproc), "--out", str(out), *BASE,
                           f"--data.cache_dir={tmp_path / 'cache'}", *args], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return out, proc.stdout, [line["loss"] for line in lines if "loss" in line]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    _, _, losses = _run(tmp, "ref", 1, [], make_subprocess_env(tmp))
    return losses


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_pp2_train_matches_one_process_and_records_timings(tmp_path, subprocess_env,
                                                           reference, schedule):
    from meshfit.train.pipeline_record import read_run

    out, stdout, losses = _run(tmp_path, "pp2", 2, ["--parallel.pp=2",
                                                    f"--parallel.schedule={schedule}",
                                                    "--train.eval_every=4"], subprocess_env)
    # microbatches unset = the whole accumulation
    assert f"{schedule} schedule with 4 micro-batches of 2" in stdout
    assert len(losses) == 8 and losses[-1] < losses[0]
    for got, want in zip(losses, reference):
        assert got == pytest.approx(want, rel=RTOL)
    meta, timings = read_run(out)
    assert (meta["schedule"], meta["pp"], meta["microbatches"]) == (schedule, 2, 4)
    assert {t["rank"] for t in timings} == {0, 1}
    assert {t["step"] for t in timings} == set(range(5))  # the first 5 steps
    if schedule == "1f1b":  # 5 steps x 2 ranks x 4 micro-batches x (forward, backward)
        assert len(timings) == 5 * 2 * 4 * 2
    else:  # ZB-V: 2 stages per rank, every micro-batch's forward recorded on each
        assert sum(t["phase"] == "forward" for t in timings) == 5 * 2 * 2 * 4


def test_tp2_train_matches_one_process(tmp_path, subprocess_env, reference):
    _, stdout, losses = _run(tmp_path, "tp2", 2, ["--parallel.tp=2"], subprocess_env)
    assert "mesh tp 2" in stdout
    for got, want in zip(losses, reference):
        assert got == pytest.approx(want, rel=RTOL)


@pytest.mark.parametrize("nproc, args, match", [
    (3, ["--parallel.tp=3", "--parallel.dp_replicate=1"],
     r"parallel.tp: tensor parallel tp=3 does not fit the model: GPTConfig.n_head=4 does "
     r"not divide by tp=3"),
    (2, ["--parallel.pp=2", "--model.n_layer=1"], r"parallel.pp=2 exceeds the model's 1 blocks"),
    (2, ["--parallel.pp=2", "--parallel.microbatches=3"],
     r"parallel.microbatches=3 does not divide the 4 micro-batches"),
    (2, ["--parallel.pp=2", "--parallel.tp=2"], r"world size \(2\) to be a multiple of 4"),
    (2, ["--parallel.pp=2", "--parallel.schedule=zb"], r"parallel.schedule='zb' is not one of"),
    (2, ["--parallel.pp=2", "--train.mixed_precision=fp16"], r"'fp16' with parallel.pp > 1"),
    (2, ["--parallel.tp=2", "--train.find_batch_size=true"],
     r"find_batch_size=true is not supported with parallel.tp=2: the tensor-parallel"),
    (2, ["--parallel.tp=2", "--parallel.sequence_parallel=true", "--train.seq_len=33"],
     r"train.seq_len=33 does not divide by parallel.tp=2"),
    (2, ["--parallel.sequence_parallel=true"], r"sequence_parallel=true needs parallel.tp > 1"),
    (4, ["--parallel.pp=2", "--parallel.dp_shard=2", "--parallel.dp_replicate=1",
         "--parallel.zero_stage=3", "--parallel.offload=cpu"],
     r"parallel.offload='cpu' with parallel.pp > 1 is not yet available"),
])
def test_bad_model_parallel_input_fails_before_launch(nproc, args, match, tmp_path,
                                                      cli_refusal):
    out = tmp_path / "run"
    line = cli_refusal("train", "--nproc", str(nproc), "--out", str(out), *BASE, *args)
    assert re.search(match, line), line
    assert not out.exists()  # nothing written, nothing launched
