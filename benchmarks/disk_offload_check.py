"""What checking the disk offload's files costs: the training step with and without the
digest check of every state file read back (``offload="disk"``, `meshfit.parallel.disk`).

Every file the offload writes is hashed (XXH3-128) as it is written, and hashed again when
it is read back at the next step, the two compared before any byte is used
(`meshfit.parallel.offload_files`). Both hashes run on the offload's reader and writer
threads, beside the update. This script trains the reference GPT (one process, AdamW, the
state streamed from `--dir`) and alternates steps with the check on and off (``DiskOffload.
check``; ABBA order, so that drift hits both arms alike), after `--warmup` steps. Printed and
saved: each arm's median step time (forward, backward, optimizer step and its writes) and
optimizer step time, the ratio on/off of the medians with a bootstrap 95% interval, and the
bytes hashed per step. The goal: the step within 5% (ratio <= 1.05).

The files sit in the page cache when memory allows (here they do): reading them back costs
a copy, so the hashing is the largest share of the I/O it can be; on a disk that must really
be read the same hashing is a smaller share.

    python benchmarks/disk_offload_check.py --dir /path/on/local/disk
    python benchmarks/disk_offload_check.py --d-model 256 --n-layer 2 --rounds 4   # quick

Nothing here asserts; run on a quiet machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

from meshfit.models import GPT, GPTConfig  # noqa: E402
from meshfit.parallel.disk import DiskOffload  # noqa: E402

GiB = 2**30


def _step(model, opt, x) -> tuple[float, float]:
    t0 = time.perf_counter()
    loss = model(x[:, :-1], x[:, 1:])
    loss.backward()
    t1 = time.perf_counter()
    opt.step()
    opt.flush()  # this step's writes, counted in its time
    opt.zero_grad()
    t2 = time.perf_counter()
    return t2 - t0, t2 - t1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default="/tmp/meshfit-disk-offload-check")
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-head", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--chunk-mib", type=int, default=256)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=8, help="ABBA rounds: 4 steps each")
    p.add_argument("--tag", default="")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    cfg = GPTConfig.preset("tiny", vocab_size=256, d_model=args.d_model, n_layer=args.n_layer,
                           n_head=args.n_head, d_ff=4 * args.d_model, max_seq_len=args.seq_len,
                           dropout=0.0)
    torch.manual_seed(0)
    model = GPT(cfg)
    params = sum(q.numel() for q in model.parameters())
    opt = DiskOffload(torch.optim.AdamW(model.parameters(), lr=1e-5), Path(args.dir) / "state",
                      chunk_bytes=args.chunk_mib * 2**20)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), generator=g)
    for _ in range(args.warmup):
        _step(model, opt, x)
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for _ in range(args.rounds):
        for check in (True, False, False, True):
            opt.check = check
            times[check].append(_step(model, opt, x))
    opt.check = True
    read_per_step = opt.bytes_read / (args.warmup + 4 * args.rounds)
    opt.close()
    med = {c: (_common.median([t[0] for t in v]), _common.median([t[1] for t in v]))
           for c, v in times.items()}
    pairs = [a[0] / b[0] for a, b in zip(times[True], times[False])]
    lo, hi = _common.bootstrap_ci(pairs)
    ratio = med[True][0] / med[False][0]
    hashed = 2 * read_per_step  # (read back and written: both hashed)
    lines = ["# The disk offload's digest check: the step with and without", "",
             f"Reference GPT, {params / 1e6:.0f}M parameters (d_model {args.d_model}, "
             f"{args.n_layer} blocks), fp32, AdamW, one process, batch {args.batch_size} x "
             f"{args.seq_len} tokens; optimizer state on disk ({read_per_step / GiB:.2f} GiB "
             f"read and written per step, {hashed / GiB:.2f} GiB hashed), chunks of "
             f"{args.chunk_mib} MiB; {args.rounds} ABBA rounds ({2 * args.rounds} steps per "
             f"arm) after {args.warmup} warm-up steps.", "",
             "| check | step (median) | optimizer step (median) |", "|---|---|---|",
             f"| on | {med[True][0]:.3f} s | {med[True][1]:.3f} s |",
             f"| off | {med[False][0]:.3f} s | {med[False][1]:.3f} s |", "",
             f"Step time on / off: **{ratio:.3f}** (median of paired ratios "
             f"{_common.median(pairs):.3f}, bootstrap 95% interval {lo:.3f}-{hi:.3f}); "
             f"goal <= 1.05.", "", _common.machine_markdown(_common.machine_info())]
    md = "\n".join(lines)
    print(md)
    if not args.no_write:
        name = "disk_offload_check" + (f"_{args.tag}" if args.tag else "")
        paths = _common.write_results(name, md, {
            "args": vars(args), "params": params, "read_bytes_per_step": read_per_step,
            "steps": {"on": times[True], "off": times[False]}, "ratio": ratio,
            "paired_ci": [lo, hi], "machine": _common.machine_info()})
        print(f"wrote {', '.join(str(q) for q in paths)}")


if __name__ == "__main__":
    main()
