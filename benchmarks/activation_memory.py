"""Activation memory and step time of each checkpointing choice on one model: none,
selective, full, activation offload (alone and with full), and memory-budget checkpointing
under torch.compile at three budgets beside the compiled run without one.

For each choice the reference GPT (``GPTConfig.preset("tiny")`` with the flags' sizes) trains
a few AdamW steps through `Accelerator` on the same batches, and the script reports:

* step time: the median of the measured steps (after warm-up, which includes compilation);
* peak memory of one training step above what was allocated before it: on CUDA the caching
  allocator's peak (``max_memory_allocated``); on a CPU the profiler's memory counts over one
  forward + backward, each op's own allocations minus frees summed in time order (the running
  maximum, at op granularity), which sees everything allocated, compiled graphs included;
* what the forward keeps for the backward (``kept``): the bytes still held when the forward
  ends (allocations minus frees);
* what activation offload moved to host memory (the offloader's counts) and so what the GPU
  would keep (``on device``); on a CPU the device is the host, so offloading frees nothing
  there: the copies stay in the same memory, and the column says what a GPU would be spared;
* the estimate's activations on the device and on the host (`meshfit.memory.estimate`).

    python benchmarks/activation_memory.py                # CPU, inductor (a C++ compiler)
    python benchmarks/activation_memory.py --backend aot_eager_decomp_partition  # no codegen

Results: benchmarks/results/activation_memory.md/.json. Nothing here is a test.
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
from meshfit.memory import LayoutSpec, ModelShape  # noqa: E402
from meshfit.memory.estimate import estimate  # noqa: E402
from meshfit.parallel.activation_offload import offloader_of  # noqa: E402

MiB = 2**20
BUDGETS = (0.8, 0.5, 0.2)


def _choices(backend: str) -> list[tuple[str, dict]]:
    compiled = dict(compile=True, compile_backend=backend)
    return [("none", {}),
            ("selective", dict(activation_checkpointing="selective")),
            ("full", dict(activation_checkpointing="full")),
            ("offload", dict(activation_offload=True)),
            ("full + offload", dict(activation_checkpointing="full", activation_offload=True)),
            ("compiled, no budget", compiled),
            *((f"budget {b}", dict(activation_checkpointing="budget",
                                   activation_checkpointing_budget=b, **compiled))
              for b in BUDGETS)]


def _running(prof) -> tuple[int, int]:
    """(the running maximum, the final total) of a profile's memory counts: each op's own
    allocations minus frees (frees outside any op are "[memory]" events), in time order."""
    held = peak = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        held += e.self_cpu_memory_usage
        peak = max(peak, held)
    return peak, held


def _cpu_peak(model, x, y) -> tuple[int, int]:
    """(peak above the start over forward + backward, bytes held when the forward ends): the
    forward and the backward profiled apart (a frame around the forward would take the
    frees inside it as its own, at no time)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as forward:
        loss = model(x, y)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as backward:
        loss.backward()
    forward_peak, kept = _running(forward)
    backward_peak, _ = _running(backward)
    return max(forward_peak, kept + backward_peak), kept


def _measure(name: str, options: dict, args, cfg, data) -> dict:
    torch.compiler.reset()
    acc = Accelerator(cpu=args.device == "cpu", **options)
    model = acc.prepare(_common.build_model(cfg, args.seed))
    opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-4))
    device, times = acc.device, []
    for step, (x, y) in enumerate(data):
        x, y = x.to(device), y.to(device)
        _common.device_sync(device)
        start = time.perf_counter()
        acc.backward(model(x, y))
        opt.step()
        opt.zero_grad(set_to_none=True)
        _common.device_sync(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    x, y = (t.to(device) for t in data[0])
    offloader = offloader_of(model)
    before = offloader.stats["bytes"] if offloader else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        loss = model(x, y)
        kept = torch.cuda.memory_allocated(device) - base
        loss.backward()
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        peak, kept = _cpu_peak(model, x, y)
    moved = (offloader.stats["bytes"] - before) if offloader else 0
    opt.zero_grad(set_to_none=True)
    spec = LayoutSpec(micro_batch_size=args.batch_size,
                      activation_checkpointing=options.get("activation_checkpointing", "none"),
                      activation_checkpointing_budget=options.get(
                          "activation_checkpointing_budget", 0.5),
                      activation_offload=options.get("activation_offload", False))
    est = estimate(ModelShape.from_module(acc.unwrap_model(model)), spec, seq_len=args.seq_len)
    out = {"choice": name, "step_s": statistics.median(times), "peak_bytes": peak,
           "kept_bytes": kept, "offloaded_bytes": moved, "device_kept_bytes": kept - moved,
           "estimate_activations": est.activations,
           "estimate_host": est.detail["activations_on_host"]}
    del model, opt, acc
    gc.collect()
    return out


def _markdown(rows: list[dict], info: dict, args) -> str:
    lines = ["# Activation memory per checkpointing choice", "",
             f"Model: tiny GPT, d_model {args.d_model}, {args.n_layer} blocks, d_ff {args.d_ff}; "
             f"micro-batch {args.batch_size} x {args.seq_len} tokens, fp32, AdamW; compile "
             f"backend {args.backend}; median of {args.steps - args.warmup} steps.", "",
             _common.machine_markdown(info), "",
             "| choice | step (ms) | peak (MiB) | kept for backward (MiB) | offloaded (MiB) | "
             "kept on the device (MiB) | estimate: device / host (MiB) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['choice']} | {r['step_s'] * 1e3:.1f} | {r['peak_bytes'] / MiB:.1f} "
                     f"| {r['kept_bytes'] / MiB:.1f} | {r['offloaded_bytes'] / MiB:.1f} | "
                     f"{r['device_kept_bytes'] / MiB:.1f} | "
                     f"{r['estimate_activations'] / MiB:.1f} / {r['estimate_host'] / MiB:.1f} |")
    lines += ["", "Peak: above what was allocated before the step (CUDA allocator peak, or the "
              "CPU profiler's memory events in time order). On a CPU the offloaded copies stay "
              "in the same memory: 'kept on the device' is what a GPU would keep."]
    load = os.getloadavg()[0]
    if load > (os.cpu_count() or 1):
        lines += ["", f"The machine was busy (load average {load:.1f} on {os.cpu_count()} "
                  "cores at the end): the step times are not comparable with each other; "
                  "the memory figures do not depend on it."]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _common.add_model_args(p, d_model=256, n_layer=4, n_head=4, d_ff=1024, seq_len=256,
                           batch_size=4)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--only", default="", help="comma-separated choices (default: all)")
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    cfg = _common.model_config(args)
    tokens = torch.randint(0, cfg.vocab_size, (args.steps, args.batch_size, args.seq_len + 1))
    data = [(t[:, :-1], t[:, 1:]) for t in tokens]
    wanted = set(filter(None, args.only.split(",")))
    rows = []
    for name, options in _choices(args.backend):
        if wanted and name not in wanted:
            continue
        rows.append(_measure(name, options, args, cfg, data))
        r = rows[-1]
        print(f"{name:>20}: {r['step_s'] * 1e3:8.1f} ms  peak {r['peak_bytes'] / MiB:7.1f} MiB  "
              f"kept {r['kept_bytes'] / MiB:7.1f} MiB  offloaded "
              f"{r['offloaded_bytes'] / MiB:6.1f} MiB  estimate "
              f"{r['estimate_activations'] / MiB:6.1f} / {r['estimate_host'] / MiB:6.1f} MiB",
              flush=True)
    info = _common.machine_info()
    name = "activation_memory" if args.device == "cpu" else f"activation_memory_{args.device}"
    md, js = _common.write_results(name, _markdown(rows, info, args),
                                   {"args": vars(args), "machine": info, "rows": rows})
    print(f"wrote {md} and {js}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
