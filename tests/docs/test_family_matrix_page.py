"""Figures in the manual that a benchmark saved: docs/families.md shows the family matrix as
`benchmarks/family_matrix.py` saved it: the
table between the page's markers is the rendering of benchmarks/results/family_matrix.json
(a figure in the manual that no run made would drift)."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("family_matrix",
                                                  ROOT / "benchmarks" / "family_matrix.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_page_shows_the_saved_matrix():
    script = _script()
    saved = json.loads((ROOT / "benchmarks" / "results" / "family_matrix.json").read_text())
    page = (ROOT / "docs" / "families.md").read_text()
    shown = page.split(script.START, 1)[1].split(script.END, 1)[0].strip()
    assert shown == (script.table(saved["results"]) + "\n\n" + saved["summary"]).strip()
    # at least 14 families, each run under the matrix's layouts, none failing
    assert len(saved["results"]) >= 14
    rows = [r for layouts in saved["results"].values() for r in layouts.values()]
    assert all(r.get("passed") or r.get("refused") for r in rows)


def test_the_pages_coverage_figures_are_the_saved_walks():
    """The counts the page gives for the walk over every model type (`benchmarks/
    family_coverage.py`) are those of its saved results: per axis, started of the pool,
    refused before launch, failed after launch."""
    import re

    saved = (ROOT / "benchmarks" / "results" / "family_coverage.md").read_text()
    page = " ".join((ROOT / "docs" / "families.md").read_text().split())
    found = re.findall(r"^\| (\w\w)=2 \| (\d+) that [^|]*\| \*\*(\d+)\*\* \| (\d+) \| (\d+)",
                       saved, flags=re.MULTILINE)
    rows = {axis: figures for axis, *figures in found}
    assert set(rows) == {"tp", "pp", "cp", "ep"}
    for axis, (pool, ok, refused, failed) in rows.items():
        assert f"{axis}=2 starts **{ok} of {pool}**" in page or \
            f"{axis}=2 **{ok} of {pool}**" in page, axis
        assert failed == "0"  # the page says none fails after launch
        if axis != "ep":
            assert f"{refused} refused" in page, axis
    n_types = re.search(r"^(\d+) model types", saved, flags=re.MULTILINE).group(1)
    assert f"covered all {n_types} model types" in page


def test_the_memory_table_is_the_saved_benchmark():
    """docs/single-device.md's memory table (optimizer x checkpointing) is the one
    `benchmarks/memory_table.py` saved, row for row."""
    saved = (ROOT / "benchmarks" / "results" / "memory_table_cpu.md").read_text()
    page = (ROOT / "docs" / "single-device.md").read_text()
    shown = page.split("<!-- memory-table:start -->", 1)[1].split("<!-- memory-table:end -->")[0]
    rows = [line for line in shown.strip().splitlines() if line.startswith("|")]
    assert rows and all(row in saved.splitlines() for row in rows)
    assert len(rows) == 2 + 6  # header, rule, one row per optimizer
