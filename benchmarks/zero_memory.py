"""Per-rank memory and step time of DDP and ZeRO stages 1/2/3 (± CPU offload), measured.

For the reference GPT at several sizes, each layout trains a few AdamW steps through
`Accelerator(parallel=..., zero_stage=...)`; after a step `meshfit.memory.rank_report`
counts the bytes this rank holds in parameters, gradients and optimizer state (local shards
only) and the table puts them beside the ZeRO paper's formula (`memory.zero_formula`, fp32
AdamW: 4 + 4 + 8 bytes per parameter; FSDP2's stage 2 keeps parameters sharded at rest). From
the measured bytes per parameter it then answers the note's question — with a per-rank
memory cap, what is the largest model each layout can hold? (states + gradients only;
activations come on top and depend on the batch).

    meshfit launch --nproc 2 benchmarks/zero_memory.py
    meshfit launch --nproc 4 benchmarks/zero_memory.py --sizes tiny,small

Nothing here asserts; run on a quiet machine.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

from meshfit import Accelerator, ParallelDims  # noqa: E402
from meshfit.memory import rank_report, zero_formula  # noqa: E402
from meshfit.models import GPT, GPTConfig  # noqa: E402

SIZES = {
    "tiny": dict(),
    "small": dict(d_model=256, n_layer=6, n_head=8, d_ff=1024),
    "medium": dict(d_model=512, n_layer=8, n_head=8, d_ff=2048),
}
LAYOUTS = [  # (name, zero_stage, offload); stage 0 is DDP
    ("DDP", 0, "none"),
    ("ZeRO-1", 1, "none"),
    ("ZeRO-2", 2, "none"),
    ("ZeRO-3", 3, "none"),
    ("ZeRO-3 + CPU offload", 3, "cpu"),
]
PRESETS = ("gpt2", "llama-1b", "llama-7b", "llama-70b")


def run_layout(name, stage, offload, cfg, args, world) -> dict:
    if stage == 0:
        acc = Accelerator(parallel=ParallelDims())
    else:
        acc = Accelerator(parallel=ParallelDims(dp_shard=world, dp_replicate=1),
                          zero_stage=stage, offload=offload)
    torch.manual_seed(args.seed)
    model = acc.prepare(GPT(cfg))
    opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-4))
    g = torch.Generator().manual_seed(args.seed + acc.process_index)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), generator=g)
    tokens = tokens.to(acc.device)
    times = []
    for step in range(args.warmup + args.steps):
        _common.device_sync(acc.device)
        t0 = time.perf_counter()
        loss = model(tokens[:, :-1], tokens[:, 1:])
        acc.backward(loss)
        opt.step()
        if step == args.warmup + args.steps - 1:
            report = rank_report(model, opt)  # gradients still held: the step's working set
        opt.zero_grad()
        _common.device_sync(acc.device)
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    n = cfg.num_params()
    formula = zero_formula(n, world, stage, fsdp2=True)
    out = {"layout": name, "stage": stage, "offload": offload, "params": n,
           "param_bytes": report.param_bytes, "grad_bytes": report.grad_bytes,
           "optimizer_bytes": report.optimizer_bytes, "total_bytes": report.total_bytes,
           "host_bytes": report.host_bytes, "device_bytes": report.device_bytes,
           "formula_total": formula["total"], "formula": formula,
           "step_s": statistics.median(times),
           "tokens_per_s": args.batch_size * args.seq_len * world / statistics.median(times),
           "peak_allocated": report.peak_allocated_bytes}
    del model, opt
    gc.collect()
    dist.barrier()
    return out


def largest_fitting(bytes_per_param: float, cap: float) -> str:
    """The largest meshfit preset whose states + gradients fit under `cap` at this rate."""
    fitting = [p for p in PRESETS if GPTConfig.preset(p).num_params() * bytes_per_param <= cap]
    return fitting[-1] if fitting else "none"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="tiny,small,medium", help=f"from {', '.join(SIZES)}")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cap-gib", type=float, default=80.0,
                   help="per-rank memory cap for the 'largest model that fits' column")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    probe = Accelerator()
    world, main_rank = probe.num_processes, probe.is_main_process
    if world < 2:
        raise SystemExit("run with at least 2 processes: meshfit launch --nproc 2 "
                         "benchmarks/zero_memory.py")
    info = _common.machine_info(probe)
    rows = []
    for size in args.sizes.split(","):
        cfg = GPTConfig.preset("tiny", max_seq_len=args.seq_len, **SIZES[size])
        for name, stage, offload in LAYOUTS:
            try:
                r = run_layout(name, stage, offload, cfg, args, world)
            except (ValueError, RuntimeError) as err:
                r = {"layout": name, "stage": stage, "offload": offload,
                     "error": str(err).splitlines()[0][:160], "params": cfg.num_params()}
            r["size"] = size
            rows.append(r)
            if main_rank and "error" not in r:
                print(f"{size:>7} {name:<22} {r['total_bytes'] / 2**20:8.2f} MiB/rank "
                      f"(formula {r['formula_total'] / 2**20:8.2f})  step {r['step_s']:.3f} s",
                      flush=True)
            elif main_rank:
                print(f"{size:>7} {name:<22} error: {r['error']}", flush=True)
    info["loadavg_at_end"] = list(os.getloadavg())
    if main_rank:
        md = _markdown(rows, args, info, world)
        print(md)
        if not args.no_write:
            paths = _common.write_results(f"zero_memory_{world}ranks", md,
                                          {"machine": info, "args": vars(args), "rows": rows})
            print(f"wrote {paths[0]} and {paths[1]}")
    probe.end_training()


def _markdown(rows, args, info, world) -> str:
    mib = 2**20
    cap = args.cap_gib * 2**30
    out = ["# DDP vs ZeRO 1/2/3: per-rank memory, measured", "",
           f"Command: `{_common.launch_command()}`", "", _common.machine_markdown(info), "",
           f"{world} ranks, fp32 AdamW, {args.batch_size} x {args.seq_len} tokens per rank per "
           f"step; bytes counted by `meshfit.memory.rank_report` after the last step's "
           f"optimizer step (gradients still held); formula: `zero_formula(..., fsdp2=True)` "
           "(4 + 4 + 8 bytes per parameter, sharded as each stage shards; FSDP2's stage 2 "
           "keeps parameters sharded at rest). Step time: median of the measured steps.", ""]
    for size in dict.fromkeys(r["size"] for r in rows):
        n = next(r["params"] for r in rows if r["size"] == size)
        out += [f"## {size} ({n / 1e6:.2f}M parameters)", "",
                "| layout | params MiB | grads MiB | optimizer MiB | total MiB/rank | formula MiB "
                "| measured / formula | host / device MiB | step s |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in (r for r in rows if r["size"] == size):
            if "error" in r:
                out.append(f"| {r['layout']} | — | — | — | — | — | — | — | {r['error']} |")
                continue
            out.append(
                f"| {r['layout']} | {r['param_bytes'] / mib:.2f} | {r['grad_bytes'] / mib:.2f} | "
                f"{r['optimizer_bytes'] / mib:.2f} | {r['total_bytes'] / mib:.2f} | "
                f"{r['formula_total'] / mib:.2f} | {r['total_bytes'] / r['formula_total']:.3f} | "
                f"{r['host_bytes'] / mib:.2f} / {r['device_bytes'] / mib:.2f} | "
                f"{r['step_s']:.3f} |")
        out.append("")
    # The note's point: with a per-rank cap, DDP runs out where sharding still fits.
    biggest = max(dict.fromkeys(r["size"] for r in rows), key=lambda s: next(
        r["params"] for r in rows if r["size"] == s))
    out += [f"## Largest preset whose parameters + gradients + AdamW state fit {args.cap_gib:g} "
            f"GiB per rank on {world} ranks", "",
            f"Bytes per parameter per rank measured on `{biggest}` (activations not included).",
            "", "| layout | bytes/param/rank (device) | largest preset that fits |",
            "|---|---:|---|"]
    on_gpu = str(info.get("device", "cpu")).startswith("cuda")
    for r in (r for r in rows if r["size"] == biggest and "error" not in r):
        # On a GPU the cap is device memory (offloaded bytes live on the host); on a CPU run
        # everything is host memory, so offload cannot help there.
        per_param = (r["device_bytes"] if on_gpu else r["total_bytes"]) / r["params"]
        out.append(f"| {r['layout']} | {per_param:.2f} | {largest_fitting(per_param, cap)} |")
    out += ["", "Presets by size: " + ", ".join(
        f"{p} {GPTConfig.preset(p).num_params() / 1e9:.2f}B" for p in PRESETS) + "."]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
