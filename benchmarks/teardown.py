"""Does a two-process gloo script end cleanly? N trials per way of ending, under plain torchrun.

    python benchmarks/teardown.py [--trials 16] [--ends none,barrier,settle] [--load 2]

The script builds a 1-D DeviceMesh over gloo, all-reduces a tensor over the mesh's group 30
times (with a small matrix product between), then ends in one of these ways, and the
interpreter tears down as usual:

* ``none``: `dist.destroy_process_group()` only;
* ``barrier``: `dist.barrier()`, then `destroy_process_group()`;
* ``settle``: `meshfit.distributed.settle.settle_all()` (a barrier on every group, its Work
  kept by the main thread), then `destroy_process_group()`; what `Accelerator.end_training`
  does.

A trial is clean when torchrun exits 0 within the bound (60 s). Otherwise it is counted as an
abort (a worker died, e.g. "terminate called without an active exception") or a hang (killed
at the bound, with its process tree). `--load N` keeps N busy processes running meanwhile, as
a loaded CI machine has. Prints one line per trial and writes
benchmarks/results/<name>.md and .json. Not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from meshfit.distributed.spawn import free_port

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parents[1]
BOUND_S = 60.0

SCRIPT = """
import sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

end = sys.argv[1]
dist.init_process_group("gloo")
group = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)).get_group()
t = torch.ones(4)
for step in range(30):
    dist.all_reduce(t, group=group)
    torch.ones(200, 200) @ torch.ones(200, 200)
if end == "barrier":
    dist.barrier()
elif end == "settle":
    from meshfit.distributed.settle import settle_all
    settle_all()
dist.destroy_process_group()
"""



def trial(script: Path, end: str, env: dict) -> tuple[str, float, str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(script), end]
    began = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        launcher = psutil.Process(proc.pid)
        for victim in [*launcher.children(recursive=True), launcher]:
            try:  # ours only, by PID
                victim.kill()
            except psutil.NoSuchProcess:
                pass
        proc.communicate()
        return "hang", time.perf_counter() - began, ""
    seconds = time.perf_counter() - began
    if proc.returncode == 0:
        return "clean", seconds, ""
    reason = next((line.strip() for line in out.splitlines() if "terminate called" in line),
                  f"exit {proc.returncode}")
    return "abort", seconds, reason


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=16)
    p.add_argument("--ends", default="none,barrier,settle")
    p.add_argument("--load", type=int, default=0, help="busy processes kept running")
    p.add_argument("--name", default="teardown")
    args = p.parse_args()
    ends = args.ends.split(",")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(args.load)]
    results: dict[str, list] = {end: [] for end in ends}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            script = Path(tmp) / "teardown_script.py"
            script.write_text(SCRIPT)
            for i in range(args.trials):
                for end in ends:  # interleaved, so that every way sees the same conditions
                    outcome, seconds, reason = trial(script, end, env)
                    results[end].append({"outcome": outcome, "seconds": round(seconds, 2),
                                         "reason": reason})
                    print(f"trial {i + 1:2d} {end:8s} {outcome:6s} {seconds:5.1f} s {reason}",
                          flush=True)
    finally:
        for b in busy:
            b.kill()
            b.wait()
    import torch

    rows = ["| end | clean | aborted | hung |", "|---|---|---|---|"]
    for end in ends:
        outcomes = [r["outcome"] for r in results[end]]
        rows.append(f"| {end} | {outcomes.count('clean')}/{len(outcomes)} | "
                    f"{outcomes.count('abort')} | {outcomes.count('hang')} |")
    machine = (f"{platform.node()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
               f"Python {platform.python_version()}")
    text = "\n".join([f"# {args.name}", "",
                      f"`python benchmarks/teardown.py --trials {args.trials} --ends "
                      f"{args.ends} --load {args.load}`", "", f"Machine: {machine}; "
                      f"{args.load} busy processes beside the trials.", "", *rows, ""])
    print("\n" + text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.md").write_text(text)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(
        {"machine": machine, "load": args.load, "trials": args.trials, "results": results},
        indent=1))


if __name__ == "__main__":
    main()
