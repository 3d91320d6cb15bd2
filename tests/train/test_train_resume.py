"""`meshfit train` with checkpoints: `[checkpoint] every`, `keep`, and `--resume` continuing a
run from its newest complete checkpoint, also in another layout.

A 2-process run of 6 steps saves at steps 2, 4 and 6 and keeps the newest two. Its folder is
then cut back to how it was during step 5 (the step-6 checkpoint gone, step 5's metric line
written) and resumed as ZeRO-2: the metrics must continue after step 4 with no step written
twice; the same checkpoint is also resumed as pp=2. The resumed steps agree with the uninterrupted run's to 1e-4 relative: fp32, and the
layouts differ in the order of sums only (~1e-7 relative per operation; the logged values
are rounded to 5 decimals); a resume that lost the optimizer state, the learning-rate
schedule or the data position misses by more than 1e-2.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import torch

MESHFIT = [sys.executable, "-m", "meshfit"]
RUN = ["--train.steps=6", "--train.log_every=1", "--train.eval_every=0",
       "--train.eval_batches=1", "--train.global_batch_size=8", "--train.micro_batch_size=4",
       "--train.seq_len=32", "--model.n_layer=2", "--checkpoint.every=2", "--checkpoint.keep=2",
       "--checkpoint.async=true", "--checkpoint.async_mode=process"]
# (written in the background, by a writer process per rank: the same checkpoints)


def _metrics(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from conftest import make_subprocess_env

    tmp = tmp_path_factory.mktemp("resume")
    env = make_subprocess_env(tmp)
    full, cut = tmp / "full", tmp / "cut"
    cache = f"--data.cache_dir={tmp / 'cache'}"
    proc = subprocess.run([*MESHFIT, "train", "--nproc", "2", "--out", str(full), *RUN, cache],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    listed = sorted(p.name for p in (full / "checkpoints").iterdir())
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "step-6")
    lines = [line for line in (cut / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["step"] <= 5]  # step 5 was logged, then the run died
    (cut / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    as_pp = tmp / "as_pp"
    shutil.copytree(cut, as_pp)  # the same cut run, resumed a second time below, as pp=2
    # the two resumes at once (independent folders): the suite's cores are not both busy
    # all the time, and this fixture waited on one after the other
    with ThreadPoolExecutor(2) as pool:
        resumed, piped = pool.map(lambda args: subprocess.run(
            [*MESHFIT, "train", "--nproc", "2", "--resume", *args], env=env,
            capture_output=True, text=True, timeout=240), [
            ["--out", str(cut), "--parallel.dp_shard=2", "--parallel.dp_replicate=1",
             "--parallel.zero_stage=2"],
            ["--out", str(as_pp), "--parallel.pp=2", "--parallel.dp_replicate=1"]])
    yield {"full": full, "cut": cut, "listed": listed, "resumed": resumed, "env": env,
           "as_pp": as_pp, "piped": piped, "full_output": proc.stdout + proc.stderr}
    shutil.rmtree(tmp, ignore_errors=True)


def test_checkpoints_are_written_and_pruned(runs):
    assert runs["listed"] == ["step-4", "step-6"]  # every=2 wrote 2, 4, 6; keep=2
    folder = runs["full"] / "checkpoints" / "step-6"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["step"] == 6 and manifest["world_size"] == 2
    assert manifest["layout"]["engine"] == "ddp"
    # the writer processes' digests became the manifest's, and their files are gone
    assert sorted(p.name for p in folder.iterdir()) == [".metadata", "__0_0.distcp",
                                                        "__1_0.distcp", "manifest.json"]
    assert "background process" not in runs["full_output"]  # (DCP's INFO lines, silenced)


@pytest.mark.parametrize("layout", ["zero2", "pp2"])
def test_resume_continues_the_run_in_another_layout(runs, layout):
    proc, folder = (runs["resumed"], runs["cut"]) if layout == "zero2" else \
        (runs["piped"], runs["as_pp"])
    assert proc.returncode == 0, proc.stderr
    assert "(step 4 of 6, saved by 2 process(es))" in proc.stdout
    full, cut = _metrics(runs["full"]), _metrics(folder)
    assert [m["step"] for m in cut] == [m["step"] for m in full]  # nothing twice, nothing lost
    assert cut[:5] == full[:5]  # the lines up to the checkpoint are kept as they were
    for a, b in zip(full[5:], cut[5:]):
        key = "loss" if "loss" in a else "val_loss"
        assert math.isclose(a[key], b[key], rel_tol=1e-4), (a, b)
    config = (folder / "config.toml").read_text()
    # the layout override is the run's config from now on
    assert ("zero_stage = 2" if layout == "zero2" else "pp = 2") in config


@pytest.mark.parametrize("args, message", [
    (["--resume"], "--resume needs --out"),
    (["--resume", "--train.lr=9"], r"keeps its saved config except \[parallel\], "
                                   r"\[checkpoint\], train.steps; start a new run to change "
                                   r"train.lr"),
    (["--resume", "--config", "x.toml"], "drop --config"),
    (["--resume", "--nproc", "2"], "holds no complete checkpoint"),
])
def test_resume_refuses_what_it_cannot_do(args, message, tmp_path, capsys):
    from meshfit.cli.main import main

    out = tmp_path / "run"
    out.mkdir()
    (out / "config.toml").write_text("[train]\nsteps = 6\n")
    if args != ["--resume"]:
        args = ["--out", str(out), *args]
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(message, err[0]), err
    assert not (out / "checkpoints").exists()


def test_a_finished_run_trains_further_with_a_larger_train_steps(tmp_path, subprocess_env):
    """A 4-step run (checkpoints at 2 and 4) resumed with --train.steps=8: steps 5-8 follow
    the cosine redrawn over 8 steps (the logged rate, set after each step, is the formula's);
    resuming it again says it is finished and prints its last figures; a train.steps behind
    the newest checkpoint is refused in one line, before anything starts."""
    from meshfit.train.config import RunConfig, TrainConfig
    from meshfit.train.trainer import lr_lambda

    out = tmp_path / "run"
    base = [*MESHFIT, "train", "--nproc", "1", "--out", str(out)]
    first = subprocess.run([*base, "--train.steps=4", "--train.warmup_steps=1",
                            "--train.log_every=1", "--train.eval_every=0",
                            "--train.eval_batches=1", "--train.global_batch_size=4",
                            "--train.micro_batch_size=4", "--train.seq_len=32",
                            "--model.n_layer=1", "--checkpoint.every=2",
                            f"--data.cache_dir={tmp_path / 'cache'}"],
                           env=subprocess_env, capture_output=True, text=True, timeout=240)
    assert first.returncode == 0, first.stderr
    before = _metrics(out)
    longer = subprocess.run([*base, "--resume", "--train.steps=8"], env=subprocess_env,
                            capture_output=True, text=True, timeout=240)
    assert longer.returncode == 0, longer.stderr
    assert "resuming from step-4 to step 8" in longer.stdout
    after = _metrics(out)
    assert after[:len(before)] == before  # the first four steps' lines kept as they were
    steps = [m["step"] for m in after if "loss" in m]
    assert steps == [1, 2, 3, 4, 5, 6, 7, 8]
    factor = lr_lambda(RunConfig(train=TrainConfig(steps=8, warmup_steps=1,
                                                   global_batch_size=4, micro_batch_size=4)))
    lr = 3e-3  # [optim] lr's default
    for m in after:
        if "loss" in m and m["step"] > 4:  # logged after the step: the next step's rate
            assert math.isclose(m["lr"], lr * factor(m["step"]), rel_tol=1e-9), m
            assert math.isfinite(m["loss"])
    assert "steps = 8" in (out / "config.toml").read_text()
    assert (out / "checkpoints" / "step-8").is_dir()
    last_loss = [m["loss"] for m in after if "loss" in m][-1]
    again = subprocess.run([*base, "--resume"], env=subprocess_env, capture_output=True,
                           text=True, timeout=240)
    assert again.returncode == 0, again.stderr
    assert "is finished: step-8 is its last step" in again.stdout
    assert f"loss {last_loss} (step 8)" in again.stdout and "val_loss" in again.stdout
    assert _metrics(out) == after  # nothing trained, nothing rewritten
    behind = subprocess.run([*base, "--resume", "--train.steps=6"], env=subprocess_env,
                            capture_output=True, text=True, timeout=240)
    assert behind.returncode == 2
    assert behind.stderr.strip().splitlines() == [
        "meshfit train: error: --train.steps=6 is behind the run's newest checkpoint (step-8); "
        "give train.steps > 8 to train further"]


PREEMPT = ["--train.steps=40", "--train.log_every=1", "--train.eval_every=0",
           "--train.eval_batches=1", "--train.global_batch_size=8", "--train.micro_batch_size=4",
           "--train.seq_len=32", "--model.n_layer=1"]


def _wait_for_step(metrics, step: int, proc, timeout: float = 120.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and any(json.loads(line).get("step", 0) >= step
                                    for line in metrics.read_text().splitlines()[-3:]
                                    if line.endswith("}")):
            return
        time.sleep(0.02)
    raise AssertionError(f"the run did not reach step {step} (exit code {proc.poll()})")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """A 40-step 2-process run that nothing stops: what the interrupted runs must equal."""
    from conftest import make_subprocess_env

    tmp = tmp_path_factory.mktemp("uninterrupted")
    env = make_subprocess_env(tmp)
    cache = f"--data.cache_dir={tmp / 'cache'}"
    done = subprocess.run([*MESHFIT, "train", "--nproc", "2", "--out", str(tmp / "whole"),
                           *PREEMPT, cache], env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr
    yield {"folder": tmp / "whole", "cache": cache}
    shutil.rmtree(tmp, ignore_errors=True)


def _losses(folder):
    return [(m["step"], m.get("loss"), m.get("val_loss")) for m in _metrics(folder)]


def test_ctrl_c_checkpoints_and_the_printed_command_resumes_the_uninterrupted_run(
        uninterrupted, tmp_path, subprocess_env):
    """Ctrl-C (SIGINT) to the launcher after step 3 of 40: the workers get the signal that
    came, finish their step, write a checkpoint and exit 130 with one line naming SIGINT and
    the command that continues the run; that command, run as printed, gives every step's loss
    exactly as the run that was never stopped (the same 2 processes: bitwise). Before, the
    line said SIGTERM and the command left out the processes: the resume ran on one, with
    twice the accumulation, and its losses drifted."""
    import shlex
    import signal

    cut = tmp_path / "cut"
    proc = subprocess.Popen([*MESHFIT, "train", "--nproc", "2", "--out", str(cut), *PREEMPT,
                             uninterrupted["cache"]], env=subprocess_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_step(cut / "metrics.jsonl", 3, proc)
        proc.send_signal(signal.SIGINT)  # our own child, by its PID
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    ours = [line for line in err.splitlines() if line.startswith("meshfit train:")]
    assert len(ours) == 1 and "stopped by SIGINT after step" in ours[0], err
    step = int(ours[0].split("after step ")[1].split(";")[0])
    assert 3 <= step < 40 and (cut / "checkpoints" / f"step-{step}").is_dir()
    command = shlex.split(ours[0].split("continue with: ")[1])
    assert command[:2] == ["meshfit", "train"], ours[0]
    resumed = subprocess.run([*MESHFIT, *command[1:]], env=subprocess_env,
                             capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr
    assert _losses(cut) == _losses(uninterrupted["folder"])


def test_a_resume_runs_on_the_processes_that_saved_it_unless_told(runs, tmp_path,
                                                                   monkeypatch, capsys):
    """--resume of a run saved by 2 processes starts 2 workers when no --nproc is given; with
    --nproc 1 it runs on one and says, before starting, that the run was saved by 2 and the
    losses will not be the uninterrupted run's. (What would be started is recorded, not
    run.)"""
    from meshfit import launch
    from meshfit.cli.main import main
    from meshfit.train import trainer

    started = []
    monkeypatch.setattr(launch, "run", lambda cfg, *a, **k: started.append(cfg.nproc) or 0)
    monkeypatch.setattr(trainer, "train", lambda cfg, out, **k: started.append("here") or {})
    folder = tmp_path / "run"
    shutil.copytree(runs["full"], folder)
    assert main(["train", "--out", str(folder), "--resume", "--train.steps=8"]) == 0
    assert started == [2]
    capsys.readouterr()
    assert main(["train", "--out", str(folder), "--resume", "--train.steps=8",
                 "--nproc", "1"]) == 0
    assert started == [2, "here"]
    warned = [line for line in capsys.readouterr().err.splitlines() if "saved by" in line]
    assert warned == [
        "meshfit train: warning: resuming on 1 process(es), the run was saved by 2: its steps "
        "now split and accumulate the batch otherwise and draw from fresh random generators, "
        "so its losses will not be the uninterrupted run's (--nproc 2 continues it as it was)"]


def test_the_first_loss_logged_after_a_resume_is_the_uninterrupted_runs(tmp_path, one_thread):
    """Logged every 3 steps, checkpointed every 2: resumed from step 4, the line of step 6 is
    the mean of steps 4, 5 and 6 as in the run that never stopped (the checkpoint holds the
    window's losses so far), not of steps 5 and 6 alone."""
    from meshfit.distributed import init
    from meshfit.train.configfile import load_config
    from meshfit.train.trainer import train

    (tmp_path / "text.txt").write_text("".join(f"line {i}: the quick brown fox {i * i}\n"
                                               for i in range(800)))
    cfg = load_config(None, [
        "--train.steps=6", "--train.log_every=3", "--train.eval_every=0",
        "--train.eval_batches=1", "--train.global_batch_size=4", "--train.micro_batch_size=2",
        "--train.seq_len=16", "--model.n_layer=1", "--checkpoint.every=2",
        f"--data.path={tmp_path / 'text.txt'}", f"--data.cache_dir={tmp_path / 'cache'}"])
    full, cut = tmp_path / "full", tmp_path / "cut"
    train(cfg, full, init())
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "step-6")  # the run stopped after step 4
    kept = [line for line in (cut / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["step"] <= 4]
    (cut / "metrics.jsonl").write_text("\n".join(kept) + "\n")
    train(cfg, cut, init(), resume=True)
    assert [m["step"] for m in _metrics(full) if "loss" in m] == [3, 6]
    assert _losses(cut) == _losses(full)


def test_a_killed_worker_is_restarted_and_the_run_equals_the_uninterrupted_one(
        uninterrupted, tmp_path, subprocess_env):
    """--max-restarts 1 and a checkpoint every 5 steps: rank 1 killed with SIGKILL after step
    12; the agent restarts both workers, they continue from the newest checkpoint (step 10),
    and every logged loss equals the uninterrupted run's, none written twice."""
    cut = tmp_path / "cut"
    proc = subprocess.Popen([*MESHFIT, "train", "--nproc", "2", "--max-restarts", "1", "--out",
                             str(cut), *PREEMPT, "--checkpoint.every=5", uninterrupted["cache"]],
                            env=subprocess_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        _wait_for_step(cut / "metrics.jsonl", 12, proc)
        workers = [c for c in psutil.Process(proc.pid).children(recursive=True)
                   if "--worker" in c.cmdline() and c.environ().get("RANK") == "1"]
        assert len(workers) == 1
        workers[0].kill()  # a child of our own child, found by its PID
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "restart 1 of the workers" in out and "resuming from" in out, out
    # the survivor, whose collective failed when rank 1 died, leaves without a traceback
    assert "Traceback" not in err and "[rank0]" not in err, err
    assert _losses(cut) == _losses(uninterrupted["folder"])


def test_a_diverging_run_stops_with_the_step_and_the_rank(tmp_path, capsys, one_thread):
    from meshfit.cli.main import main

    args = ["train", "--out", str(tmp_path / "run"), f"--data.cache_dir={tmp_path / 'cache'}",
            "--train.steps=30", "--train.log_every=2", "--train.eval_every=0",
            "--train.eval_batches=1", "--train.global_batch_size=4", "--train.micro_batch_size=4",
            "--train.seq_len=16", "--model.n_layer=1", "--optim.optimizer=sgd",
            "--optim.lr=10", "--train.grad_clip=0", "--train.warmup_steps=0"]
    assert main(args) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "the loss is not finite" in err[0], err
    assert "on data-parallel rank 0; lower optim.lr" in err[0]
    step = int(err[0].split("by step ")[1].split(" ")[0])
    logged = _metrics(tmp_path / "run")
    assert step < 30 and all(m["step"] < step for m in logged)  # nothing logged after it


def _stall(rank, world_size):
    import datetime
    import time

    import torch
    import torch.distributed as dist

    from meshfit.train.run import Stalled, collective_deadline

    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=2))
    try:
        if rank == 1:
            time.sleep(6)  # a rank that hangs past the deadline
            return None
        try:
            with collective_deadline(rank, 2, lambda: "step 7"):
                dist.all_reduce(torch.ones(1), group=group)
        except Stalled as err:
            return str(err)
        return None
    finally:
        dist.destroy_process_group(group)  # timed out: no barrier can pass on it any more


def test_a_hung_rank_is_named_not_waited_for():
    """A collective waiting past the process group's timeout becomes one line naming the rank,
    the step and the operation (gloo's timeout, real, on 2 ranks)."""
    from conftest import run_distributed

    message, _ = run_distributed(_stall, 2, timeout=60)
    assert message is not None and "\n" not in message
    assert message.startswith("rank 0 waited more than 2 s for the other ranks during step 7 (")
    assert "Timed out waiting" in message and "raise train.timeout_s" in message


def _one_rank_signalled(rank, world_size):
    import signal
    from types import SimpleNamespace

    from meshfit.train import run

    stop = run.StopOnSignal()
    try:
        acc = SimpleNamespace(env=SimpleNamespace(is_distributed=True, rank=rank,
                                                  world_size=world_size),
                              device=torch.device("cpu"))
        before = stop.requested(acc)
        if rank == 1:
            stop._handle(signal.SIGTERM, None)
        return before, stop.requested(acc), stop.ranks
    finally:
        stop.restore()


def test_a_signal_to_one_rank_stops_every_rank_and_names_it():
    """SIGTERM to rank 1 alone: after the step every rank knows of it and which rank got it
    (the line says "sent to rank 1 only"), so all stop together with a checkpoint."""
    import signal
    from pathlib import Path

    from conftest import run_distributed

    from meshfit.train.run import Preempted

    got = run_distributed(_one_rank_signalled, 2, timeout=60)
    assert got == [(0, signal.SIGTERM, [1])] * 2
    line = str(Preempted(signal.SIGTERM, 7, Path("out/checkpoints/step-7"), Path("out"), [1],
                         nproc=2))
    assert line == ("stopped by SIGTERM (sent to rank 1 only) after step 7; checkpoint "
                    "out/checkpoints/step-7; continue with: meshfit train --out out --resume "
                    "--nproc 2")
    assert str(Preempted(signal.SIGINT, 7, Path("c"), Path("out"))).startswith(
        "stopped by SIGINT after step 7; ")


def test_workers_that_stopped_together_are_not_a_failure():
    """The launcher takes every worker leaving with 128 + SIGTERM (or SIGINT) as the stop
    the workers already reported (their exit code, no failure summary, no restart); any
    other mix is a failure."""
    from types import SimpleNamespace

    from meshfit.launch.torchrun import agreed_stop

    def codes(*exits):
        return {rank: SimpleNamespace(exitcode=code) for rank, code in enumerate(exits)}

    assert agreed_stop(codes(143, 143), 2) == 143
    assert agreed_stop(codes(130, 130), 2) == 130
    assert agreed_stop(codes(143, -15), 2) == 143  # the agent ended one that was leaving
    assert agreed_stop(codes(143), 2) is None  # rank 1 did not stop
    assert agreed_stop(codes(143, 1), 2) is None
    assert agreed_stop(codes(-15, -15), 2) is None  # killed, not stopped
    assert agreed_stop(codes(143, 130), 2) is None


def test_errors_that_mean_another_rank_died_are_recognised():
    """gloo's error when the other end of a collective has gone, as one line without the
    C++ location; NCCL's after a peer failure; other errors are not taken for it."""
    from meshfit.distributed.env import peer_lost

    gloo = RuntimeError("[/w/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
                        "by peer [127.0.0.1]:41873. This is typically caused by a remote worker "
                        "crashing. Check the logs of the remote worker before reporting.")
    assert peer_lost(gloo) == "Connection closed by peer [127.0.0.1]:41873"
    assert peer_lost(RuntimeError("NCCL error: remote process exited or there was a network "
                                  "error, NCCL version 2.27.3 ncclRemoteError"))
    assert peer_lost(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
    assert peer_lost(ValueError("Connection closed by peer")) is None  # not a backend's error


def test_a_second_signal_ends_the_run_at_once(monkeypatch):
    """The first signal only asks for a stop after the step (with a checkpoint); the second
    restores the signal's default action and sends it again, ending the process at once.
    (Checked on the handler: two signals sent back to back reach a process as one.)"""
    import signal

    from meshfit.train import run

    sent = []
    monkeypatch.setattr(run.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    stop = run.StopOnSignal()
    try:
        stop._handle(signal.SIGTERM, None)
        assert stop.signum == signal.SIGTERM and sent == []  # asked, not yet acted on
        stop._handle(signal.SIGTERM, None)
        assert sent == [(run.os.getpid(), signal.SIGTERM)]
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) != stop._handle  # the handlers are put back
