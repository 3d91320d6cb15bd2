"""Do restarts recover? N trials of a 2-process job; in each, rank 1 is killed with SIGKILL once
mid-run and the launcher (``--max-restarts 2``) must bring the group back and finish.

    python benchmarks/restarts.py [--trials 20] [--modes mesh,train] [--name restarts]

Modes:

* ``mesh``: ``meshfit launch`` of a gloo script that builds a 1-D DeviceMesh and all-reduces
  over it 30 times (rank 1 is killed after its 5th all-reduce of the first attempt);
* ``plain``: the same script without the DeviceMesh (the default group only);
* ``train``: ``meshfit train`` of the tiny GPT, 30 steps, a checkpoint every 5 steps (rank 1
  is killed once metrics.jsonl shows step 7).

A trial recovered when the launcher exits 0 within the bound (240 s; a hang counts as a
failure and its process tree is killed) and, for ``mesh``/``plain``, both ranks of a later
attempt wrote their result. Prints one line per trial and writes
benchmarks/results/<name>.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parents[1]
BOUND_S = 240.0

SCRIPT = """
import os, sys, pathlib, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
out, use_mesh = pathlib.Path(sys.argv[1]), sys.argv[2] == "mesh"
rank = int(os.environ["RANK"])
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
dist.init_process_group("gloo")
group = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)).get_group() if use_mesh else None
t = torch.ones(4)
for step in range(30):
    dist.all_reduce(t, group=group)
    (out / f"progress-{rank}").write_text(f"{attempt} {step} {os.getpid()}")
    torch.ones(200, 200) @ torch.ones(200, 200)
dist.barrier()
(out / f"done-{rank}-{attempt}").write_text(str(t[0].item()))
dist.destroy_process_group()
"""

TRAIN = ["--train.steps=30", "--train.log_every=1", "--train.eval_every=0",
         "--train.eval_batches=1", "--train.global_batch_size=8", "--train.micro_batch_size=4",
         "--train.seq_len=32", "--model.n_layer=1", "--checkpoint.every=5"]


SRC = REPO / "src"


def _env(tmp: Path) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=str(SRC), TMPDIR=str(tmp), OMP_NUM_THREADS="1",
               MESHFIT_CPU="1", PYTHONUNBUFFERED="1")
    return env


def _rank1(launcher: int) -> psutil.Process | None:
    """The running rank-1 worker under `launcher` (the deepest process with RANK=1)."""
    try:
        found = [p for p in psutil.Process(launcher).children(recursive=True)
                 if p.environ().get("RANK") == "1"]
    except psutil.Error:
        return None
    return found[-1] if found else None


def _killed_when_ready(proc, ready) -> bool:
    while proc.poll() is None:
        if ready():
            victim = _rank1(proc.pid)
            if victim is not None:
                victim.send_signal(signal.SIGKILL)  # a process of our own job, by its PID
                return True
        time.sleep(0.05)
    return False


def _end_tree(proc: subprocess.Popen) -> None:
    try:
        tree = [proc, *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.Error:
        tree = [proc]
    for p in tree:
        try:
            p.kill()
        except (psutil.Error, ProcessLookupError):
            pass
    proc.wait()


def trial(mode: str, tmp: Path, cache: Path) -> dict:
    out = tmp / "run"
    out.mkdir()
    if mode == "train":
        cmd = [sys.executable, "-m", "meshfit", "train", "--nproc", "2",
               "--max-restarts", "2", "--out", str(out / "train"),
               f"--data.cache_dir={cache}", *TRAIN]

        def ready():
            metrics = out / "train" / "metrics.jsonl"
            return metrics.exists() and len(metrics.read_text().splitlines()) >= 7
    else:
        script = tmp / "job.py"
        script.write_text(SCRIPT)
        cmd = [sys.executable, "-m", "meshfit", "launch", "--nproc", "2",
               "--max-restarts", "2", str(script), str(out), mode]

        def ready():
            try:
                attempt, step, _ = (out / "progress-1").read_text().split()
            except (OSError, ValueError):
                return False
            return attempt == "0" and int(step) >= 5
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=_env(tmp), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    killed = _killed_when_ready(proc, ready)
    try:
        stdout, stderr = proc.communicate(timeout=BOUND_S)
        hung = False
    except subprocess.TimeoutExpired:
        _end_tree(proc)
        stdout, stderr = proc.communicate()
        hung = True
    seconds = time.monotonic() - start
    ok = proc.returncode == 0 and killed
    if mode != "train":
        ok = ok and any((out / f"done-0-{a}").exists() and (out / f"done-1-{a}").exists()
                        for a in ("1", "2"))
    tail = [line for line in stderr.splitlines() if line.strip()][-3:]
    return dict(mode=mode, recovered=ok, killed=killed, hung=hung, rc=proc.returncode,
                seconds=round(seconds, 1), stderr_tail=tail)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--modes", default="mesh,train")
    p.add_argument("--name", default="restarts")
    p.add_argument("--src", default=None,
                   help="meshfit's source folder to run (default: this checkout's src), e.g. "
                        "an older commit's, exported with git archive")
    args = p.parse_args()
    global SRC
    SRC = Path(args.src).resolve() if args.src else SRC
    rows = []
    with tempfile.TemporaryDirectory() as top:
        cache = Path(top) / "cache"
        for mode in args.modes.split(","):
            for i in range(args.trials):
                tmp = Path(top) / f"{mode}-{i}"
                tmp.mkdir()
                row = trial(mode, tmp, cache)
                rows.append(row)
                print(json.dumps(row), flush=True)
    import torch

    summary = {m: [sum(r["recovered"] for r in rows if r["mode"] == m),
                   sum(1 for r in rows if r["mode"] == m)] for m in args.modes.split(",")}
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                         text=True).stdout.strip() if args.src is None else f"src {args.src}"
    meta = dict(torch=torch.__version__, python=platform.python_version(),
                machine=f"{os.cpu_count()} cores, {platform.machine()}", commit=git,
                load_average=os.getloadavg(), date=time.strftime("%Y-%m-%d %H:%M UTC",
                                                                  time.gmtime()))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(dict(meta=meta, summary=summary,
                                                               trials=rows), indent=1))
    lines = [f"# Restart trials ({args.name})", "",
             "`python benchmarks/restarts.py " + " ".join(sys.argv[1:]) + "`", "",
             f"torch {meta['torch']}, Python {meta['python']}, {meta['machine']}, commit "
             f"{git}, gloo, 2 processes, --max-restarts 2, rank 1 killed with SIGKILL once.", "",
             "| mode | recovered / attempted | median s | hung |", "|---|---|---|---|"]
    for m, (good, n) in summary.items():
        secs = sorted(r["seconds"] for r in rows if r["mode"] == m)
        hung = sum(r["hung"] for r in rows if r["mode"] == m)
        lines.append(f"| {m} | {good} / {n} | {secs[len(secs) // 2]} | {hung} |")
    (RESULTS / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
