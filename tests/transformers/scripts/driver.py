"""Run Trainer scripts' cases one after another in this process (one launch for all), under
transformers as written or under meshfit with ``from transformers import Trainer,
TrainingArguments`` changed to ``from meshfit.transformers import ...`` (`as_meshfit`), and
save each process's results.

    python driver.py --framework meshfit --out DIR [--script snippets] [--cases a,b]
    meshfit launch --nproc 2 driver.py --framework meshfit --out DIR

``--script`` names the scripts run in turn (``snippets``, ``sft``: written for transformers
and TRL; ``layouts``: meshfit's own).

Writes ``DIR/<framework>-<processes>-rank<r>.pt``: ``{case: result}`` (a case that raised:
``{"error": its type and message, "traceback": ...}``; later cases still run).
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


def as_meshfit(source: str) -> str:
    """The script with its trainer and arguments imported from meshfit: ``from transformers
    import Trainer, TrainingArguments`` or ``from trl import SFTConfig, SFTTrainer``, one line
    (whatever else it imports from them stays theirs)."""
    changed = re.sub(r"^from (transformers|trl) import (Trainer, TrainingArguments|"
                     r"SFTConfig, SFTTrainer)$",
                     r"from meshfit.transformers import \2", source, flags=re.MULTILINE)
    assert changed != source, "the script imports its trainer in one line"
    return changed


def load(script: str, framework: str) -> types.ModuleType:
    path = HERE / f"{script}.py"
    source = path.read_text()
    if framework == "meshfit" and script in ("snippets", "sft"):
        source = as_meshfit(source)
    module = types.ModuleType(f"trainer_{script}")
    module.__file__ = str(path)
    exec(compile(source, str(path), "exec"), module.__dict__)  # noqa: S102 - our own scripts
    return module


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--framework", choices=["transformers", "meshfit"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--script", default="snippets")
    parser.add_argument("--cases", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sys.path.insert(0, str(HERE))
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    out = Path(args.out)
    results, times = {}, {}
    for script in args.script.split(","):
        module = load(script, args.framework)
        asked = args.cases.split(",") if args.cases else list(module.CASES)
        for case in [c for c in asked if c in module.CASES]:  # each script's own
            began = time.perf_counter()
            folder = out / f"{args.framework}-{world}" / case
            try:
                results[case] = module.run(case, str(folder))
            except Exception as err:  # noqa: BLE001 - reported per case, the others still run
                results[case] = {"error": f"{type(err).__name__}: {err}",
                                 "traceback": traceback.format_exc()}
            times[case] = round(time.perf_counter() - began, 2)
    results["_times"] = times
    torch.save(results, out / f"{args.framework}-{world}-rank{rank}.pt")


if __name__ == "__main__":
    main()
