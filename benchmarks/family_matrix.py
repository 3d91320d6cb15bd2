"""The family matrix: every transformers decoder family meshfit names, under every layout
that splits the model, against one process -- by `meshfit verify` itself.

For each family of `meshfit.models.families` (the family's own configuration class, shrunk:
4 layers, width 64, 4 heads over 2 KV heads, vocabulary 256 for the byte tokenizer, every
feature that changes a split kept) a `meshfit train` configuration on the built-in corpus
is verified (`meshfit.verify.verify_config`: 3 optimizer steps in float64, AdamW, the same
weights and batches on one process and under each layout, tolerances derived from the
reference run's largest gradient) under:

    tp=2 + sequence parallel, pp=2 under GPipe and 1F1B, cp=2, tp=2 x dp_shard=2 (ZeRO-3),
    cp=2 x ZeRO-3, and for the mixtures of experts ep=2 (x dp_shard=2)

Printed and saved (benchmarks/results/family_matrix.{json,md}): per family and layout the
largest |loss - one process's loss| over the steps, the largest parameter difference
relative to the update, PASS/FAIL, or the one line meshfit refuses the layout with. With
``--docs`` the table is also written into docs/families.md between its markers (a test
checks that the page shows the saved results).

    python benchmarks/family_matrix.py                      # every family, every layout
    python benchmarks/family_matrix.py --families qwen3 gemma2 --layouts tp=2,sequence_parallel=true

Takes minutes per family on 2 CPU cores (one process group per layout).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

from meshfit.models.families import FAMILIES, MOE_FAMILIES, tiny_config  # noqa: E402

LAYOUTS = {
    "tp2+SP": "tp=2,sequence_parallel=true",
    "pp2 gpipe": "pp=2,schedule=gpipe",
    "pp2 1f1b": "pp=2,schedule=1f1b",
    "cp2": "cp=2",
    "tp2 x dp_shard2": "tp=2,dp_shard=2",
    "cp2 x ZeRO-3": "cp=2,dp_shard=2",
}
MOE_LAYOUTS = {"ep2": "dp_shard=2,ep=2", "ep2 x tp2": "dp_shard=2,ep=2,tp=2"}
DOCS = Path(__file__).resolve().parents[1] / "docs" / "families.md"
START, END = "<!-- family-matrix:start -->", "<!-- family-matrix:end -->"


def _config(family: str, root: Path):
    from meshfit.train.configfile import build_config

    folder = root / family
    tiny_config(family, layers=4, vocab_size=256).save_pretrained(folder)
    return build_config({
        "model": {"hf_config": str(folder)},
        "train": {"global_batch_size": 8, "micro_batch_size": 2, "seq_len": 32},
        "optim": {"optimizer": "adamw"},
        "data": {"cache_dir": str(root / "cache")}})


def _verify(cfg, layouts: dict[str, str]) -> dict[str, dict]:
    """name -> result row; a layout refused before launch is its one line."""
    from meshfit.verify import verify_config

    try:
        report = verify_config(cfg, list(layouts.values()), timeout_s=1800)
    except ValueError:
        if len(layouts) == 1:
            raise
        out = {}
        for name, layout in layouts.items():  # which one is refused, and why
            try:
                out |= _verify(cfg, {name: layout})
            except ValueError as err:
                out[name] = {"layout": layout, "passed": False, "refused": str(err)}
        return out
    by_layout = {r.layout: r.to_json() for r in report.results}
    return {name: by_layout.get(layout, {"layout": layout, "passed": False,
                                         "error": "no result"})
            for name, layout in layouts.items()}


def _cell(row: dict | None) -> str:
    if row is None:
        return ""
    if row.get("refused"):
        return "refused"
    if row.get("error") and row.get("loss_diff") is None:
        return "error"
    mark = "" if row["passed"] else " FAIL"
    return f"{row['loss_diff']:.1e}{mark}"


def table(results: dict[str, dict[str, dict]]) -> str:
    """The markdown table: family x layout -> max |delta loss| (or refused / FAIL)."""
    names = list(dict.fromkeys(n for rows in results.values() for n in rows))
    lines = ["| family | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for family, rows in results.items():
        lines.append(f"| {family} | " + " | ".join(_cell(rows.get(n)) for n in names) + " |")
    return "\n".join(lines)


def write_docs(md: str) -> None:
    text = DOCS.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    DOCS.write_text(f"{head}{START}\n{md}\n{END}{tail}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--families", nargs="*", default=list(FAMILIES))
    p.add_argument("--layouts", nargs="*", default=None,
                   help="layouts (key=value,...) instead of the matrix's")
    p.add_argument("--docs", action="store_true", help="write the table into docs/families.md")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    results: dict[str, dict[str, dict]] = {}
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            layouts = ({x: x for x in args.layouts} if args.layouts else
                       {**LAYOUTS, **(MOE_LAYOUTS if family in MOE_FAMILIES else {})})
            t0 = time.perf_counter()
            results[family] = _verify(_config(family, Path(tmp)), layouts)
            print(f"{family}: " + ", ".join(f"{n} {_cell(r)}" for n, r in
                                            results[family].items())
                  + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
    md = table(results)
    passed = sum(r.get("passed", False) for rows in results.values() for r in rows.values())
    ran = sum(not r.get("refused") for rows in results.values() for r in rows.values())
    summary = (f"{passed} of {ran} runs equal one process within `meshfit verify`'s "
               f"tolerance ({len(results)} families; 3 AdamW steps in float64; "
               f"{time.perf_counter() - began:.0f} s)")
    print(md + "\n\n" + summary)
    if args.no_write:
        return
    paths = _common.write_results("family_matrix", md + "\n\n" + summary + "\n\n" +
                                  _common.machine_markdown(_common.machine_info()),
                                  {"results": results, "summary": summary,
                                   "machine": _common.machine_info()})
    print(f"wrote {', '.join(str(q) for q in paths)}")
    if args.docs:
        write_docs(md + "\n\n" + summary)


if __name__ == "__main__":
    main()
