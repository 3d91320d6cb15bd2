"""Checkpoints, measured: save and load time and bytes per rank for each layout, and the
training time a synchronous and an asynchronous save cost.

    meshfit launch --nproc 2 benchmarks/checkpoint.py
    meshfit launch --nproc 4 benchmarks/checkpoint.py --layouts ddp,zero1,zero3,dp2xtp2

For each layout the reference GPT (Adam state included) is trained for a few steps, then:

* save: `Accelerator.save_state` (DCP, each rank writes its shards, committed with a
  manifest) — wall time, median of `--repeats`, and the bytes this rank wrote;
* load: `Accelerator.load_state` of that checkpoint into the same prepared objects (checks
  against the manifest, resharding) — wall time;
* training time lost: a run of `--steps` steps with one save in its middle, minus the same
  run without a save; synchronous, then asynchronous (`async_save=True`: the state is copied
  to host memory and written by a thread while the steps go on; the commit is counted).

Not a test: nothing here asserts on timings. Results: benchmarks/results/checkpoint_<N>ranks.md
and .json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

from meshfit import Accelerator, ParallelDims  # noqa: E402

LAYOUTS = {
    "ddp": (dict(), {}),
    "zero1": (dict(dp_shard=-1, dp_replicate=1), dict(zero_stage=1)),
    "zero2": (dict(dp_shard=-1, dp_replicate=1), dict(zero_stage=2)),
    "zero3": (dict(dp_shard=-1, dp_replicate=1), dict(zero_stage=3)),
    "tp2": (dict(tp=2, dp_replicate=-1), {}),
    "dp2xtp2": (dict(dp_replicate=2, tp=2), {}),
}


def _setup(name: str, args):
    dims, options = LAYOUTS[name]
    acc = Accelerator(parallel=ParallelDims(**dims), **options)
    model = acc.prepare(_common.build_model(_common.model_config(args), args.seed))
    opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-4))
    x = torch.randint(0, 256, (args.batch_size, args.seq_len), device=acc.device)

    def step():
        with acc.accumulate(model):
            acc.backward(model(x, x))
            opt.step()
            opt.zero_grad()

    for _ in range(2):  # optimizer state exists, kernels warm
        step()
    return acc, step


def _written_bytes(folder: Path, rank: int) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.name.startswith(f"__{rank}_"))


def _timed(fn, device) -> float:
    _common.device_sync(device)
    if dist.is_initialized():
        dist.barrier()
    t0 = time.perf_counter()
    fn()
    _common.device_sync(device)
    if dist.is_initialized():
        dist.barrier()
    return time.perf_counter() - t0


def run_layout(name: str, args, root: Path) -> dict:
    acc, step = _setup(name, args)
    folder = root / f"{name}"
    saves, loads = [], []
    for _ in range(args.repeats):
        saves.append(_timed(lambda: acc.save_state(folder), acc.device))
        loads.append(_timed(lambda: acc.load_state(folder), acc.device))
    written = _written_bytes(folder, acc.process_index)

    def train(save: str | None) -> float:
        def run():
            for i in range(args.steps):
                step()
                if save and i == args.steps // 2:
                    acc.save_state(root / f"{name}-{save}", async_save=save == "async")
            acc.wait_for_checkpoint()
        return _timed(run, acc.device)

    plain = statistics.median(train(None) for _ in range(args.repeats))
    sync = statistics.median(train("sync") for _ in range(args.repeats))
    background = statistics.median(train("async") for _ in range(args.repeats))
    return {"layout": name, "engine": acc.layout.engine.value, "save_s": statistics.median(saves),
            "load_s": statistics.median(loads), "bytes_written": written, "train_s": plain,
            "lost_sync_s": sync - plain, "lost_async_s": background - plain,
            "params": sum(p.numel() for p in _common.build_model(
                _common.model_config(args), args.seed).parameters())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _common.add_model_args(p, d_model=512, n_layer=8, n_head=8, d_ff=2048, seq_len=64)
    p.add_argument("--layouts", default="ddp,zero1,zero2,zero3,tp2")
    p.add_argument("--steps", type=int, default=8, help="steps of the training-time runs")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary "
                                               "folder under $TMPDIR, removed at the end)")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    probe = Accelerator()
    world, main_rank = probe.num_processes, probe.is_main_process
    if world < 2:
        raise SystemExit("run with at least 2 processes: meshfit launch --nproc 2 "
                         "benchmarks/checkpoint.py")
    info = _common.machine_info(probe)
    token = [tempfile.mkdtemp(prefix="meshfit-ckpt-") if main_rank else None]
    dist.broadcast_object_list(token, src=0)
    root = Path(args.dir or token[0])
    rows = []
    for name in args.layouts.split(","):
        try:
            r = run_layout(name, args, root)
        except (ValueError, RuntimeError) as err:
            r = {"layout": name, "error": str(err).splitlines()[0][:160]}
        mine = r.get("bytes_written", 0)
        r["bytes_per_rank"] = [int(x[0]) for x in _common.gather_floats([float(mine)])]
        rows.append(r)
        if main_rank:
            print(r, flush=True)
    info["loadavg_at_end"] = list(os.getloadavg())
    dist.barrier()
    if main_rank:
        shutil.rmtree(root, ignore_errors=True)
        md = _markdown(rows, args, info, world)
        print(md)
        if not args.no_write:
            paths = _common.write_results(f"checkpoint_{world}ranks", md,
                                          {"machine": info, "args": vars(args), "rows": rows})
            print(f"wrote {paths[0]} and {paths[1]}")
    probe.end_training()


def _markdown(rows, args, info, world) -> str:
    mib = 2**20
    n = next((r["params"] for r in rows if "params" in r), 0)
    out = ["# Checkpoints: save, load and training time lost, measured", "",
           f"Command: `{_common.launch_command()}`", "", _common.machine_markdown(info), "",
           f"{world} ranks, reference GPT with {n / 1e6:.2f}M parameters, fp32 AdamW (model + "
           f"optimizer state = {16 * n / mib:.1f} MiB in all). Save / load: median of "
           f"{args.repeats} (`save_state` commits with checksums; `load_state` verifies them). "
           f"Lost: a {args.steps}-step run with one save minus the same run without, median of "
           f"{args.repeats}.", "",
           "| layout | engine | save s | load s | MiB written per rank | train s | lost, sync s "
           "| lost, async s |", "|---|---|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['layout']} | — | — | — | — | — | — | {r['error']} |")
            continue
        per_rank = " / ".join(f"{b / mib:.1f}" for b in r["bytes_per_rank"])
        out.append(f"| {r['layout']} | {r['engine']} | {r['save_s']:.3f} | {r['load_s']:.3f} | "
                   f"{per_rank} | {r['train_s']:.3f} | {r['lost_sync_s']:.3f} | "
                   f"{r['lost_async_s']:.3f} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
