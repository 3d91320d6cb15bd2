"""Shared helpers for the benchmark scripts: model flags, machine description, comm-hook
all-reduce counting, statistics and the results files (benchmarks/results/<name>.md/.json).

Not a test helper: nothing here asserts on timings.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

RESULTS_DIR = Path(__file__).resolve().parent / "results"


# ----------------------------------------------------------------------------- model
def add_model_args(p: argparse.ArgumentParser, *, d_model: int = 384, n_layer: int = 4,
                   n_head: int = 6, d_ff: int = 1536, seq_len: int = 64,
                   batch_size: int = 2) -> None:
    g = p.add_argument_group("model / batch (GPTConfig.preset('tiny') with these overrides)")
    g.add_argument("--d-model", type=int, default=d_model)
    g.add_argument("--n-layer", type=int, default=n_layer)
    g.add_argument("--n-head", type=int, default=n_head)
    g.add_argument("--d-ff", type=int, default=d_ff)
    g.add_argument("--seq-len", type=int, default=seq_len)
    g.add_argument("--batch-size", type=int, default=batch_size,
                   help="sequences per micro-batch per process")
    g.add_argument("--seed", type=int, default=0)


def model_config(args):
    from meshfit.models import GPTConfig

    return GPTConfig.preset("tiny", vocab_size=256, max_seq_len=args.seq_len,
                            d_model=args.d_model, n_layer=args.n_layer, n_head=args.n_head,
                            d_ff=args.d_ff)


def build_model(cfg, seed: int) -> torch.nn.Module:
    """The same weights on every call with the same seed (and on every rank)."""
    from meshfit.models import GPT

    torch.manual_seed(seed)
    random.seed(seed)
    return GPT(cfg)


def fused_adamw(model: torch.nn.Module, lr: float = 1e-4) -> torch.optim.Optimizer:
    # fused=True: the fastest AdamW on CPU (measured with torch 2.13: 29 ms per step vs 135 ms
    # for foreach and 189 ms for the loop, 33.5M parameters).
    return torch.optim.AdamW(model.parameters(), lr=lr, fused=True)


def device_sync(device: torch.device) -> None:
    """Wait for queued GPU work before reading a clock (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------- comm hook
class AllReduceCounter:
    """A DDP communication hook that counts all-reduce calls (one per gradient bucket) and
    their bytes, then does exactly what DDP's default does (`allreduce_hook`: divide by the
    world size, all-reduce, return the future). Independent of meshfit: it sees what the DDP
    reducer really sends."""

    def __init__(self) -> None:
        self.calls = 0
        self.bytes = 0

    def reset(self) -> None:
        self.calls = 0
        self.bytes = 0

    def attach(self, ddp_model: torch.nn.Module) -> "AllReduceCounter":
        if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
            raise TypeError(f"comm hooks need a DDP model, got {type(ddp_model).__name__}; "
                            "launch with --nproc 2 or more")
        ddp_model.register_comm_hook(None, self._hook)
        return self

    def _hook(self, state, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self.calls += 1
        buf = bucket.buffer()
        self.bytes += buf.numel() * buf.element_size()
        return allreduce_hook(state, bucket)


# ----------------------------------------------------------------------------- machine
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                return sorted(f for f in flags if f.startswith(("avx", "amx", "fma")))
    except OSError:
        pass
    return []


def launch_command() -> str:
    """The command that started this job. `meshfit launch` runs torchrun's agent in its own
    process, which is every worker's parent, so its command line is the launch command;
    fall back to the equivalent reconstruction."""
    script = " ".join(shlex.quote(a) for a in [_rel(sys.argv[0]), *sys.argv[1:]])
    if "WORLD_SIZE" not in os.environ:  # a single process started without a launcher
        return f"python {script}"
    world = os.environ["WORLD_SIZE"]
    reconstructed = f"meshfit launch --nproc {world} {script}"
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0")
        parts = [a.decode() for a in raw if a]
        for i, a in enumerate(parts):
            if os.path.basename(a) in ("meshfit", "torchrun"):
                return " ".join(shlex.quote(x) for x in [os.path.basename(a), *parts[i + 1:]])
    except OSError:
        pass
    return reconstructed


def _rel(path: str) -> str:
    try:
        return os.path.relpath(path)
    except ValueError:
        return path


def machine_info(acc=None) -> dict:
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": cpu_model(),
        "cpu_flags": _cpu_flags(),
        "logical_cores": os.cpu_count(),
        "affinity_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
        else None,
        "torch": torch.__version__,
        "torch_threads_per_process": torch.get_num_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "device": str(acc.device) if acc is not None else "cpu",
        "loadavg_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    try:
        import meshfit

        info["meshfit"] = meshfit.__version__
    except Exception:  # pragma: no cover - informational only
        pass
    try:
        import subprocess

        info["git_commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
            cwd=Path(__file__).resolve().parent, check=False).stdout.strip() or None
        info["src_uncommitted"] = subprocess.run(
            ["git", "status", "--porcelain", "--", "src"], capture_output=True, text=True,
            cwd=Path(__file__).resolve().parent, check=False).stdout.split("\n")
        info["src_uncommitted"] = [ln[3:] for ln in info["src_uncommitted"] if ln.strip()]
    except OSError:
        info["git_commit"], info["src_uncommitted"] = None, None
    return info


def machine_markdown(info: dict) -> str:
    rows = [
        ("platform", info["platform"]),
        ("CPU", f"{info['cpu_model']} ({info['logical_cores']} logical cores; "
                f"{', '.join(info['cpu_flags']) or 'no AVX flags'})"),
        ("torch", f"{info['torch']} ({info['torch_threads_per_process']} thread(s) per process, "
                  f"OMP_NUM_THREADS={info['OMP_NUM_THREADS']})"),
        ("backend / world size / device", f"{info['backend']} / {info['world_size']} / "
                                          f"{info['device']}"),
        ("load average (start -> end)", f"{_fmt_load(info.get('loadavg_at_start'))} -> "
                                        f"{_fmt_load(info.get('loadavg_at_end'))}"),
        ("meshfit commit", f"{info.get('meshfit', '?')} @ {info.get('git_commit')}"
                           + (f" + uncommitted: {', '.join(info['src_uncommitted'])}"
                              if info.get("src_uncommitted") else "")),
    ]
    return "\n".join(["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows])


def _fmt_load(x) -> str:
    return "?" if not x else "/".join(f"{v:.2f}" for v in x)


# ----------------------------------------------------------------------------- stats
def mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def bootstrap_ci(values: list[float], stat=statistics.median, n: int = 2000,
                 alpha: float = 0.05, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap confidence interval of `stat` over `values`."""
    rng = random.Random(seed)
    k = len(values)
    if k < 2:
        return (values[0], values[0]) if values else (float("nan"), float("nan"))
    boot = sorted(stat([values[rng.randrange(k)] for _ in range(k)]) for _ in range(n))
    return boot[int(alpha / 2 * n)], boot[int((1 - alpha / 2) * n) - 1]


def gather_floats(values: list[float]) -> list[list[float]]:
    """Every rank's list (same length on every rank), in rank order."""
    if not dist.is_initialized():
        return [values]
    t = torch.tensor(values, dtype=torch.float64)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [o.tolist() for o in out]


# ----------------------------------------------------------------------------- output
def write_results(name: str, markdown: str, payload: dict) -> tuple[Path, Path]:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    md, js = RESULTS_DIR / f"{name}.md", RESULTS_DIR / f"{name}.json"
    md.write_text(markdown if markdown.endswith("\n") else markdown + "\n")
    payload = {"written": datetime.datetime.now().isoformat(timespec="seconds"), **payload}
    js.write_text(json.dumps(payload, indent=2) + "\n")
    return md, js


# ----------------------------------------------------------------------------- machine
def concurrency_slowdown(active: int, rank: int, repeats: int = 3) -> float:
    """How much longer a fixed single-thread matmul loop takes when the first `active` ranks
    run it at once than when rank 0 runs it alone (the others wait at a barrier), median of
    `repeats`: 1.0 means independent cores; more means they share something (a VM's host,
    memory bandwidth) or are oversubscribed. Explains compute that stretches when ranks
    overlap."""
    a = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))

    def loop() -> float:
        t0 = time.perf_counter()
        for _ in range(100):
            a @ a
        return time.perf_counter() - t0

    loop()  # warm-up
    ratios = []
    for _ in range(repeats):
        dist.barrier()
        solo = loop() if rank == 0 else 0.0
        dist.barrier()
        together = loop() if rank < active else 0.0
        t = torch.tensor([solo, together], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        ratios.append(float(t[1] / t[0]))
    return statistics.median(ratios)
