"""The manual's examples run: every fenced block of every page (and of the README) that holds
a ``meshfit`` command, and every Python or TOML block, says in a comment just before it how it
is tested, and is run as it says:

- ``<!-- run -->``: as it is (a shell block: each of its meshfit commands; a TOML block: read
  as a ``meshfit train`` config);
- ``<!-- run after: CODE -->``: a Python block, after CODE (the set-up it assumes);
- ``<!-- test: CODE -->``: CODE instead, the block in small form (a shell block: one
  ``meshfit ...`` or ``python -c ...`` per line);
- ``<!-- not run: REASON -->``: not run, for the reason given (a GPU, several machines,
  SLURM, minutes of training), which names the tests that cover it.

A block without such a comment fails `test_every_example_says_how_it_is_tested`, so a new
page cannot skip its examples silently. Commands run as ``python -m meshfit ...`` with
``MESHFIT_CPU=1``, each block in a folder of its own, in processes forked from one that has
imported torch and meshfit once (`_run_examples.py`).

And every meshfit command line of every block, run or not, names a real subcommand, options
that its ``--help`` lists, and ``--section.key=value`` overrides that are keys of the config;
the config reference on docs/train.md names every key.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from _docs_pages import DOCS, REPO, Block, blocks, logical_lines, pages
from conftest import make_subprocess_env, selected
from meshfit.train.config import RunConfig, config_fields, toml_name
from meshfit.train.configfile import load_config

RUNNER = Path(__file__).with_name("_run_examples.py")
BLOCKS = [b for page in pages() for b in blocks(page)]
RUN = {b.id: b for b in BLOCKS if b.marker in ("run", "run after", "test") and b.lang != "toml"}
TOML = {b.id: b for b in BLOCKS if b.marker == "run" and b.lang == "toml"}


def _config_keys() -> dict[str, set[str]]:
    from dataclasses import fields

    return {f.name: {toml_name(g) for g in config_fields(type(f.default_factory()))}
            for f in fields(RunConfig)}


# ---------------------------------------------------------------- every block is accounted for
def _problem(block: Block) -> str | None:
    """What is wrong with the block's marker, if anything."""
    if block.marker is None:
        return ("no <!-- run -->, <!-- run after: CODE -->, <!-- test: CODE --> or "
                "<!-- not run: REASON --> before it") if block.needs_marker else None
    if block.marker == "malformed":
        return f"a comment before it that is no marker: {block.marker_text[:80]!r}"
    if block.marker == "not run":
        return None if block.marker_text.strip() else "<!-- not run: --> without a reason"
    if block.marker == "run after" and block.lang not in ("python", "py"):
        return "<!-- run after: --> is for Python blocks"
    if block.lang == "toml" and block.marker != "run":
        return "a TOML block is run as it is (<!-- run -->) or not run"
    if block.marker == "run" and block.lang not in ("python", "py", "toml"):
        other = [line for line in logical_lines(block.text) if not line.startswith("#")
                 and not re.match(r"(\$ )?meshfit\b", line)]
        if other or not block.commands():
            return f"<!-- run --> on a shell block of other lines {other!r}: use <!-- test: -->"
    if block.marker in ("test", "run after") and not block.marker_text.strip():
        return f"<!-- {block.marker}: --> without its code"
    return None


def test_every_example_says_how_it_is_tested():
    problems = [f"{b.id}: {p}" for b in BLOCKS if (p := _problem(b))]
    assert problems == [], "\n".join(problems)


# ---------------------------------------------------------------- running them
def _jobs(block: Block, folder: Path) -> list[dict]:
    base = {"cwd": str(folder)}
    if block.lang in ("python", "py"):
        code = {"run": block.text, "test": block.marker_text,
                "run after": block.marker_text + "\n" + block.text}[block.marker]
        return [{**base, "kind": "code", "code": code}]
    lines = ([shlex.join(["meshfit", *argv]) for argv in block.commands()]
             if block.marker == "run" else logical_lines(block.marker_text))
    jobs = []
    for line in lines:
        if line.startswith("#"):
            continue
        argv = shlex.split(line)
        if argv[0] == "meshfit":
            jobs.append({**base, "kind": "meshfit", "args": argv[1:]})
        elif argv[:2] == ["python", "-c"] and len(argv) == 3:
            jobs.append({**base, "kind": "code", "code": argv[2]})
        else:
            raise AssertionError(f"{block.id}: a test line must be `meshfit ...` or "
                                 f"`python -c CODE`, not {line!r}")
    return jobs


def _subcommands() -> list[str]:
    return sorted({argv[0] for b in BLOCKS for argv in b.commands()
                   if argv and not argv[0].startswith("-")})


@pytest.fixture(scope="module")
def ran(request, tmp_path_factory):
    """{job name: result} for every selected example's jobs and the help of every command."""
    root = tmp_path_factory.mktemp("docs-examples")
    (root / "home").mkdir()
    jobs = [{"name": "help: meshfit", "cwd": str(root), "kind": "meshfit", "args": ["--help"]}]
    jobs += [{"name": f"help: meshfit {sub}", "cwd": str(root), "kind": "meshfit",
              "args": [sub, "--help"]} for sub in _subcommands()]
    for n, block_id in enumerate(selected(request, "block_id", list(RUN))):
        folder = root / f"block-{n}"
        folder.mkdir()
        for k, job in enumerate(_jobs(RUN[block_id], folder)):
            jobs.append({**job, "name": f"{block_id} #{k}"})
    for n, job in enumerate(jobs):
        job["log"] = str(root / f"job-{n}.log")
    (root / "jobs.json").write_text(json.dumps(jobs))
    env = make_subprocess_env(root)
    env["HOME"] = str(root / "home")  # caches (the token cache among them) stay in the test
    proc = subprocess.run([sys.executable, str(RUNNER), str(root / "jobs.json"),
                           str(root / "results.json")], cwd=root, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {r["name"]: r for r in json.loads((root / "results.json").read_text())}


@pytest.mark.parametrize("block_id", list(RUN))
def test_example_runs(ran, block_id):
    results = [r for name, r in ran.items() if name.startswith(block_id + " #")]
    assert results, f"{block_id}: nothing to run"
    for r in results:
        assert r["returncode"] == 0, (f"{r['name']} ({RUN[block_id].marker}) ended with "
                                      f"{r['returncode']}:\n{r['output'][-3000:]}")


@pytest.mark.parametrize("block_id", list(TOML))
def test_toml_example_is_a_config(block_id, tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(TOML[block_id].text + "\n")
    load_config(path)


def test_the_config_reference_names_every_key():
    page = DOCS / "train.md"
    reference = [b for b in blocks(page) if b.lang == "toml"]
    assert len(reference) == 1, "docs/train.md holds one TOML block: the config reference"
    sections = dict(re.findall(r"^\[(\w+)\]\n(.*?)(?=^\[|\Z)", reference[0].text, re.M | re.S))
    missing = [f"[{section}] {key}" for section, keys in _config_keys().items()
               for key in sorted(keys)
               if not re.search(rf"(?<![\w.]){key}(?!\w)", sections.get(section, ""))]
    assert missing == [], ("docs/train.md's config reference does not name: "
                           + ", ".join(missing))


# ---------------------------------------------------------------- every command line, statically
def _check(argv: list[str], helps: dict[str, str], keys: dict[str, set[str]]) -> list[str]:
    if not argv:
        return []
    sub, args = argv[0], argv[1:]
    if sub.startswith("-"):
        sub, args = "", argv
    help_text = helps.get(f"help: meshfit {sub}".rstrip())
    if help_text is None:
        return [f"meshfit {sub}: no such command"]
    if sub == "launch":  # what follows the script is the script's own
        script = next((i for i, a in enumerate(args) if a.endswith(".py")), len(args))
        args = args[:script]
    out = []
    for token in args:
        if token == "--":
            break
        if not token.startswith("-") or re.fullmatch(r"-\d[\d.e-]*", token):
            continue
        name = token.split("=", 1)[0]
        if m := re.fullmatch(r"--(\w+)\.(\w+)", name):
            if m.group(2) not in keys.get(m.group(1), ()):
                out.append(f"meshfit {sub}: {name} is no key of the config")
        elif not re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", help_text):
            out.append(f"meshfit {sub}: {name} is not in its --help")
    return out


def test_command_lines_name_real_commands_options_and_keys(ran):
    helps = {name: r["output"] for name, r in ran.items()
             if name.startswith("help: ") and r["returncode"] == 0}
    keys = _config_keys()
    problems = [f"{b.id}: {p}" for b in BLOCKS for argv in b.commands()
                for p in _check(argv, helps, keys)]
    assert problems == [], "\n".join(problems)
