"""A model larger than this machine's memory, trained with its optimizer state on disk
(``offload="disk"``, `meshfit.parallel.disk`), against the disk's own speed.

One process on the CPU: the reference GPT at about 2.2B parameters (fp32: weights, gradients
and AdamW's two moments take 16 B per parameter, 35 GB, where the machine has 24 GB) trains
`--steps` AdamW steps on short sequences with the state streamed from `--dir`. Printed and
saved: the loss per step, the peak resident memory (``ru_maxrss``), the bytes on disk, each
step's time and its optimizer step's, the bytes each step read and wrote, and the disk's
sequential write and read bandwidth measured on the same folder first (a file of
`--probe-gib` written with fsync, then read back with its pages dropped from the page cache
first). The goal: the optimizer step within 1.3x of (bytes read + bytes
written) / bandwidth, i.e. the I/O is the step's only cost. Beside it, `meshfit.memory.
estimate` of the same layout.

    python benchmarks/disk_offload.py --dir /path/on/local/disk
    python benchmarks/disk_offload.py --d-model 1024 --n-layer 8     # a quick, small run

Nothing here asserts; run on a quiet machine with the free memory and disk it needs.
"""

from __future__ import annotations

import argparse
import gc
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

from meshfit import Accelerator  # noqa: E402
from meshfit.memory import LayoutSpec, ModelShape, estimate  # noqa: E402
from meshfit.models import GPT, GPTConfig  # noqa: E402
from meshfit.parallel.disk import disk_bandwidth  # noqa: E402

GiB = 2**30


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default="/tmp/meshfit-disk-offload-bench")
    p.add_argument("--d-model", type=int, default=2560)
    p.add_argument("--n-layer", type=int, default=28)
    p.add_argument("--n-head", type=int, default=20)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--probe-gib", type=float, default=2.0)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    write_bw, read_bw = disk_bandwidth(folder, int(args.probe_gib * GiB))
    print(f"disk: sequential write {write_bw / 2**20:.0f} MiB/s, read {read_bw / 2**20:.0f} "
          "MiB/s", flush=True)
    cfg = GPTConfig.preset("tiny", d_model=args.d_model, n_layer=args.n_layer,
                           n_head=args.n_head, d_ff=4 * args.d_model, max_seq_len=args.seq_len,
                           dropout=0.0)
    with torch.device("meta"):
        shape = ModelShape.from_module(GPT(cfg))
    est = estimate(shape, LayoutSpec(offload="disk"), seq_len=args.seq_len, dtype="fp32")
    full = estimate(shape, LayoutSpec(), seq_len=args.seq_len, dtype="fp32")
    print(f"model: {shape.params / 1e9:.2f}B parameters; estimate in memory "
          f"{est.total / GiB:.1f} GiB with the state on disk ({est.disk / GiB:.1f} GiB there), "
          f"{full.total / GiB:.1f} GiB without", flush=True)
    acc = Accelerator(mixed_precision="no", offload="disk", offload_dir=str(folder / "state"))
    t0 = time.perf_counter()
    torch.manual_seed(0)
    model = acc.prepare(GPT(cfg))
    built = time.perf_counter() - t0
    opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=args.lr))
    disk = opt.optimizer
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (1, args.seq_len + 1), generator=g)
    rows = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        loss = model(x[:, :-1], x[:, 1:])
        acc.backward(loss)
        t1 = time.perf_counter()
        read0, written0 = disk.bytes_read, disk.bytes_written
        seconds0 = dict(disk.seconds)
        opt.step()
        disk.flush()  # this step's writes, counted in its time
        t2 = time.perf_counter()
        opt.zero_grad()
        read, written = disk.bytes_read - read0, disk.bytes_written - written0
        took = {k: disk.seconds[k] - seconds0[k] for k in seconds0}
        io_busy = took["reading"] + took["writing"]
        hidden = max(0.0, 1 - took["waiting"] / io_busy) if io_busy else None
        io_bound = read / read_bw + written / write_bw
        rows.append({"step": step + 1, "loss": loss.item(), "forward_backward_s": t1 - t0,
                     "optimizer_s": t2 - t1, "read_bytes": read, "written_bytes": written,
                     "io_bound_s": io_bound,
                     "optimizer_over_io_bound": (t2 - t1) / io_bound if io_bound else None,
                     "seconds": took, "io_hidden_share": hidden})
        print(f"step {step + 1}: loss {loss.item():.4f}, forward+backward {t1 - t0:.1f} s, "
              f"optimizer {t2 - t1:.1f} s (read {read / GiB:.1f} GiB, wrote "
              f"{written / GiB:.1f} GiB; I/O bound {io_bound:.1f} s; update "
              f"{took['updating']:.1f} s, waited {took['waiting']:.1f} s of the threads' "
              f"{io_busy:.1f} s of I/O)", flush=True)
    on_disk = sum(f.stat().st_size for f in (folder / "state").rglob("*.bin"))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    info = _common.machine_info(acc)
    acc.free_memory()
    del model, opt, disk
    gc.collect()
    lines = ["# Optimizer state on disk: a model larger than memory", "",
             f"Reference GPT, {shape.params / 1e9:.2f}B parameters (d_model {args.d_model}, "
             f"{args.n_layer} blocks), fp32, AdamW (lr {args.lr}) on one batch, one process, "
             f"sequence {args.seq_len}; built "
             f"in {built:.0f} s. Full training state without offload: "
             f"{shape.params * 16 / GiB:.1f} GiB (weights, gradients, two moments).", "",
             f"- disk (the offload folder's): sequential write {write_bw / 2**20:.0f} MiB/s, "
             f"read {read_bw / 2**20:.0f} MiB/s (fsync'd write; the read with the file's pages "
             "dropped from the page cache first)",
             f"- peak resident memory: {peak / GiB:.1f} GiB; state on disk: "
             f"{on_disk / GiB:.1f} GiB",
             f"- `meshfit.memory.estimate`: {est.total / GiB:.1f} GiB in memory with the state "
             f"on disk ({est.disk / GiB:.1f} GiB there); {full.total / GiB:.1f} GiB without", "",
             "| step | loss | forward+backward | optimizer step | read | written | "
             "(read/rbw + written/wbw) | optimizer / that | update | I/O (threads) | "
             "I/O hidden |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio, hidden, took = r["optimizer_over_io_bound"], r["io_hidden_share"], r["seconds"]
        lines.append(
            f"| {r['step']} | {r['loss']:.4f} | {r['forward_backward_s']:.1f} s | "
            f"{r['optimizer_s']:.1f} s | {r['read_bytes'] / GiB:.1f} GiB | "
            f"{r['written_bytes'] / GiB:.1f} GiB | {r['io_bound_s']:.1f} s | "
            f"{f'{ratio:.2f}' if ratio else '-'} | {took['updating']:.1f} s | "
            f"{took['reading'] + took['writing']:.1f} s | "
            f"{f'{hidden:.0%}' if hidden is not None else '-'} |")
    lines += ["", _common.machine_markdown(info)]
    md = "\n".join(lines)
    print(md)
    if not args.no_write:
        paths = _common.write_results("disk_offload", md, {
            "args": vars(args), "rows": rows, "peak_rss_bytes": peak, "disk_bytes": on_disk,
            "write_bw": write_bw, "read_bw": read_bw, "estimate_bytes": est.total,
            "estimate_disk_bytes": est.disk, "machine": info})
        print(f"wrote {', '.join(str(p) for p in paths)}")


if __name__ == "__main__":
    main()
