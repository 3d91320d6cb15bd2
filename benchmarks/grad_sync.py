"""Gradient synchronisation under gradient accumulation: four ways to write the loop.

Reproduces the timing table of the gradient-synchronisation guide (Accelerate's "Gradient
synchronization" page) on this machine:
seconds per batch (mean ± std over the measured batches after warm-up) for

* ``baseline``               -- all-reduce on every micro-batch, no sync practice at all;
* ``no_sync_backward_only``  -- ``no_sync`` used wrongly: only ``backward`` inside
  ``ddp_model.no_sync()``, the forward outside. DDP arms its reducer in *forward*
  (``prepare_for_backward`` runs when ``require_backward_grad_sync`` is set), so the backward
  still all-reduces every bucket: this is the baseline in disguise;
* ``no_sync``                -- forward *and* backward inside ``ddp_model.no_sync()`` on the
  k-1 non-boundary micro-batches, plain on the k-th;
* ``accumulate``             -- ``with acc.accumulate(model):`` around every micro-batch.

All-reduces are counted independently of meshfit, by a DDP communication hook that counts
each call (one per gradient bucket) and then runs DDP's default ``allreduce_hook``. The hook
is registered on all four models, so every variant pays the same (tiny) hook cost.

The variants run interleaved in rounds (round r runs each variant for one pass over the same
data, rotating the order), so slow drift of a shared 2-core machine hits all of them.

    meshfit launch --nproc 2 benchmarks/grad_sync.py            # ~1.5-2.5 min on 2 cores

Rank 0 prints a Markdown table and writes benchmarks/results/grad_sync.{md,json}.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch.utils.data import DataLoader, Subset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (AllReduceCounter, add_model_args, build_model,  # noqa: E402
                     device_sync, fused_adamw, gather_floats, launch_command, machine_info,
                     machine_markdown, mean_std, model_config, write_results)

from meshfit import Accelerator  # noqa: E402
from meshfit.data import TokenDataset, load_tokens  # noqa: E402

VARIANTS = ("baseline", "no_sync_backward_only", "no_sync", "accumulate")
HEADERS = {
    "baseline": "Baseline",
    "no_sync_backward_only": "`no_sync` used wrongly (backward only)",
    "no_sync": "`no_sync`",
    "accumulate": "`accumulate`",
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--accum", type=int, default=4, help="gradient accumulation steps k")
    p.add_argument("--batches-per-round", type=int, default=16,
                   help="micro-batches per variant per round (a multiple of --accum)")
    p.add_argument("--rounds", type=int, default=6, help="interleaved rounds")
    p.add_argument("--warmup-batches", type=int, default=8,
                   help="micro-batches of each variant's first round not measured")
    p.add_argument("--no-write", action="store_true", help="print only; write no results files")
    add_model_args(p)
    args = p.parse_args(argv)
    if args.batches_per_round % args.accum:
        p.error(f"--batches-per-round={args.batches_per_round} must be a multiple of "
                f"--accum={args.accum}, so every round ends on an optimizer step")
    if args.warmup_batches % args.accum or args.warmup_batches >= args.batches_per_round:
        p.error("--warmup-batches must be a multiple of --accum and less than "
                "--batches-per-round")
    return args


# ----------------------------------------------------------------------------- the loops
# Each function runs one pass over `loader` (a whole number of accumulation windows) and
# calls `rec()` after every micro-batch, which records its wall-clock duration (loader fetch
# included, as in the seed's per-batch timing) and the all-reduce calls made so far.
# `acc.backward` divides the loss by k in every variant.

class Recorder:
    def __init__(self, counter: AllReduceCounter, device: torch.device):
        self.counter, self.device = counter, device
        self.times: list[float] = []
        self.calls: list[int] = []  # all-reduce calls during each micro-batch
        self.bytes: list[int] = []  # bytes all-reduced during each micro-batch
        self._calls, self._bytes = counter.calls, counter.bytes
        self._t = time.perf_counter()

    def __call__(self) -> None:
        device_sync(self.device)
        now, calls, nbytes = time.perf_counter(), self.counter.calls, self.counter.bytes
        self.times.append(now - self._t)
        self.calls.append(calls - self._calls)
        self.bytes.append(nbytes - self._bytes)
        self._t, self._calls, self._bytes = now, calls, nbytes


def run_baseline(acc, model, opt, loader, k, rec):
    for i, (x, y) in enumerate(loader):
        loss = model(x, y)
        acc.backward(loss)                  # all-reduces every micro-batch
        if (i + 1) % k == 0:
            opt.step()
            opt.zero_grad()
        rec()
    return rec


def run_no_sync_backward_only(acc, model, opt, loader, k, rec):
    for i, (x, y) in enumerate(loader):
        loss = model(x, y)                  # forward OUTSIDE no_sync: the reducer is armed
        if (i + 1) % k != 0:
            with model.no_sync():
                acc.backward(loss)          # ... so this backward still all-reduces
        else:
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
        rec()
    return rec


def run_no_sync(acc, model, opt, loader, k, rec):
    for i, (x, y) in enumerate(loader):
        if (i + 1) % k != 0:
            with model.no_sync():           # forward and backward inside: local accumulation
                loss = model(x, y)
                acc.backward(loss)
        else:
            loss = model(x, y)              # the k-th micro-batch syncs the accumulated sum
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
        rec()
    return rec


def run_accumulate(acc, model, opt, loader, k, rec):
    for x, y in loader:
        with acc.accumulate(model):
            loss = model(x, y)
            acc.backward(loss)
            opt.step()                      # prepared optimizer: acts on the k-th only
            opt.zero_grad()
        rec()
    return rec


LOOPS = {"baseline": run_baseline, "no_sync_backward_only": run_no_sync_backward_only,
         "no_sync": run_no_sync, "accumulate": run_accumulate}


# ----------------------------------------------------------------------------- main
def main(argv=None) -> None:
    args = parse_args(argv)
    k = args.accum
    acc = Accelerator(gradient_accumulation_steps=k)
    if acc.num_processes < 2:
        raise SystemExit("grad_sync.py measures DDP communication: launch it on 2+ processes, "
                         "e.g. `meshfit launch --nproc 2 benchmarks/grad_sync.py`")
    info = machine_info(acc)
    cfg = model_config(args)
    with acc.main_process_first():  # rank 0 builds the token cache, the others read it
        splits = load_tokens()
    world = acc.num_processes
    windows = TokenDataset(splits.train, args.seq_len)
    # Exactly one pass = batches_per_round micro-batches on every rank, so the dataloader's
    # end coincides with an accumulation boundary (accumulate also syncs at the loader end).
    dataset = Subset(windows, range(args.batches_per_round * args.batch_size * world))

    state = {}
    for name in VARIANTS:
        model = build_model(cfg, args.seed)
        opt = fused_adamw(model)
        loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=False)
        model, opt, loader = acc.prepare(model, opt, loader)
        assert len(loader) == args.batches_per_round, (len(loader), args.batches_per_round)
        state[name] = dict(model=model, opt=opt, loader=loader,
                           counter=AllReduceCounter().attach(model), batch=[], step=[], calls=[],
                           bytes=[], wall=0.0)
    n_params = sum(p.numel() for p in acc.unwrap_model(state["baseline"]["model"]).parameters())

    acc.print(f"grad_sync: {world} processes ({info['backend']}), GPT {n_params / 1e6:.2f}M "
              f"params ({n_params * 4 / 2**20:.1f} MiB fp32 gradients), micro-batch "
              f"{args.batch_size}x{args.seq_len} tokens per process, accumulation k={k}, "
              f"{args.rounds} rounds x {args.batches_per_round} micro-batches per variant, "
              f"first {args.warmup_batches} not measured")

    t_start = time.perf_counter()
    for r in range(args.rounds):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
        for name in order:
            s = state[name]
            # Manual variants step the prepared optimizer themselves; it only acts while the
            # accelerator is on a boundary, which every pass ends on.
            assert acc.sync_gradients
            acc.wait_for_everyone()
            t0 = time.perf_counter()
            rec = LOOPS[name](acc, s["model"], s["opt"], s["loader"], k,
                              Recorder(s["counter"], acc.device))
            s["wall"] += time.perf_counter() - t0
            skip = args.warmup_batches if r == 0 else 0
            times = rec.times
            s["batch"] += times[skip:]
            s["step"] += [sum(times[i:i + k]) for i in range(skip, len(times), k)]
            s["calls"] += rec.calls[skip:]
            s["bytes"] += rec.bytes[skip:]
            s["first_step_calls"] = s.get("first_step_calls", sum(rec.calls[:k]))
        acc.print(f"  round {r + 1}/{args.rounds} done ({time.perf_counter() - t_start:.0f} s)")
    acc.wait_for_everyone()

    # ------------------------------------------------------------------ results
    results = {}
    base_params = [p.detach() for p in acc.unwrap_model(state["baseline"]["model"]).parameters()]
    for name in VARIANTS:
        s = state[name]
        n_batches, n_steps = len(s["batch"]), len(s["step"])
        calls = gather_floats([float(sum(s["calls"])), float(sum(s["bytes"]))])
        per_rank_calls = [int(c[0]) for c in calls]  # measured micro-batches only
        # Rank 0's clock; the table's per-batch and per-step numbers are its own.
        bm, bs = mean_std(s["batch"])
        sm, ss = mean_std(s["step"])
        params = [p.detach() for p in acc.unwrap_model(s["model"]).parameters()]
        diff = max((a - b).abs().max().item() for a, b in zip(params, base_params))
        results[name] = dict(
            sec_per_batch_mean=bm, sec_per_batch_std=bs, sec_per_step_mean=sm,
            sec_per_step_std=ss, measured_batches=len(s["batch"]),
            measured_steps=len(s["step"]),
            allreduce_calls_measured=per_rank_calls[0],
            allreduce_calls_measured_per_rank=per_rank_calls,
            allreduce_calls_per_step=per_rank_calls[0] / n_steps,
            allreduce_calls_per_micro_batch=per_rank_calls[0] / n_batches,
            allreduce_calls_by_position_in_window=[
                sum(s["calls"][i::k]) / (n_batches // k) for i in range(k)],
            allreduce_calls_first_step=s["first_step_calls"],
            allreduce_mib_per_step=calls[0][1] / n_steps / 2**20,
            max_abs_param_diff_vs_baseline=diff,
            wall_s_all_rounds=s["wall"], batch_times_s=s["batch"])
    info["loadavg_at_end"] = list(os.getloadavg())

    if acc.is_main_process:
        base = results["baseline"]["sec_per_batch_mean"]
        cmd = launch_command()
        cols = [HEADERS[n] for n in VARIANTS]

        def row(label, fn):
            return f"| {label} | " + " | ".join(fn(results[n]) for n in VARIANTS) + " |"

        table = "\n".join([
            "| | " + " | ".join(cols) + " |",
            "| :--- | " + " | ".join(":---:" for _ in cols) + " |",
            row(f"Single node, {world} CPU processes ({info['backend']}): s / batch",
                lambda r: f"{r['sec_per_batch_mean']:.3f}±{r['sec_per_batch_std']:.3f}s"),
            row(f"s / optimizer step ({k} batches)",
                lambda r: f"{r['sec_per_step_mean']:.3f}±{r['sec_per_step_std']:.3f}s"),
            row("speed vs baseline (s/batch)",
                lambda r: f"{base / r['sec_per_batch_mean']:.2f}x"),
            row("all-reduce calls (buckets) / optimizer step",
                lambda r: f"{r['allreduce_calls_per_step']:g}"),
            row(f"all-reduce calls on micro-batch 1..{k} of a window",
                lambda r: "/".join(f"{c:g}" for c in r["allreduce_calls_by_position_in_window"])),
            row("MiB all-reduced / optimizer step",
                lambda r: f"{r['allreduce_mib_per_step']:.1f}"),
            row("max abs param diff vs baseline (same data, same steps)",
                lambda r: f"{r['max_abs_param_diff_vs_baseline']:.1e}"),
        ])
        buckets = results["no_sync"]["allreduce_calls_per_step"]
        md = f"""# Gradient synchronisation with gradient accumulation (k={k})

Command: `{cmd}`

Model: meshfit reference GPT, {n_params / 1e6:.2f}M parameters ({n_params * 4 / 2**20:.1f} MiB of
fp32 gradients per all-reduced step; d_model={args.d_model}, n_layer={args.n_layer},
n_head={args.n_head}, d_ff={args.d_ff}, byte vocabulary), AdamW(fused=True).
Micro-batch: {args.batch_size} sequences x {args.seq_len} tokens per process, {world} processes,
k={k} micro-batches per optimizer step. Data: Python stdlib bytes (`load_tokens()`),
a prepared `DataLoader` (num_workers=0, no shuffle), the same samples for every variant.
Schedule: {args.rounds} interleaved rounds x {args.batches_per_round} micro-batches per variant
(variant order rotated each round), first {args.warmup_batches} micro-batches of each variant
not measured: {results['baseline']['measured_batches']} measured micro-batches
({results['baseline']['measured_steps']} optimizer steps) per variant. Times are rank 0's
wall clock per micro-batch (loader fetch included), mean ± std, as in the seed's table.

{table}

- One optimizer step's gradients are {buckets:g} DDP bucket(s); `baseline` and the wrong
  `no_sync` send them on every micro-batch ({k}x{buckets:g} calls/step), `no_sync` and
  `accumulate` only on the k-th ({buckets:g} calls/step). Counted by a DDP comm hook
  (`register_comm_hook` + `default_hooks.allreduce_hook`), not by meshfit.
- `no_sync` used wrongly = baseline: DDP decides whether to sync when the *forward* runs, so
  wrapping only `backward` in `no_sync()` changes nothing.
- The std of `no_sync`/`accumulate` is large by construction: k-1 micro-batches are pure
  compute, the k-th also all-reduces and runs the optimizer (the per-step row is steadier).
- The parameter differences are fp32 reduction-order noise amplified by Adam (summing k
  micro-gradients locally then all-reducing vs all-reducing each): all four loops compute the
  same update.

Machine:

{machine_markdown(info)}

Total benchmark time (all variants, all rounds): {time.perf_counter() - t_start:.0f} s.
"""
        print()
        print(md)
        if not args.no_write:
            payload = dict(benchmark="grad_sync", command=cmd, args=vars(args),
                           n_params=n_params, machine=info, results=results,
                           timing_note="rank 0 wall clock per micro-batch; mean/std over "
                                       "measured micro-batches after warm-up")
            md_path, js_path = write_results("grad_sync", md, payload)
            print(f"wrote {md_path} and {js_path}")
    acc.end_training()


if __name__ == "__main__":
    main()
