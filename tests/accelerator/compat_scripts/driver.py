"""Run compat scripts one after another in this process (one launch for all of them), under
Accelerate as written or under meshfit with ``accelerate`` replaced by ``meshfit`` in their
imports, and save each process's results.

    python driver.py --framework meshfit --out DIR [--cases a,b,...]
    python -m torch.distributed.run --nproc-per-node 2 driver.py --framework accelerate --out DIR

Writes ``DIR/<framework>-<processes>-rank<r>.pt``: ``{case: result}`` (a failed case:
``{"error": traceback}``; later cases still run). `tracking` releases the process group
(``end_training``), so it runs last.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
import traceback
import types
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
CASES = ["shards", "accumulation", "scheduler", "uneven_eval", "checkpointing", "utilities",
         "context_parallel", "tracking"]
# Accelerate's context parallel needs GPU attention kernels: on 2 CPU processes it is not
# run (tests/accelerator/test_accelerate_compat.py compares meshfit's 2 with its 1).
ONE_PROCESS_UNDER_ACCELERATE = ("context_parallel",)


def as_meshfit(source: str) -> str:
    """The script with ``accelerate`` replaced by ``meshfit`` in its import statements."""
    return re.sub(r"^(\s*)(from|import)(\s+)accelerate\b", r"\1\2\3meshfit", source,
                  flags=re.MULTILINE)


def load(case: str, framework: str) -> types.ModuleType:
    path = HERE / f"{case}.py"
    source = path.read_text()
    if framework == "meshfit":
        source = as_meshfit(source)
    module = types.ModuleType(f"compat_{case}")
    module.__file__ = str(path)
    exec(compile(source, str(path), "exec"), module.__dict__)  # noqa: S102 - our own scripts
    return module


def reset(framework: str) -> None:
    """Accelerate keeps its state in process-wide singletons: start each case afresh, as a
    script of its own would (the process group stays)."""
    if framework == "accelerate":
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=False)
        GradientState._reset_state()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--framework", choices=["accelerate", "meshfit"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    out = Path(args.out)
    results, times = {}, {}
    for case in args.cases.split(","):
        began = time.perf_counter()
        script_args = argparse.Namespace(
            cpu=True, mixed_precision=None,
            output_dir=str(out / f"{args.framework}-{world}" / case))
        if args.framework == "accelerate" and world > 1 \
                and case in ONE_PROCESS_UNDER_ACCELERATE:
            continue
        try:
            module = load(case, args.framework)
            reset(args.framework)
            results[case] = module.training_function(dict(module.CONFIG), script_args)
        except Exception:  # noqa: BLE001 - reported per case, the others still run
            results[case] = {"error": traceback.format_exc()}
            print(f"rank {rank}: case {case} failed:\n{results[case]['error']}",
                  file=sys.stderr, flush=True)
        times[case] = round(time.perf_counter() - began, 2)
    results["_times"] = times
    torch.save(results, out / f"{args.framework}-{world}-rank{rank}.pt")


if __name__ == "__main__":
    main()
