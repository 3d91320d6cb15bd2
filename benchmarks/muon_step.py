"""Muon's step time against AdamW on the same layout, and the two ways of making a sharded
matrix whole (`meshfit.optim.muon_whole`): an owner rank per matrix, or every rank
gathering every matrix.

One launch on 2 processes runs two layouts through `Accelerator`: ZeRO-3 (``dp_shard=2``,
FSDP2: every matrix ``Shard(0)``) and tensor parallelism (``tp=2``: column-parallel
``Shard(0)`` and row-parallel ``Shard(1)``). On each, three optimizers over the same model
and batch: AdamW (`optim.build("adamw")`, foreach), Muon with ``whole="owner"`` and Muon
with ``whole="gather"`` (`optim.build("muon")`: Muon on the blocks' matrices, AdamW on the
rest). Per variant: the optimizer step alone (``opt.step()``) and the whole training step
(forward + backward + step + zero_grad), the slowest rank's time (all-reduce MAX), median
over the measured steps after warm-up, variants interleaved in rounds so machine drift hits
all of them. Each rank runs one thread. Nothing here asserts.

    meshfit launch --nproc 2 benchmarks/muon_step.py    # results/muon_step.{md,json}
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

from meshfit import Accelerator, ParallelDims, optim  # noqa: E402

LAYOUTS = {"zero3 (dp_shard=2)": {"parallel": ParallelDims(dp_shard=2), "zero_stage": 3},
           "tp=2": {"parallel": ParallelDims(tp=2)}}
VARIANTS = {"adamw": ("adamw", {}), "muon owner": ("muon", {"whole": "owner"}),
            "muon gather": ("muon", {"whole": "gather"})}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps per variant")
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds")
    p.add_argument("--steps-per-round", type=int, default=3)
    p.add_argument("--tag", default="", help="suffix of the results files")
    p.add_argument("--no-write", action="store_true", help="print only; write no results files")
    _common.add_model_args(p, d_model=256, n_layer=4, n_head=8, d_ff=1024, seq_len=64,
                           batch_size=4)
    return p.parse_args(argv)


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


class Variant:
    def __init__(self, acc: Accelerator, cfg, args, name: str, kwargs: dict):
        self.model = acc.prepare(_common.build_model(cfg, args.seed))
        self.opt = optim.build(name, self.model, lr=1e-4, weight_decay=0.1, **kwargs)
        self.acc, self.steps, self.totals = acc, [], []

    def run(self, x, y, measured: bool) -> None:
        t0 = time.perf_counter()
        loss = self.model(x, y)
        self.acc.backward(loss)
        t1 = time.perf_counter()
        self.opt.step()
        t2 = time.perf_counter()
        self.opt.zero_grad()
        t3 = time.perf_counter()
        step, total = _slowest(t2 - t1), _slowest(t3 - t0)
        if measured:
            self.steps.append(step)
            self.totals.append(total)


def _layout(args, cfg, kwargs: dict) -> dict:
    acc = Accelerator(**kwargs)
    dp, dp_rank = acc.runtime.dp_size, acc.runtime.dp_rank
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randint(0, cfg.vocab_size, (args.batch_size * dp, args.seq_len), generator=g)
    y = torch.roll(x, -1, dims=1)
    x, y = x[dp_rank::dp], y[dp_rank::dp]
    variants = {name: Variant(acc, cfg, args, *spec) for name, spec in VARIANTS.items()}
    for v in variants.values():
        for _ in range(args.warmup):
            v.run(x, y, measured=False)
    names = list(variants)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            for _ in range(args.steps_per_round):
                variants[name].run(x, y, measured=True)
    return {name: {"step_ms": statistics.median(v.steps) * 1e3,
                   "train_step_ms": statistics.median(v.totals) * 1e3,
                   "raw_step_s": v.steps, "raw_train_step_s": v.totals}
            for name, v in variants.items()}


def _table(results: dict) -> str:
    lines = ["| layout | optimizer | optimizer step (ms) | vs AdamW | train step (ms) | "
             "vs AdamW |", "|---|---|---:|---:|---:|---:|"]
    for layout, rows in results.items():
        base = rows["adamw"]
        for name, row in rows.items():
            lines.append(f"| {layout} | {name} | {row['step_ms']:.1f} | "
                         f"{row['step_ms'] / base['step_ms']:.2f}x | {row['train_step_ms']:.1f}"
                         f" | {row['train_step_ms'] / base['train_step_ms']:.2f}x |")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    from meshfit import distributed

    env = distributed.init(cpu=True)
    cfg = _common.model_config(args)
    results = {name: _layout(args, cfg, kwargs) for name, kwargs in LAYOUTS.items()}
    if env.rank == 0:
        params = sum(p.numel() for p in _common.build_model(cfg, args.seed).parameters())
        table = _table(results)
        print(table)
        if not args.no_write:
            info = _common.machine_info()
            md = (f"# Muon vs AdamW step time, {params:,} parameters\n\n{table}\n\n"
                  f"{_common.machine_markdown(info)}")
            _common.write_results("muon_step" + args.tag, md,
                                  {"args": vars(args), "machine": info, "results": results})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
