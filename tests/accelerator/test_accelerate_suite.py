"""Accelerate's own test scripts pass under meshfit: `test_ops.py`, `test_sync.py` (its
accumulation matrix enabled on CPUs), `test_script.py` and `test_distributed_data_loop.py`
from the installed accelerate, with only their imports changed (by
`accelerate_suite/runner.py`, not by hand), on 1 process (plain ``python``) and 2
(``torch.distributed.run``, gloo on 127.0.0.1). The reference is the same scripts under
Accelerate in the same test: every test function that passes under Accelerate on these CPU
processes passes under meshfit.

One launch per framework and process count runs the four scripts in turn (4 launches, run at
once). Accelerate's internals the scripts read (``AcceleratorState._reset_state``,
``GradientState._reset_state``, a pickled Accelerator's ``state.__dict__``) are met too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import kill_tree, make_subprocess_env

pytest.importorskip("accelerate")

SUITE = Path(__file__).resolve().parent / "accelerate_suite"
sys.path.insert(0, str(SUITE))
from runner import OURS, SCRIPTS, as_meshfit, script_path  # noqa: E402

FRAMEWORKS = ("accelerate", "meshfit")


def _launch(framework: str, world: int, out: Path, env: dict) -> None:
    from meshfit.distributed.spawn import free_port

    runner = [str(SUITE / "runner.py"), "--framework", framework, "--out", str(out)]
    cmd = [sys.executable, *runner] if world == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}", *runner]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)  # the launcher and its workers, ours only
        output, _ = proc.communicate(timeout=60)
    # a failed call is recorded by the runner; a non-zero exit (or a hang) leaves the
    # calls that did not run missing, which the comparison reports
    (out / f"{framework}-{world}.log").write_text(output[-20000:])


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict:
    """{(framework, processes): [each rank's records]} (`runner`'s lines)."""
    out = tmp_path_factory.mktemp("accelerate_suite")
    env = {k: v for k, v in make_subprocess_env(out).items() if not k.startswith("ACCELERATE_")}
    env["ACCELERATE_USE_CPU"] = "true"  # what `accelerate launch --cpu` sets
    launches = [(f, w) for w in (2, 1) for f in FRAMEWORKS]
    with ThreadPoolExecutor(len(launches)) as pool:
        list(pool.map(lambda fw: _launch(*fw, out, env), launches))
    result = {}
    for framework in FRAMEWORKS:
        for world in (1, 2):
            ranks = []
            for rank in range(world):
                path = out / f"{framework}-{world}-rank{rank}.jsonl"
                lines = path.read_text().splitlines() if path.exists() else []
                ranks.append([json.loads(line) for line in lines])
            result[(framework, world)] = ranks
    return result


def _calls(records: list, script: str) -> dict:
    """{(function, n-th call): passed} of `script`'s test functions."""
    seen: Counter = Counter()
    out = {}
    for r in records:
        if r["script"] == script and r["function"] not in ("(seconds)", "main"):
            out[(r["function"], seen[r["function"]])] = (r["ok"], r["error"])
            seen[r["function"]] += 1
    return out


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("script", OURS + SCRIPTS)
def test_passes_where_accelerate_passes(outcomes, script, world):
    figures = []
    for rank in range(world):
        want = _calls(outcomes[("accelerate", world)][rank], script)
        got = _calls(outcomes[("meshfit", world)][rank], script)
        assert want, f"accelerate ran no test of {script} on {world} process(es)"
        failing = [f"{name} (call {i}): {got.get((name, i), (False, 'not run'))[1][-600:]}"
                   for (name, i), (ok, _) in want.items()
                   if ok and not got.get((name, i), (False,))[0]]
        assert not failing, f"rank {rank} of {world}:\n" + "\n".join(failing)
        figures.append(f"rank {rank}: accelerate {sum(ok for ok, _ in want.values())}/"
                       f"{len(want)}, meshfit {sum(ok for ok, _ in got.values())}/{len(got)}")
    print(f"{script} on {world}: " + "; ".join(figures))


def test_scripts_differ_only_in_their_imports():
    for script in OURS + SCRIPTS:
        source = script_path(script).read_text()
        swapped = as_meshfit(source)
        changed = [(a, b) for a, b in zip(source.splitlines(), swapped.splitlines()) if a != b]
        assert changed and all(a.lstrip().startswith(("from accelerate", "import accelerate"))
                               for a, _ in changed)
        assert not [b for _, b in changed if "accelerate" in b]
