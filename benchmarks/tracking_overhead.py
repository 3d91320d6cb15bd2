"""What watching a run costs: `meshfit train` throughput with every step logged (metrics.jsonl,
the per-step figures — gradient norm, peak memory per rank, data-wait share — and the
TensorBoard + CSV trackers) against logging once at the end.

    python benchmarks/tracking_overhead.py [--steps 120] [--nproc 1] [--repeats 2]

Throughput of the logged run: tokens between its first and last logged step divided by the
wall time between the two records (their `time` stamps), so the logging itself is inside the
measurement; of the baseline: the one window's tokens_per_s (steps 1..N, nothing excluded but
the final evaluation). Runs alternate (baseline, logged, baseline, ...) and medians are
compared. Writes benchmarks/results/tracking_overhead.md and .json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
COMMON = ["--train.eval_every=0", "--train.eval_batches=1", "--train.seq_len=128",
          "--train.global_batch_size=16", "--train.micro_batch_size=16"]


def _run(folder: Path, name: str, steps: int, nproc: int, extra: list[str]) -> list[dict]:
    out = folder / name
    cmd = [sys.executable, "-m", "meshfit", "train", "--nproc", str(nproc),
           "--out", str(out), f"--train.steps={steps}", f"--data.cache_dir={folder / 'cache'}",
           *COMMON, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise SystemExit(proc.stdout[-2000:] + proc.stderr[-2000:])
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    tokens_per_step = 16 * 128
    base, logged = [], []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for r in range(args.repeats):
            rows = _run(folder, f"base{r}", args.steps, args.nproc,
                        [f"--train.log_every={args.steps}"])
            base.append([x for x in rows if "loss" in x][-1]["tokens_per_s"])
            rows = [x for x in _run(folder, f"logged{r}", args.steps, args.nproc,
                                    ["--train.log_every=1", '--log.with=["tensorboard","csv"]'])
                    if "loss" in x]
            # steps 2..N: the first record ends the window that holds the start-up
            span = rows[-1]["time"] - rows[0]["time"]
            logged.append(round((rows[-1]["step"] - rows[0]["step"]) * tokens_per_step / span, 1))
            print(f"repeat {r}: baseline {base[-1]:.0f} tok/s, every step logged "
                  f"{logged[-1]:.0f} tok/s", flush=True)
    b, lg = statistics.median(base), statistics.median(logged)
    result = {"steps": args.steps, "nproc": args.nproc, "baseline_tokens_per_s": base,
              "logged_tokens_per_s": logged, "median_baseline": b, "median_logged": lg,
              "ratio": round(lg / b, 4), "machine": f"{platform.processor() or 'cpu'}, "
              f"{torch.get_num_threads()} threads, torch {torch.__version__}",
              "date": time.strftime("%Y-%m-%d")}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "tracking_overhead.json").write_text(json.dumps(result, indent=1) + "\n")
    (RESULTS / "tracking_overhead.md").write_text(
        "# Tracking overhead of `meshfit train`\n\n"
        f"`python benchmarks/tracking_overhead.py --steps {args.steps} --nproc {args.nproc} "
        f"--repeats {args.repeats}` on {result['machine']}, {result['date']}; the `tiny` "
        f"preset, {tokens_per_step} tokens per step.\n\n"
        "| run | tokens/s (each repeat) | median |\n|---|---|---|\n"
        f"| logged once at the end | {', '.join(f'{x:.0f}' for x in base)} | {b:.0f} |\n"
        f"| every step: metrics.jsonl + figures + TensorBoard + CSV | "
        f"{', '.join(f'{x:.0f}' for x in logged)} | {lg:.0f} |\n\n"
        f"Ratio (logged / baseline): **{result['ratio']:.3f}**.\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
