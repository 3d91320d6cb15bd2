"""The manual (docs/, mkdocs.yml) builds, and what it and the README point at exists.

- The site builds with ``mkdocs build --strict``: a broken link or anchor, or a page that
  `nav` leaves out, fails the build (mkdocs.yml's `validation` turns each into a warning,
  and strict mode each warning into an error); the test fails with the build's lines.
- The README stays a front page: at most 250 lines, table cells of at most 200 characters,
  the quick start's two commands as CI (`.ci/run`) and the quick-start check run them, and
  links that reach existing pages and sections, on GitHub and in the site alike.
- Every test file and test name (``tests/x/test_y.py::test_z``) and every benchmark, script
  and example path a page cites exists, so that a page's evidence cannot outlive a test
  that moved or was renamed.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _docs_pages import (MKDOCS_YML, README, REPO, anchors, blocks, cited, github_slug,
                         headings, links, pages, rel)

QUICK_START = ("pip install torch==2.13.0 && pip install -e . && meshfit train --nproc 2",
               'pip install torch==2.13.0 && pip install -e ".[test]" && python -m pytest -q')


def test_the_site_builds_in_strict_mode(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about MkDocs 2
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "--config-file", str(MKDOCS_YML), "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    output = (proc.stdout + proc.stderr).splitlines()
    problems = [line for line in output if line.startswith(("WARNING", "ERROR"))
                or "Aborted" in line]
    assert proc.returncode == 0, "\n".join(problems or output[-20:])
    assert (tmp_path / "site" / "index.html").is_file()


def test_the_readme_is_a_front_page():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail to docs/"
    long = [f"README.md:{i}: {len(cell)} characters: {cell[:60]}..."
            for i, line in enumerate(lines, 1) if line.startswith("|")
            for cell in line.strip().strip("|").split(" | ") if len(cell.strip()) > 200]
    assert long == [], "\n".join(long)


def test_the_quick_start_commands_are_the_ones_ci_runs():
    quick = [b for b in blocks(README) if b.lang == "bash" and "pytest" in b.text]
    assert len(quick) == 1 and quick[0].text.splitlines() == list(QUICK_START), quick
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert 'pip install -q -e ".[test]" && python -m pytest -q' in ci


@pytest.mark.parametrize("page", pages(), ids=rel)
def test_links_reach_pages_and_sections(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        goal = (page.parent / path).resolve() if path else page
        if not goal.exists():
            broken.append(f"{target}: no file {goal.relative_to(REPO)}")
        elif anchor and goal.suffix == ".md" and anchor not in anchors(goal):
            spelled = {github_slug(h) for h in headings(goal)}
            why = ("GitHub and MkDocs spell this heading's anchor differently: reword it"
                   if anchor in spelled else "no such heading")
            broken.append(f"{target}: {why}")
    assert broken == [], f"{rel(page)}:\n" + "\n".join(broken)


def _names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef,
                                                             ast.AsyncFunctionDef))}


@pytest.mark.parametrize("page", pages(), ids=rel)
def test_cited_tests_and_benchmarks_exist(page):
    missing = []
    for path, name in cited(page):
        target = REPO / path
        if not target.exists():
            missing.append(f"{path}: no such file or folder")
        elif name and name not in _names(target):
            missing.append(f"{path}::{name}: no such test in that file")
    assert missing == [], (f"{rel(page)} cites what is not there (moved or renamed? "
                           "update the page):\n" + "\n".join(missing))
