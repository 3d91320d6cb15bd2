"""Ring attention (`meshfit.parallel.cp`) against one process's attention, forward + backward.

For each sequence length, causal attention over one sequence (batch 1, `--heads` query heads
on `--kv-heads` key/value heads of `--head-dim`): the median time of SDPA on the whole
sequence in one process (rank 0, the others waiting), then the ring over every process with
each block on torch's fused CPU kernel and as matmuls, load-balanced and contiguous. A
ring's time is the slowest rank's (the step waits for it); the tokens each rank holds are
T / world. The figures say what the ring costs beyond the attention itself (its messages,
the merge) and what the load balancing and the kernel buy.

    meshfit launch --nproc 2 benchmarks/context_parallel.py
    meshfit launch --nproc 2 benchmarks/context_parallel.py --seq-lens 4096,16384

Nothing here asserts; run on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

from meshfit import Accelerator  # noqa: E402
from meshfit.parallel import cp as ring  # noqa: E402


def _inputs(T: int, args, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, args.heads, T, args.head_dim, generator=g)
    k = torch.randn(1, args.kv_heads, T, args.head_dim, generator=g)
    v = torch.randn(1, args.kv_heads, T, args.head_dim, generator=g)
    return q, k, v


def _timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()  # the slowest rank's time
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def sdpa_step(q, k, v):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1),
                                         v.repeat_interleave(groups, 1), is_causal=True)
    out.sum().backward()


def ring_step(q, k, v, balanced: bool):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = ring.ring_attention(q, k, v, dist.group.WORLD, balanced=balanced)
    out.sum().backward()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-lens", default="2048,4096,8192")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    acc = Accelerator()
    world, rank = acc.num_processes, acc.process_index
    if world < 2:
        raise SystemExit("run with at least 2 processes: meshfit launch --nproc 2 "
                         "benchmarks/context_parallel.py")
    info = _common.machine_info(acc)
    rows = []
    real_kernel = ring._kernel
    for T in (int(x) for x in args.seq_lens.split(",")):
        q, k, v = _inputs(T, args)
        whole = _timed(lambda: sdpa_step(q, k, v) if rank == 0 else None, args.repeats)
        row = {"seq_len": T, "sdpa_one_process_s": whole}
        for balanced in (True, False):
            parts = [ring.shard_sequence(t, 2, world, rank, balanced) for t in (q, k, v)]
            for kernel in (True, False):
                ring._kernel = real_kernel if kernel else (lambda t: None)
                name = f"ring_{'balanced' if balanced else 'contiguous'}_" \
                       f"{'kernel' if kernel else 'matmul'}_s"
                row[name] = _timed(lambda: ring_step(*parts, balanced), args.repeats)
        ring._kernel = real_kernel
        rows.append(row)
        if rank == 0:
            print(f"T={T}: one process {whole * 1e3:.0f} ms; ring on {world}: " + ", ".join(
                f"{k[5:-2]} {v * 1e3:.0f} ms" for k, v in row.items() if k.startswith("ring")),
                flush=True)
    info["loadavg_at_end"] = list(os.getloadavg())
    if rank == 0:
        lines = [f"# Ring attention on {world} processes vs one process, forward + backward", "",
                 f"Causal attention, batch 1, {args.heads} query heads on {args.kv_heads} kv "
                 f"heads of {args.head_dim}; fp32; medians of {args.repeats}; a ring's time is "
                 "its slowest rank's.", "",
                 "| T | SDPA, one process | ring balanced, kernel | ring balanced, matmul | "
                 "ring contiguous, kernel | ring contiguous, matmul | one process / ring "
                 "(balanced, kernel) |",
                 "|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(
                f"| {r['seq_len']} | {r['sdpa_one_process_s'] * 1e3:.0f} ms | "
                f"{r['ring_balanced_kernel_s'] * 1e3:.0f} ms | "
                f"{r['ring_balanced_matmul_s'] * 1e3:.0f} ms | "
                f"{r['ring_contiguous_kernel_s'] * 1e3:.0f} ms | "
                f"{r['ring_contiguous_matmul_s'] * 1e3:.0f} ms | "
                f"{r['sdpa_one_process_s'] / r['ring_balanced_kernel_s']:.2f} |")
        lines += ["", _common.machine_markdown(info)]
        md = "\n".join(lines)
        print(md)
        if not args.no_write:
            paths = _common.write_results(f"context_parallel_{world}ranks", md,
                                          {"args": vars(args), "rows": rows, "machine": info})
            print(f"wrote {', '.join(str(p) for p in paths)}")


if __name__ == "__main__":
    main()
