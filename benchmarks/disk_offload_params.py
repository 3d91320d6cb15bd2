"""ZeRO-3 with the parameter shards on disk too (``offload="disk"`` + ``offload_params``):
what stays in memory, against the estimate, and what it costs.

Two processes on the CPU (gloo), ZeRO-3 over both, the reference GPT (default about 1.1B
parameters, fp32, AdamW) on short sequences. Three arms, one after the other in the same
processes, each from the same seed on the same batches:

- ``memory``: plain ZeRO-3, every state in memory;
- ``state``: the optimizer state on disk (`meshfit.parallel.disk.DiskOffload`);
- ``state+params``: the parameter shards (the fp32 master weights) in memory-mapped files
  too (`meshfit.parallel.disk.ParameterFiles`).

Printed and saved per arm: the losses (the same in every arm), the median step time, and per
rank the peak anonymous memory during the steps (``RssAnon`` of /proc/self/status, sampled
every 20 ms, less its value before the arm's model was built) beside `meshfit.memory.
estimate`'s bytes in memory (device + host: one machine here), the peak of the file pages
mapped (``RssFile``, less its value before: the parameter files' pages, which the kernel
can drop), and the rank's bytes on disk.

    meshfit launch --nproc 2 benchmarks/disk_offload_params.py --dir /path/on/local/disk
    meshfit launch --nproc 2 benchmarks/disk_offload_params.py --d-model 512 --n-layer 4

Nothing here asserts; run on a quiet machine with the free memory and disk it needs.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

from meshfit import Accelerator, ParallelDims  # noqa: E402
from meshfit.memory import LayoutSpec, ModelShape, estimate  # noqa: E402
from meshfit.models import GPT, GPTConfig  # noqa: E402

GiB = 2**30
ARMS = {"memory": {}, "state": {"offload": "disk"},
        "state+params": {"offload": "disk", "offload_params": True}}


def _status(field: str) -> int:
    """A /proc/self/status field in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


class Peak:
    """The peak of RssAnon and RssFile, sampled by a thread while it runs."""

    def __init__(self, every: float = 0.02):
        self.every, self.anon, self.file = every, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.anon = max(self.anon, _status("RssAnon"))
            self.file = max(self.file, _status("RssFile"))
            self._stop.wait(self.every)

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def run_arm(name: str, cfg: GPTConfig, args, x: torch.Tensor) -> dict:
    folder = Path(args.dir) / name.replace("+", "-")
    gc.collect()
    anon0, file0 = _status("RssAnon"), _status("RssFile")  # before this arm's model
    extra = dict(ARMS[name])
    if "offload" in extra:
        extra["offload_dir"] = str(folder)
    acc = Accelerator(parallel=ParallelDims(dp_replicate=1, dp_shard=2), zero_stage=3,
                      mixed_precision="no", **extra)
    torch.manual_seed(0)
    model = acc.prepare(GPT(cfg))
    opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=args.lr))
    gc.collect()
    rank, world = acc.process_index, acc.num_processes
    rows = x.shape[0] // world
    losses, times = [], []
    with Peak() as peak:
        for step in range(args.steps):
            t0 = time.perf_counter()
            batch = x[rank * rows:(rank + 1) * rows]
            loss = model(batch[:, :-1], batch[:, 1:])
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            flush = getattr(getattr(opt, "optimizer", None), "flush", None)
            if callable(flush):
                flush()  # (this step's writes, in its time)
            times.append(time.perf_counter() - t0)
            losses.append(acc.reduce(loss.detach(), "mean").item())
            if rank == 0:
                print(f"{name} step {step + 1}: loss {losses[-1]:.4f}, {times[-1]:.1f} s",
                      flush=True)
    on_disk = sum(f.stat().st_size for sub in folder.glob(f"rank-{rank}*")
                  for f in sub.glob("*.bin")) if folder.exists() else 0
    peaks = torch.tensor([peak.anon - anon0, peak.file - file0, on_disk], dtype=torch.float64)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    acc.free_memory()
    del model, opt
    gc.collect()
    return {"losses": losses, "step_s": times, "median_step_s": statistics.median(times[1:]
                                                                               or times),
            "peak_anon_bytes": peaks[0].item(), "peak_file_bytes": peaks[1].item(),
            "disk_bytes_per_rank": peaks[2].item()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default="/tmp/meshfit-disk-offload-params-bench")
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--n-layer", type=int, default=20)
    p.add_argument("--n-head", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch", type=int, default=2, help="sequences per step (all ranks)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    cfg = GPTConfig.preset("tiny", d_model=args.d_model, n_layer=args.n_layer,
                           n_head=args.n_head, d_ff=4 * args.d_model, max_seq_len=args.seq_len,
                           dropout=0.0)
    with torch.device("meta"):
        shape = ModelShape.from_module(GPT(cfg))
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1), generator=g)
    results = {}
    for name in args.arms.split(","):
        results[name] = run_arm(name, cfg, args, x)
        spec = LayoutSpec(dp_replicate=1, dp_shard=2, zero_stage=3, **{
            k: v for k, v in ARMS[name].items()}, micro_batch_size=args.batch // 2)
        est = estimate(shape, spec, seq_len=args.seq_len, dtype="fp32")
        results[name]["estimate_memory_bytes"] = est.total + est.host
        results[name]["estimate_disk_bytes"] = est.disk
    info = _common.machine_info()
    if dist.get_rank() != 0:
        return
    lines = ["# ZeRO-3 with the parameter shards on disk too", "",
             f"Reference GPT, {shape.params / 1e9:.2f}B parameters (d_model {args.d_model}, "
             f"{args.n_layer} blocks), fp32, AdamW, ZeRO-3 over 2 processes (gloo), "
             f"{args.batch} sequences of {args.seq_len} per step, {args.steps} steps per arm. "
             "Memory per rank (the larger of the two): anonymous memory at its peak during "
             "the steps, less what the process held before the arm's model was built, beside "
             "`meshfit.memory.estimate` (device + host bytes: one machine); file pages "
             "mapped (the parameter files' pages: the kernel can drop them).", "",
             "| arm | losses | median step | peak anonymous | estimate | file pages | "
             "on disk | estimate on disk |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(
            f"| {name} | {', '.join(f'{v:.4f}' for v in r['losses'])} | "
            f"{r['median_step_s']:.1f} s | {r['peak_anon_bytes'] / GiB:.2f} GiB | "
            f"{r['estimate_memory_bytes'] / GiB:.2f} GiB | {r['peak_file_bytes'] / GiB:.2f} GiB "
            f"| {r['disk_bytes_per_rank'] / GiB:.2f} GiB | "
            f"{r['estimate_disk_bytes'] / GiB:.2f} GiB |")
    lines += ["", _common.machine_markdown(info)]
    md = "\n".join(lines)
    print(md)
    if not args.no_write:
        paths = _common.write_results("disk_offload_params", md, {
            "args": vars(args), "params": shape.params, "arms": results, "machine": info})
        print(f"wrote {', '.join(str(p) for p in paths)}")


if __name__ == "__main__":
    main()
