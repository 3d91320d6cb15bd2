"""``meshfit calibrate [--nproc N] [--out calibration.json] [--sizes S ...] [--cpu]``: its
arguments, its workers (``meshfit calibrate --worker`` on N processes through `meshfit.launch`;
N=1 runs in this process: every rank measures while all of them run at once, rank 0 writes
the JSON file) and the table it prints. The file's schema and its loader are
`meshfit.plan.calibrate`'s; `meshfit.plan.measure` runs the measurements.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from meshfit import launch

_UNITS = {"": 1, "B": 1, "K": 1024, "KB": 1024, "KIB": 1024, "M": 1024**2, "MB": 1024**2,
          "MIB": 1024**2, "G": 1024**3, "GB": 1024**3, "GIB": 1024**3}


def parse_sizes(items: list[str]) -> tuple[int, ...]:
    """``["4K,64K", "1M"]`` -> sorted distinct byte counts (K/M/G are binary: KiB, MiB, GiB)."""
    fix = "give at least two byte sizes, e.g. --sizes 4K 64K 1M 16M"
    out = set()
    for text in (p for item in items for p in item.split(",")):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
        if not m or m.group(2).upper() not in _UNITS:
            raise ValueError(f"--sizes value {text!r} is not a byte size; {fix}")
        size = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
        if size < 4:
            raise ValueError(f"--sizes value {text!r} is under 4 bytes (one fp32 element); {fix}")
        out.add(size)
    if len(out) < 2:
        raise ValueError(f"--sizes={' '.join(items)!r} names {len(out)} distinct size(s); a fit "
                         f"needs two or more: {fix}")
    return tuple(sorted(out))


# argparse's own parser (its errors print the usage block), not OneLineParser
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="meshfit calibrate", allow_abbrev=False,
        description="Measure matmul FLOP/s, memory bandwidth and collective bandwidth and latency "
                    "on N processes of this machine; write them as JSON for the layout planner.")
    p.add_argument("--nproc", default="1", help="processes to run at once (default 1; "
                   "collectives need 2 or more)")
    p.add_argument("--out", default="calibration.json", help="the JSON file to write")
    p.add_argument("--sizes", nargs="+", default=None,
                   help="collective sizes in bytes, e.g. 4K 64K 1M (default 4K..64M by 4x on "
                        "the CPU, 16K..1G on GPUs)")
    p.add_argument("--cpu", action="store_true",
                   help="measure the CPU with gloo even where CUDA is available "
                        "(also MESHFIT_CPU=1)")
    p.add_argument("--repeats", default="5",
                   help="times each timing is repeated (default 5, at least 2): their median "
                        "is the figure, their spread the noise it is judged by")
    p.add_argument("--offload-dir", default=None,
                   help="also measure the sequential write (fsync'd) and read bandwidth of "
                        "this folder's disk, for offload=\"disk\" (meshfit plan --profile)")
    p.add_argument("--offload-gib", type=float, default=1.0,
                   help="the size of the file --offload-dir is measured with (default 1)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p


def _count(text: str, flag: str, least: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{flag}={text!r} is not an integer; e.g. {flag} {least + 1}") from None
    if value < least:
        raise ValueError(f"{flag}={value} must be >= {least} ({what})")
    return value


def _validate(ns) -> tuple[int, Path, tuple[int, ...] | None, bool]:
    """(processes, output file, collective sizes, CPU?) from the arguments, checked against
    this machine (devices, backends) before any process starts (--repeats: checked into
    `ns.repeats`)."""
    import torch
    import torch.distributed as dist

    from meshfit.distributed import cpu_requested

    nproc = _count(ns.nproc, "--nproc", 1, "the processes to run at once")
    ns.repeats = _count(ns.repeats, "--repeats", 2, "a timing's spread needs two repeats")
    cpu = cpu_requested(True if ns.cpu else None)
    cuda = torch.cuda.is_available() and not cpu
    if nproc > 1:
        if not dist.is_available():
            raise ValueError(f"--nproc={nproc} needs torch.distributed, which this torch build "
                             "lacks; use --nproc 1")
        if cuda:
            count = torch.cuda.device_count()
            if nproc > count:
                raise ValueError(f"--nproc={nproc} is more than the {count} visible CUDA "
                                 f"device(s); use --nproc {count} or less (one per GPU), or "
                                 "--cpu to measure the CPU")
            if not dist.is_nccl_available():
                raise ValueError(f"--nproc={nproc} on CUDA needs NCCL, which this torch build "
                                 "lacks; use --nproc 1 or --cpu")
        elif not dist.is_gloo_available():
            raise ValueError(f"--nproc={nproc} on the CPU needs gloo, which this torch build "
                             "lacks; use --nproc 1")
    out = Path(ns.out).absolute()
    if out.is_dir():
        raise ValueError(f"--out={ns.out!r} is a folder; give a file name, e.g. "
                         f"{Path(ns.out) / 'calibration.json'}")
    if not out.parent.is_dir():
        raise ValueError(f"--out={ns.out!r}: folder {out.parent} does not exist; create it or "
                         "give another --out")
    sizes = parse_sizes(ns.sizes) if ns.sizes is not None else None
    if ns.offload_dir is not None and not Path(ns.offload_dir).expanduser().is_dir():
        raise ValueError(f"--offload-dir={ns.offload_dir!r} is not a folder; give an existing "
                         "folder on the disk offload='disk' will use")
    if not 0 < ns.offload_gib <= 1024:
        raise ValueError(f"--offload-gib={ns.offload_gib} must be in (0, 1024]")
    return nproc, out, sizes, cpu


def cmd_calibrate(argv: list[str]) -> int:
    """`meshfit calibrate`: check the arguments, then measure here (one process, or as one
    of the workers) or start --nproc workers, each running ``meshfit calibrate --worker``."""
    ns = _parser().parse_args(argv)
    nproc, out, sizes, cpu = _validate(ns)  # before any process starts
    if ns.worker or nproc == 1:
        rc = _worker(out, sizes, cpu, ns.repeats)
    else:
        # No --nproc here: torchrun's parser would take it for an abbreviation of its own
        # --nproc-per-node. The workers learn the world size from their environment.
        script = ["meshfit", "calibrate", "--worker", "--out", str(out), "--repeats",
                  str(ns.repeats)]
        if sizes is not None:
            script += ["--sizes", *map(str, sizes)]
        if cpu:
            script.append("--cpu")
        rc = launch.run(launch.LaunchConfig(nproc=nproc), script, module=True)
    if rc == 0 and ns.offload_dir is not None and not ns.worker:
        _measure_disk(out, Path(ns.offload_dir).expanduser(), int(ns.offload_gib * 2**30))
    return rc


def _measure_disk(out: Path, folder: Path, nbytes: int) -> None:
    """The offload folder's disk bandwidth, added to the calibration file (rewritten
    atomically)."""
    from meshfit._files import atomic_write_text
    from meshfit.parallel.disk import disk_bandwidth

    write, read = disk_bandwidth(folder, nbytes)
    data = json.loads(out.read_text())
    data["disk"] = {"folder": str(folder.resolve()), "write": write, "read": read}
    atomic_write_text(out, json.dumps(data, indent=2) + "\n")
    print(f"disk ({folder}): sequential write {write / 1e9:.2f} GB/s (fsync'd), read "
          f"{read / 1e9:.2f} GB/s -> {out}", flush=True)


def _worker(out: Path, sizes: tuple[int, ...] | None, cpu: bool, repeats: int) -> int:
    """This process's part of the measurement; the main process prints the table."""
    from meshfit.plan.measure import measure

    result = measure(out, sizes, cpu, repeats)
    if result is not None:
        print(_table(result, out), flush=True)
    return 0


def _si(value: float | None, unit: str) -> str:
    """`value` with an SI prefix: 2.5e9 -> "2.5 G<unit>"."""
    if value is None:
        return "-"
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1.0, ""),
                          (1e-3, "m"), (1e-6, "µ")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value * 1e9:.3g} n{unit}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"±{value / 2:.0%}"


def _table(result: dict, out: Path) -> str:
    """The measured figures, one line each, with the spread of their repeats (±half their
    range, of the median), then what `meshfit.plan.trust` flagged."""
    from meshfit.plan.calibrate import DTYPES
    from meshfit.plan.fit import KINDS

    raw = result["raw"]
    noise = raw["noise"]
    lines = [(f"meshfit calibrate: {result['world_size']} process(es) on {result['device']}, "
              f"{result['backend']}, torch {result['torch']} -> {out}"),
             (f"  {noise['timings']} timings, each repeated {noise['repeats']} times; the "
              f"repeats' range: a median {noise['median_spread']:.0%} of their median, the "
              f"widest {noise['max_spread']:.0%}")]
    for d in DTYPES:
        rows = raw["matmul"][d]
        size = f"(n={rows[-1]['n']}, {_pct(rows[-1]['spread'])})" if rows else ""
        lines.append(f"  matmul {d:<5} {_si(result['matmul_flops'][d], 'FLOP/s'):>14} {size}")
    lines.append(f"  memory copy  {_si(result['memory_bandwidth'], 'B/s'):>14} "
                 f"({_pct(raw['memory']['spread'])})")
    lines.append(f"  {'collective':<15}{'bus bandwidth':>14}{'latency':>12}{'R²':>8}"
                 f"{'spread':>8}")
    for kind in KINDS:
        fit = result["collectives"][kind]
        timed = raw["collectives"].get(kind, {})
        r2, widest = timed.get("r2"), max(timed.get("spread", [None]), key=lambda v: v or 0)
        lines.append(f"  {kind:<15}{_si(fit['bus_bandwidth'], 'B/s'):>14}"
                     f"{_si(fit['latency'], 's'):>12}{'-' if r2 is None else f'{r2:.4f}':>8}"
                     f"{_pct(widest):>8}")
    lines += _differences(result)
    flags = result.get("flags") or {}
    if flags:
        lines.append("  flagged: meshfit plan will not use these (it assumes instead, and says "
                     "so):")
        lines += [f"    {figure}: {why}" for figure, why in flags.items()]
    return "\n".join(lines)


def _differences(result: dict) -> list[str]:
    """The data-parallel engines' and tensor parallel's multiples, the pipeline schedules'
    seconds per micro-batch, each with the seconds beyond its baseline and their noise."""
    lines = []
    timed = result["raw"].get("data_parallel") or {}
    for name, value in (result.get("data_parallel") or {}).items():
        row = timed.get(name) or {}
        beyond = row.get("exposed_seconds", row.get("seconds", 0) - row.get(
            "predicted_without_tp", 0))
        if value is not None:
            lines.append(f"  {name:<17} x{value:<10.2f} the modelled collectives' time "
                         f"({beyond * 1e3:+.2f} ms ±{row.get('noise_seconds', 0) * 1e3:.2f} ms "
                         "in a step)")
    timed = result["raw"].get("pipeline") or {}
    for name, value in (result.get("pipeline") or {}).items():
        row = timed.get(name) or {}
        if value is not None:
            lines.append(f"  {name:<17} {value * 1e3:.2f} ms per micro-batch beyond the "
                         f"prediction (±{row.get('noise_seconds', 0) * 1e3:.2f} ms a step)")
    return lines
