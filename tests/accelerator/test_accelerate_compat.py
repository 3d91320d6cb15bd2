"""Accelerate drop-in, by difference: the scripts of ``tests/accelerator/compat_scripts``
(written for Hugging Face Accelerate, in the style of its examples) run under Accelerate as
written and under meshfit with ``accelerate`` replaced by ``meshfit`` in their imports, on 1 process
(plain ``python``) and on 2 (``torch.distributed.run``, gloo on 127.0.0.1), and give the same
results: per-step losses, learning rates, which samples each process saw, gathered metrics,
checkpoints resumed, tracked scalars, final parameters.

One launch per framework and process count runs every script in turn (`driver.py`), so the
whole comparison is 4 launches. Everything is fp32 on the CPU and both frameworks run the same
operations in the same order (the same DDP all-reduce on gloo), so the results are in fact
bitwise equal; the bound asserted is rtol 1e-6 with atol 1e-7 for floating-point values
(tensors and floats) and exact equality for everything else.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from conftest import kill_tree, make_subprocess_env
from reference import differences

pytest.importorskip("accelerate")
pytest.importorskip("tensorboard")

SCRIPTS = Path(__file__).resolve().parent / "compat_scripts"
sys.path.insert(0, str(SCRIPTS))
from driver import CASES, ONE_PROCESS_UNDER_ACCELERATE, as_meshfit  # noqa: E402

RTOL, ATOL = 1e-6, 1e-7
FRAMEWORKS = ("accelerate", "meshfit")


def _launch(framework: str, world: int, out: Path, env: dict) -> str:
    """Run the driver; returns its combined output (the test fails on a non-zero exit)."""
    from meshfit.distributed.spawn import free_port

    driver = [str(SCRIPTS / "driver.py"), "--framework", framework, "--out", str(out)]
    if world == 1:
        cmd = [sys.executable, *driver]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}", *driver]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)  # the launcher and its workers (in sessions of their own), ours only
        output, _ = proc.communicate(timeout=60)
        raise AssertionError(f"{framework} on {world} process(es) timed out:\n{output[-3000:]}")
    assert proc.returncode == 0, f"{framework} on {world} process(es):\n{output[-3000:]}"
    return output


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """{(framework, processes): [each rank's {case: result}]}."""
    out = tmp_path_factory.mktemp("compat")
    env = {k: v for k, v in make_subprocess_env(out).items() if not k.startswith("ACCELERATE_")}
    env["ACCELERATE_USE_CPU"] = "true"  # what `accelerate launch --cpu` sets
    # All four launches at once: most of their time is importing torch (CPU-bound, and the
    # 2 cores are then both busy); sequentially they take about twice as long.
    launches = [(f, w) for w in (2, 1) for f in FRAMEWORKS]
    with ThreadPoolExecutor(len(launches)) as pool:
        list(pool.map(lambda fw: _launch(*fw, out, env), launches))
    return {(f, w): [torch.load(out / f"{f}-{w}-rank{r}.pt", weights_only=False)
                     for r in range(w)]
            for f in FRAMEWORKS for w in (1, 2)}


def _differences(a, b, path: str = "") -> list[str]:
    return differences(a, b, rtol=RTOL, atol=ATOL, path=path)


def _result(results, framework: str, world: int, case: str) -> list:
    per_rank = [r[case] for r in results[(framework, world)]]
    for rank, res in enumerate(per_rank):
        if isinstance(res, dict) and "error" in res:
            pytest.fail(f"{framework}, {world} process(es), rank {rank}:\n{res['error']}",
                        pytrace=False)
    return per_rank


def _sane(case: str, world: int, per_rank: list) -> None:
    """What each script's results must show whatever the framework, so that equal results
    cannot be equally empty."""
    main = per_rank[0]
    if case == "shards":
        from shards import CASES as LOADERS

        for i, (n, bs, shuffle, drop_last, even, split, _, _) in enumerate(LOADERS):
            for epoch in main[i]["epochs"]:
                if even:
                    got = [x for batch in epoch["gathered"] for x in batch]
                    full = n - n % (bs * (1 if split else world)) if drop_last else n
                    assert len(set(got)) == len(got) == full and set(got) <= set(range(n))
                    assert shuffle or got == list(range(full))
            if world == 2 and not even:  # the ranks' batches cover the dataset once
                seen = [x for r in per_rank for b in r[i]["epochs"][0]["seen"] for x in b]
                assert sorted(seen) == list(range(n))
    elif case == "accumulation":
        for run in main.values():
            assert any(run["sync"]) and not all(run["sync"]) and len(set(run["lr"])) > 3
    elif case == "scheduler":
        # on one process split_batches changes nothing
        assert len({tuple(run["lr"]) for run in main.values()}) == len(main) - (world == 1)
    elif case == "uneven_eval":
        for epoch in main["eval"]:
            assert sorted(epoch["samples"]) == list(range(23)) and epoch["total"] == 23
            assert len(epoch["objects"]) == 23
    elif case == "checkpointing":
        assert main["automatic"] == {"folders": ["checkpoint_1", "checkpoint_2"],
                                     "iteration": 3, "loaded_last": True}
        assert main["from_step"]["meter"]["count"] == main["full"]["meter"]["count"]
    elif case == "context_parallel":
        assert len(main["losses"]) == 4 and main["losses"][-1] < main["losses"][0]
    elif case == "tracking":
        steps = [s for s, _ in main["scalars"]["train_loss"]]
        assert steps == list(range(len(steps))) and len(steps) > 2
        assert set(main["hparams"]) == {"lr", "num_epochs", "seed", "batch_size", "n_train",
                                        "n_eval"}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", CASES)
def test_same_results_as_accelerate(results, case, world):
    meshfit = _result(results, "meshfit", world, case)
    if case in ONE_PROCESS_UNDER_ACCELERATE and world > 1:
        # meshfit's 2 processes (cp=2) against Accelerate's one: the same numbers
        want = _result(results, "accelerate", 1, case)[0]
        assert want["mesh"] == [] and meshfit[0]["mesh"] == ["cp"]
        differences = _differences({**want, "mesh": None}, {**meshfit[0], "mesh": None},
                                   f"rank 0: {case}")
        assert not differences, "\n".join(differences[:10])
        return
    accelerate = _result(results, "accelerate", world, case)
    _sane(case, world, accelerate)
    for rank, (want, got) in enumerate(zip(accelerate, meshfit)):
        differences = _differences(want, got, f"rank {rank}: {case}")
        assert not differences, "\n".join(differences[:10])


def test_scripts_differ_only_in_their_imports():
    for case in CASES:
        source = (SCRIPTS / f"{case}.py").read_text()
        swapped = as_meshfit(source)
        assert "from accelerate" in source and "accelerate" not in swapped.replace(
            "Accelerate", "").replace("accelerator", "")
        changed = [(a, b) for a, b in zip(source.splitlines(), swapped.splitlines()) if a != b]
        assert changed and all(a.startswith(("from accelerate", "import accelerate"))
                               for a, _ in changed)
