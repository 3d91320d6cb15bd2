"""The guide's memory table, measured: peak memory and step time per optimizer x activation
checkpointing mode, with meshfit's estimate beside each cell.

The single-GPU guide says in prose what each optimizer and each checkpointing mode saves;
this script measures it on one model and one layout (one process): the reference GPT
(`--size`, default "small": d_model 256, 6 blocks, d_ff 1024, vocabulary 256, fp32
weights), `--batch` sequences of `--seq-len` tokens, through `meshfit.Accelerator` as a user
drives it. Rows: the optimizers (`meshfit.optim.build` names: AdamW fp32 state, AdamW with
bf16 moments, 8-bit and 4-bit AdamW, Adafactor, Muon); columns: activation checkpointing
none / selective / full / budget (min-cut recomputation under torch.compile, at
`--budget`) / offload (saved activations in host memory). A combination this build cannot
run is shown with its one-line reason, not left out.

Per cell, after `--warmup` steps:

* **peak**: on CUDA the caching allocator's peak over the measured steps
  (`max_memory_allocated`); on a CPU, which keeps no allocator statistics, the bytes held
  by the model states at rest (`meshfit.memory.rank_report`: parameters, gradients,
  optimizer state) plus the largest net allocation during one step's forward, backward and
  optimizer step (`meshfit.memory.report.net_peak_bytes`, the profiler's allocation and
  free events in time order). Under "offload" on a CPU the offloaded activations stay in
  the same memory (host and device are one), so the figure shows what the device would
  keep only on CUDA; the estimate's device/host split is printed beside it.
* **step**: the median wall time of the measured optimizer steps.
* **estimate**: `meshfit.memory.estimate` for the same model, layout, micro-batch,
  checkpointing mode and optimizer (device bytes; host bytes where it moves some there).

    python benchmarks/memory_table.py                # CPU, the small GPT
    python benchmarks/memory_table.py --size tiny --steps 3 --only adamw

Printed and saved (benchmarks/results/memory_table_<cpu|cuda>.{md,json}). Nothing here
asserts; run on a quiet machine.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

from meshfit import Accelerator  # noqa: E402
from meshfit import optim as moptim  # noqa: E402
from meshfit.memory import rank_report  # noqa: E402
from meshfit.memory.report import net_peak_bytes  # noqa: E402
from meshfit.models import GPT, GPTConfig  # noqa: E402

SIZES = {"tiny": dict(), "small": dict(d_model=256, n_layer=6, n_head=8, d_ff=1024)}
OPTIMIZERS = ("adamw", "adamw_bf16_states", "adamw_8bit", "adamw_4bit", "adafactor", "muon")
MODES = ("none", "selective", "full", "budget", "offload")
_MIB = 2**20


def accelerator_options(mode: str, budget: float) -> dict:
    """The `Accelerator` arguments of checkpointing mode `mode`."""
    if mode == "budget":
        return dict(activation_checkpointing="budget", activation_checkpointing_budget=budget,
                    compile=True)
    if mode == "offload":
        return dict(activation_offload=True)
    return dict(activation_checkpointing=mode)


def layout_for(mode: str, micro_batch: int, budget: float):
    """The estimator's `LayoutSpec` of one process running `mode`."""
    from meshfit.parallel.spec import LayoutSpec

    extra = {}
    if mode == "budget":
        extra = dict(activation_checkpointing="budget", activation_checkpointing_budget=budget)
    elif mode == "offload":
        extra = dict(activation_offload=True)
    else:
        extra = dict(activation_checkpointing=mode)
    return LayoutSpec(dp_replicate=1, dp_shard=1, micro_batch_size=micro_batch, **extra)


def estimated(model, mode: str, optimizer: str, args) -> dict:
    from meshfit.memory import estimate
    from meshfit.memory.shape import ModelShape

    try:
        est = estimate(ModelShape.from_module(model), layout_for(mode, args.batch, args.budget),
                       seq_len=args.seq_len, optimizer=optimizer)
    except (ValueError, TypeError) as err:
        return {"estimate_error": str(err).splitlines()[0][:160]}
    return {"estimate_bytes": est.total, "estimate_host_bytes": est.host}


def run_cell(optimizer: str, mode: str, cfg: GPTConfig, data: torch.Tensor, args,
             device: torch.device) -> dict:
    """Train one cell for warm-up + measured steps; its figures."""
    acc = Accelerator(cpu=device.type == "cpu", **accelerator_options(mode, args.budget))
    torch.manual_seed(args.seed)
    with device:
        model = GPT(cfg)
    out = estimated(model, mode, optimizer, args)
    model = acc.prepare(model)
    opt = acc.prepare(moptim.build(optimizer, model, lr=args.lr, weight_decay=0.1))
    cuda = device.type == "cuda"

    def step(i: int) -> float:
        batch = data[i % data.shape[0]]
        loss = model(batch[:, :-1], batch[:, 1:])
        acc.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=False)  # gradients kept: part of what a step holds
        return loss.item()

    times, losses = [], []
    for i in range(args.warmup + args.steps):
        if cuda and i == args.warmup:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        _common.device_sync(device)
        t0 = time.perf_counter()
        losses.append(step(i))
        _common.device_sync(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    states = rank_report(acc.unwrap_model(model), opt)
    if cuda:
        peak, source = torch.cuda.max_memory_allocated(device), "CUDA allocator peak"
    else:
        peak = states.total_bytes + net_peak_bytes(lambda: step(0))
        source = "model states at rest + the step's largest net allocation"
    out.update(optimizer=optimizer, mode=mode, step_s=statistics.median(times),
               peak_bytes=peak, memory_source=source, final_loss=losses[-1],
               state_bytes=states.optimizer_bytes,
               state_bytes_per_param=states.optimizer_bytes / max(1, cfg.num_params()))
    del model, opt, acc
    gc.collect()
    torch._dynamo.reset()
    return out


def _cell_text(r: dict) -> str:
    if "error" in r:
        return f"n/a: {r['error']}"
    text = f"{r['peak_bytes'] / _MIB:.1f} MiB, {r['step_s'] * 1e3:.0f} ms"
    if "estimate_bytes" in r:
        text += f" (est. {r['estimate_bytes'] / _MIB:.1f}"
        if r.get("estimate_host_bytes"):
            text += f" + host {r['estimate_host_bytes'] / _MIB:.1f}"
        text += ")"
    return text


def markdown(rows: list[dict], args, info: dict) -> str:
    modes = [m for m in MODES if any(r["mode"] == m for r in rows)]
    lines = [f"# Peak memory and step time: optimizer x activation checkpointing "
             f"({info['device']})", "",
             f"Reference GPT `{args.size}` ({rows[0].get('params', 0) / 1e6:.2f}M parameters), "
             f"one process, {args.batch} x {args.seq_len} tokens per step, fp32 weights; median "
             f"of {args.steps} steps after {args.warmup}; budget = {args.budget}. Each cell: "
             "measured peak, step time (meshfit's estimate of the peak).", "",
             "| optimizer | " + " | ".join(modes) + " |",
             "|---|" + "---|" * len(modes)]
    for opt in dict.fromkeys(r["optimizer"] for r in rows):
        cells = {r["mode"]: _cell_text(r) for r in rows if r["optimizer"] == opt}
        lines.append(f"| {opt} | " + " | ".join(cells.get(m, "") for m in modes) + " |")
    lines += ["", f"Peak: {rows[0].get('memory_source', '')}.", "",
              _common.machine_markdown(info)]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="small", choices=sorted(SIZES))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--budget", type=float, default=0.5)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default="", help="comma-separated optimizers (default: all)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    device = torch.device("cuda", 0) if torch.cuda.is_available() and \
        os.environ.get("MESHFIT_CPU") != "1" else torch.device("cpu")
    cfg = GPTConfig.preset("tiny", max_seq_len=args.seq_len, **SIZES[args.size])
    g = torch.Generator().manual_seed(args.seed)
    data = torch.randint(0, cfg.vocab_size, (4, args.batch, args.seq_len + 1),
                         generator=g).to(device)
    info = _common.machine_info()
    info["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows = []
    for optimizer in (args.only.split(",") if args.only else OPTIMIZERS):
        for mode in args.modes.split(","):
            try:
                r = run_cell(optimizer, mode, cfg, data, args, device)
            except (ValueError, RuntimeError, TypeError, ImportError) as err:
                r = {"optimizer": optimizer, "mode": mode,
                     "error": str(err).strip().splitlines()[0][:160]}
            r["params"] = cfg.num_params()
            rows.append(r)
            print(f"{optimizer:18s} {mode:9s} {_cell_text(r)}", flush=True)
    info["loadavg_at_end"] = list(os.getloadavg())
    md = markdown(rows, args, info)
    print(md)
    if not args.no_write:
        name = f"memory_table_{device.type}"
        paths = _common.write_results(name, md, {"rows": rows, "machine": info,
                                                 "args": vars(args)})
        print(f"wrote {', '.join(str(q) for q in paths)}")


if __name__ == "__main__":
    main()
