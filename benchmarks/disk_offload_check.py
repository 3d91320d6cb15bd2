"""What checking the disk offload's files costs: the training step with and without the
digest check of every state file read back (``offload="disk"``, `meshfit.parallel.disk`).

Every file the offload writes is hashed (XXH3-128) as it is written, and hashed again when
it is read back at the next step, the two compared before any byte is used
(`meshfit.parallel.offload_files`). Both hashes run on the offload's reader and writer
threads, beside the update. This script trains the reference GPT (one process, AdamW, the
state streamed from `--dir`) and alternates steps with the check on and off (``DiskOffload.
check``; ABBA order, so that drift hits both arms alike), after `--warmup` steps. Printed and
saved: each arm's median step time (forward, backward, optimizer step and its writes),
optimizer step time and the process's CPU time over the step (all threads: the work the
hashing adds, which other load on the machine does not change), the ratios on/off of the
medians with bootstrap 95% intervals, and the bytes hashed per step. The goal: the step
within 5% (ratio <= 1.05).

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
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

from meshfit.models import GPT, GPTConfig  # noqa: E402
from meshfit.parallel.disk import DiskOffload  # noqa: E402
from meshfit.parallel.offload_files import PIECE  # noqa: E402

GiB = 2**30


def _step(model, opt, x, files=None) -> tuple[float, float, float]:
    """(step, optimizer step, CPU time of the process's threads over the step) in seconds;
    `files`: the parameter files, checked and sealed around the optimizer step as the
    Accelerator does."""
    c0, t0 = time.process_time(), time.perf_counter()
    loss = model(x[:, :-1], x[:, 1:])
    loss.backward()
    t1 = time.perf_counter()
    if files is not None:
        files.check()
    opt.step()
    opt.flush()  # this step's writes, counted in its time
    if files is not None:
        files.after_step()
    opt.zero_grad()
    t2 = time.perf_counter()
    return t2 - t0, t2 - t1, time.process_time() - c0


def _hash_cpu(nbytes: int, repeats: int = 3) -> float:
    """CPU seconds (this thread's) that hashing `nbytes` costs the offload: each `PIECE`
    hashed right after it was copied into a buffer (as a read from the page cache leaves
    it), only the hashing timed; the least of `repeats` (the work itself, without what other
    load on the machine adds)."""
    source = torch.ones(max(nbytes, 1), dtype=torch.uint8)
    target = torch.empty_like(source)
    view = memoryview(target.numpy())
    best = float("inf")
    for _ in range(repeats):
        took, h = 0.0, xxhash.xxh3_128()
        for start in range(0, nbytes, PIECE):
            target[start:start + PIECE].copy_(source[start:start + PIECE])
            t0 = time.thread_time()
            h.update(view[start:start + PIECE])
            took += time.thread_time() - t0
        best = min(best, took)
    return best


def _parameter_files(model, folder: Path):
    """`model` laid out by FSDP2 on a group of this process alone (its shards on the host),
    its shards moved into checked files (`ParameterFiles`)."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from meshfit.parallel.disk import ParameterFiles

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)),
                offload_policy=CPUOffloadPolicy(pin_memory=False))
    return ParameterFiles(model, folder)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default="/tmp/meshfit-disk-offload-check")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--chunk-mib", type=int, default=256)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=16, help="ABBA rounds: 4 steps each")
    p.add_argument("--tag", default="")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--params", action="store_true",
                   help="also the parameter shards in checked files (offload_params: FSDP2 "
                        "on one rank, CPU offload policy)")
    args = p.parse_args()
    cfg = GPTConfig.preset("tiny", vocab_size=256, d_model=args.d_model, n_layer=args.n_layer,
                           n_head=args.n_head, d_ff=4 * args.d_model, max_seq_len=args.seq_len,
                           dropout=0.0)
    torch.manual_seed(0)
    model = GPT(cfg)
    params = sum(q.numel() for q in model.parameters())
    files = _parameter_files(model, Path(args.dir) / "params") if args.params else None
    opt = DiskOffload(torch.optim.AdamW(model.parameters(), lr=1e-5), Path(args.dir) / "state",
                      chunk_bytes=args.chunk_mib * 2**20)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), generator=g)
    for _ in range(args.warmup):
        _step(model, opt, x, files)
    times: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
    for _ in range(args.rounds):
        for check in (True, False, False, True):
            opt.check = check
            if files is not None:
                if check and not files.hashing:
                    files.hashing = True
                    files.seal()  # (untimed: the files as the unchecked steps left them)
                files.hashing = check
            times[check].append(_step(model, opt, x, files))
    opt.check = True
    read_per_step = opt.bytes_read / (args.warmup + 4 * args.rounds)
    opt.close()
    param_hashed = 0
    if files is not None:  # (sealed after the step, checked at the forward and the step)
        param_hashed = 3 * files.bytes
        files.close()
    med = {c: [_common.median([t[i] for t in v]) for i in range(3)] for c, v in times.items()}
    ratios = []
    for i in range(3):  # (on, off) pairs of the same round
        pairs = [a[i] / b[i] for a, b in zip(times[True], times[False])]
        ratios.append((_common.median(pairs), *_common.bootstrap_ci(pairs)))
    ratio = ratios[0][0]
    hashed = 2 * read_per_step + param_hashed  # (state read back and written: both hashed)
    work = _hash_cpu(int(hashed))
    lines = ["# The disk offload's digest check: the step with and without", "",
             f"Reference GPT, {params / 1e6:.0f}M parameters (d_model {args.d_model}, "
             f"{args.n_layer} blocks), fp32, AdamW, one process, batch {args.batch_size} x "
             f"{args.seq_len} tokens; optimizer state on disk ({read_per_step / GiB:.2f} GiB "
             f"read and written per step, {hashed / GiB:.2f} GiB hashed), chunks of "
             f"{args.chunk_mib} MiB" + (f"; the parameter shards in checked files too ("
                                     f"{param_hashed / 3 / GiB:.2f} GiB, FSDP2 on one rank)"
                                     if files is not None else "") + f"; {args.rounds} ABBA rounds ({2 * args.rounds} steps per "
             f"arm) after {args.warmup} warm-up steps.", "",
             "Medians per step; CPU: the process's threads' CPU time over the step (what the "
             "hashing adds to the work, whatever else runs on the machine).", "",
             "| check | step | optimizer step | CPU |", "|---|---|---|---|",
             *(f"| {'on' if c else 'off'} | {med[c][0]:.3f} s | {med[c][1]:.3f} s | "
               f"{med[c][2]:.3f} s |" for c in (True, False)),
             "| on / off | " + " | ".join(f"**{r:.3f}** ({lo:.3f}-{hi:.3f})"
                                          for r, lo, hi in ratios) + " |", "",
             "On / off: the median of the ratios of paired steps (each on step with the off "
             "step beside it in the ABBA order), with its bootstrap 95% interval; goal for the "
             "step: <= 1.05.", "",
             f"The hashing alone: {work * 1e3:.1f} ms of CPU per step ({hashed / GiB:.2f} GiB "
             f"at {hashed / work / 1e9:.1f} GB/s, each 4 MiB piece just copied, best of 3), "
             f"{work / med[False][0]:.1%} of the step without the check and "
             f"{work / med[False][2]:.1%} of its CPU time: the cost with nothing else "
             "running, where the ratios above also carry the machine's noise.", "",
             _common.machine_markdown(_common.machine_info())]
    md = "\n".join(lines)
    print(md)
    if not args.no_write:
        name = "disk_offload_check" + (f"_{args.tag}" if args.tag else "")
        paths = _common.write_results(name, md, {
            "args": vars(args), "params": params, "read_bytes_per_step": read_per_step,
            "steps": {"on": times[True], "off": times[False]}, "ratio": ratio,
            "ratios_step_optimizer_cpu": ratios, "hash_cpu_s_per_step": work,
            "machine": _common.machine_info()})
        print(f"wrote {', '.join(str(q) for q in paths)}")


if __name__ == "__main__":
    main()
