"""How many of transformers' decoders `meshfit train --parallel.tp=2` (and pp=2, cp=2, ep=2)
starts: every model type transformers registers as a causal LM, its default configuration
shrunk (`meshfit.models.families.shrink_config`: 2 layers, width 64, vocabulary 256), run as
`meshfit train` runs it -- its checks before launch (`meshfit.train.preflight`), then on 2
processes (gloo) the first optimizer step of `meshfit.train.TrainingRun` under each layout.

Printed and saved (benchmarks/results/family_coverage.{json,md}): per layout, of the model
types that ship the plan it reads (`base_model_tp_plan`; `base_model_pp_plan`; cp: either;
ep: the mixtures of experts among them; a type that ships neither is not run), how many start, how many are refused before launch
(with the refusals counted by their reason) and how many fail after launch (each named: a
failure after launch is a bug, where a refusal is a decision) -- apart from those whose shrunk
model fails on its own, without meshfit (`one_process`).

    python benchmarks/family_coverage.py                  # every model type (tens of minutes)
    python benchmarks/family_coverage.py --types llama qwen3 gemma2
    python benchmarks/family_coverage.py --partial rows.json --resume rows.json  # go on

Nothing here asserts.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

LAYOUTS = {"tp": {"tp": 2}, "pp": {"pp": 2}, "cp": {"cp": 2}, "ep": {"dp_shard": 2, "ep": 2}}


def model_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _tiny(model_type: str, root: Path) -> tuple[Path | None, dict]:
    """The shrunk configuration saved in a folder, and what it ships; None: no tiny model."""
    import torch
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from meshfit.models.families import shrink_config

    facts = {"tp_plan": False, "pp_plan": False, "moe": False}
    try:
        config = shrink_config(CONFIG_MAPPING[model_type](), vocab_size=256)
        facts["tp_plan"] = bool(getattr(config, "base_model_tp_plan", None))
        facts["pp_plan"] = bool(getattr(config, "base_model_pp_plan", None))
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        facts["moe"] = any(hasattr(m, "gate_up_proj") and getattr(m, "gate_up_proj").dim() == 3
                           for m in model.modules())
        folder = root / model_type
        config.save_pretrained(folder)
    except Exception as err:  # noqa: BLE001 (a configuration transformers cannot build tiny)
        facts["build"] = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:160]}"
        return None, facts
    return folder, facts


def _config(folder: Path, root: Path, parallel: dict):
    from meshfit.train.configfile import build_config

    return build_config({
        "model": {"hf_config": str(folder)}, "parallel": parallel,
        "train": {"global_batch_size": 4, "micro_batch_size": 2, "seq_len": 16, "steps": 1,
                  "eval_every": 0},
        "data": {"cache_dir": str(root / "cache")}})


def _refusal(cfg) -> str | None:
    """meshfit train's checks before launch on 2 processes: its one line, or None."""
    from meshfit.train.preflight import preflight

    try:
        cfg.validate_for(2, 2)
        preflight(cfg, 2, 2, memory_check=False)
    except ValueError as err:
        return str(err).splitlines()[0]
    return None


def _first_steps(rank: int, world: int, cfgs: dict) -> dict[str, str | None]:
    """Each layout's first optimizer step, one after the other in these processes: None where
    it ran, else the failure's first line (a failure raised on both ranks alike leaves them
    in step for the next layout)."""
    from meshfit.distributed import init
    from meshfit.train import TrainingRun

    env, out = init(), {}
    for axis, cfg in cfgs.items():
        try:
            float(TrainingRun(cfg, env).step().loss)
            out[axis] = None
        except Exception as err:  # noqa: BLE001 (recorded, named in the table)
            out[axis] = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200]}"
    return out


def one_process(folder: Path) -> str | None:
    """The shrunk model's own first step here, without meshfit (forward and backward of the
    causal-LM loss on random tokens): None where it runs, else why not -- a layout's failure
    is meshfit's only where this runs."""
    import torch
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(folder)
        model = transformers.AutoModelForCausalLM.from_config(config)
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
        model(input_ids=ids, labels=ids).loss.backward()
    except Exception as err:  # noqa: BLE001 (recorded)
        return f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200]}"
    return None


def _started(cfgs: dict, context, timeout: float) -> dict[str, str | None]:
    """Per layout: None where the first step ran on 2 processes, else why not."""
    from meshfit.distributed.spawn import spawn

    if not cfgs:
        return {}
    try:
        ranks = spawn(_first_steps, 2, cfgs, timeout=timeout * len(cfgs), context=context)
    except Exception as err:  # noqa: BLE001 (a rank that died or hung: every layout failed)
        line = f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:200]}"
        return dict.fromkeys(cfgs, line)
    return {axis: ranks[0][axis] or ranks[1][axis] for axis in cfgs}


def report(rows: dict[str, dict], n_types: int, seconds: float, kept: int = 0) -> str:
    """The markdown summary of `rows` (model type -> what each layout did)."""
    lines = ["# meshfit train on 2 processes: which of transformers' causal LMs start", "",
             f"{n_types} model types (transformers' causal-LM registry), "
             f"{sum('build' in r for r in rows.values())} without a tiny model; "
             f"{seconds:.0f} s" + (f" for the {n_types - kept} run here ({kept} kept from "
                                   "earlier runs: --resume)" if kept else "") + ".", "",
             "| layout | of | start | refused before launch | fail after launch | "
             "fail on one process too |", "|---|---|---|---|---|---|"]
    wanted = {"tp": "tp_plan", "pp": "pp_plan", "cp": "plans", "ep": "moe"}
    reasons: dict[str, collections.Counter] = {}
    for axis, key in wanted.items():
        pool = [r for r in rows.values() if axis in r and (
            r["tp_plan"] or r["pp_plan"] if key == "plans" else r[key])]
        ok = sum(not r[axis].get("refused") and not r[axis].get("failed") for r in pool)
        refused = [r[axis]["refused"] for r in pool if r[axis].get("refused")]
        failed = [t for t, r in rows.items() if r in pool and r[axis].get("failed")
                  and not r.get("alone")]
        broken = [t for t, r in rows.items() if r in pool and r[axis].get("failed")
                  and r.get("alone")]
        reasons[axis] = collections.Counter(refused)
        of = {"tp": "ship base_model_tp_plan", "pp": "ship base_model_pp_plan",
              "cp": "ship either plan", "ep": "mixtures of experts (with a plan)"}[axis]
        lines.append(f"| {axis}=2 | {len(pool)} that {of} | **{ok}** | {len(refused)} | "
                     f"{len(failed)}{': ' + ', '.join(failed) if failed else ''} | "
                     f"{len(broken)} |")
    for axis, counter in reasons.items():
        if counter:
            lines += ["", f"Refusals of {axis}=2:", ""]
            lines += [f"- {n} x {why}" for why, n in counter.most_common(12)]
    mine = [(t, a, r[a]["failed"]) for t, r in rows.items() if not r.get("alone")
            for a in LAYOUTS if a in r and r[a].get("failed")]
    if mine:
        lines += ["", "Failures after launch (the shrunk model runs alone):", ""]
        lines += [f"- {t}, {a}=2: {why}" for t, a, why in mine]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--types", nargs="*", default=None)
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--partial", default=None, help="a JSON file updated after each model type")
    p.add_argument("--resume", default=None, help="a --partial file (or a saved results "
                   "JSON) whose model types are kept, not run again")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds per layout for a model type's first steps (a type that runs "
                        "past them counts as failed after launch, named)")
    args = p.parse_args()
    types = args.types or model_types()
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "transformers", "meshfit.train"])
    rows: dict[str, dict] = {}
    if args.resume:
        saved = json.loads(Path(args.resume).read_text())
        rows.update(saved.get("rows", saved) if isinstance(saved.get("rows"), dict) else saved)
    kept = sum(t in rows for t in types)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for model_type in types:
            if model_type in rows:  # kept from --resume
                continue
            folder, facts = _tiny(model_type, root)
            row = rows[model_type] = {**facts}
            if folder is None:
                print(f"{model_type}: no tiny model ({facts['build']})", flush=True)
                continue
            if not (facts["tp_plan"] or facts["pp_plan"]):  # (the figures count those only)
                continue
            admitted = {}
            for axis, parallel in LAYOUTS.items():
                cfg = _config(folder, root, parallel)
                refused = _refusal(cfg)
                if refused:
                    row[axis] = {"refused": refused}
                else:
                    admitted[axis] = cfg
            for axis, failed in _started(admitted, context, args.timeout).items():
                row[axis] = {"failed": failed}
            if any(row[a].get("failed") for a in admitted):
                row["alone"] = one_process(folder)  # (None: the failure is meshfit's)
            if args.partial:  # what is known so far, kept if the run is cut short
                Path(args.partial).write_text(json.dumps(rows))
            print(f"{model_type}: " + ", ".join(
                f"{a} " + ("refused" if r.get("refused") else "ok" if not r["failed"]
                           else "FAILED") for a, r in row.items() if a in LAYOUTS), flush=True)
    md = report(rows, len(types), time.perf_counter() - began, kept)
    print(md)
    if not args.no_write:
        paths = _common.write_results("family_coverage", md + "\n\n" + _common.machine_markdown(
            _common.machine_info()), {"rows": rows, "machine": _common.machine_info()})
        print(f"wrote {', '.join(str(q) for q in paths)}")


if __name__ == "__main__":
    main()
