"""Test helpers: a spawn helper for multi-process tests on gloo, and hygiene checks.

Multi-process tests run on CPU with gloo, bound to 127.0.0.1 on a free port; every test fails
if it leaks a process group, a child process, torchrun's environment variables or threads.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import tempfile
import threading
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from meshfit.distributed.spawn import SpawnError, spawn

REPO = Path(__file__).resolve().parents[1]

if os.environ.pop("PYTHONDONTWRITEBYTECODE", None):
    # The processes the tests start (`meshfit train`'s launcher and workers, scripts) would
    # compile meshfit's sources again each (0.25 s a process): they keep the bytecode in one
    # folder outside the repository instead, as the environment asked.
    os.environ.setdefault("PYTHONPYCACHEPREFIX",
                          os.path.join(tempfile.gettempdir(), f"meshfit-tests-pyc-{os.getuid()}"))

if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("MESHFIT_TEST_THREADS") != "all":
    # Each xdist worker keeps one intra-op thread: the workers are as many as the cores, and
    # two workers each running two spin-waiting OpenMP threads on 2 cores slow a tiny
    # model's step several-fold (`one_thread` below does the same for one test).
    torch.set_num_threads(1)

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                  "MASTER_PORT", "GROUP_RANK", "TORCHELASTIC_RUN_ID")


# Ranks are started by a fork server that has imported torch and meshfit once: a freshly
# spawned interpreter spends ~3.5 s of CPU importing them (torch._dynamo among them), i.e.
# ~4 s of wall time per 2-rank spawn and ~8 s per 4-rank one on 2 cores, dozens of times per
# run of the suite. Each rank is still a new process forked from that clean server, which
# never initialises a process group, runs an operator or starts a thread of its own; the
# rank then takes the parent's current environment and fresh random seeds, as a spawned
# interpreter would (`meshfit.distributed.spawn`). Modules the server cannot import are left
# to the ranks.
_PRELOAD = ["torch", "torch.distributed", "meshfit", "meshfit.accelerator",
            "meshfit.distributed.spawn", "conftest",
            "reference",
            # the Hugging Face models of reference.py: ~1.6 s more per rank that builds one
            "transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2",
            "transformers.models.qwen2.modeling_qwen2"]
_context = None


def _mp_context():
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
    return _context


def descendants(pid: int) -> list[int]:
    """Every living process below `pid` (children, their children, ...), read from /proc.
    torchrun starts each worker in a session of its own, so killing the launcher's process
    group leaves its workers running; a test that gives up on a launch ends these too."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it (only processes this test started)."""
    import signal

    for victim in [*descendants(pid), pid]:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_distributed(fn, world_size: int, *args, timeout: float = 120.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on `world_size` new gloo ranks on the CPU (forked
    from a fork server that has imported torch and meshfit; `meshfit.distributed.spawn`);
    returns each rank's (picklable) result, in rank order. `fn` must be a module-level
    function."""
    try:
        return spawn(fn, world_size, *args, timeout=timeout, context=_mp_context(),
                     backend="gloo", cpu=True)
    except SpawnError as err:
        raise AssertionError(str(err)) from None


# ---------------------------------------------------------------- several cases, one spawn
# Starting ranks costs seconds (a Python interpreter and torch's import per rank), so tests
# that need the same world size run their cases in one spawn: `run_cases` runs each case in
# turn on every rank and keeps a failing case's traceback as that case's result, so the
# other cases still report; `case_result` turns it back into a failure of that case's test.
_CASE_ERROR = "__case_error__"


def _run_cases(rank, world_size, cases):
    out = {}
    for name, fn, args in cases:
        try:
            out[name] = fn(rank, world_size, *args)
        except Exception:
            # Printed at once too: if the other ranks then wait forever in a collective of
            # this case, the spawn times out and this is where the reason shows.
            tb = traceback.format_exc()
            print(f"rank {rank}, case {name!r} failed:\n{tb}", file=sys.stderr, flush=True)
            out[name] = {_CASE_ERROR: tb}
    return out


def run_cases(cases: dict, world_size: int, *, timeout: float = 120.0) -> dict[str, list]:
    """Run every case of ``{name: (fn, *args)}`` as ``fn(rank, world_size, *args)`` in one
    spawn of `world_size` gloo ranks, one case after another in the given order; returns
    ``{name: [rank 0's result, rank 1's, ...]}``. Read a case with `case_result`. `timeout`
    covers all the cases together."""
    ranks = run_distributed(_run_cases, world_size,
                            [(name, fn, tuple(args)) for name, (fn, *args) in cases.items()],
                            timeout=timeout)
    return {name: [r[name] for r in ranks] for name in cases}


def case_result(results: dict[str, list], name: str) -> list:
    """The per-rank results of case `name` from `run_cases`; fails the calling test, with
    the rank's traceback, where the case raised."""
    per_rank = results[name]
    for rank, res in enumerate(per_rank):
        if isinstance(res, dict) and _CASE_ERROR in res:
            pytest.fail(f"case {name!r} failed on rank {rank}:\n{res[_CASE_ERROR]}",
                        pytrace=False)
    return per_rank


def selected(request, argname: str, values) -> list:
    """The `values` of parameter `argname` that this run's tests of the requesting module
    use (after -k and node-id selection), in the given order. For module fixtures that run
    one spawn for all cases: choosing one test starts only its case."""
    wanted = {item.callspec.params[argname] for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec")
              and argname in item.callspec.params}
    return [v for v in values if v in wanted]


@pytest.fixture
def subprocess_env(tmp_path):
    """Environment for launching `meshfit`/torchrun in a subprocess: our package importable,
    torchrun's temporary folders inside the test's tmp_path, one thread per rank, CPU and
    gloo even on a machine with fewer GPUs than ranks."""
    return make_subprocess_env(tmp_path)


def make_subprocess_env(tmp_path) -> dict:
    """`subprocess_env` for fixtures of a wider scope."""
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    env["TMPDIR"] = str(tmp_path)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["MESHFIT_CPU"] = "1"
    return env


@pytest.fixture(autouse=True)
def _hygiene():
    """Fail a test that leaks a process group, torchrun variables, children or threads."""
    env_before = {k: os.environ.get(k) for k in _TORCHRUN_VARS}
    threads_before = {t.ident for t in threading.enumerate()}
    yield
    problems = []
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        problems.append("a process group was left initialised")
    env_after = {k: os.environ.get(k) for k in _TORCHRUN_VARS}
    if env_after != env_before:
        problems.append(f"environment changed: {env_before} -> {env_after}")
        for k, v in env_before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    children = [p for p in mp.active_children()]
    if children:
        problems.append(f"child processes left running: {[p.pid for p in children]}")
    new_threads = [t for t in threading.enumerate() if t.ident not in threads_before
                   and t.is_alive() and not t.daemon]
    for t in new_threads:  # a pool's worker may still be returning from its shutdown
        t.join(timeout=5)  # (transformers' from_pretrained loads with a thread pool)
    leaked = [t.name for t in new_threads if t.is_alive()]
    if leaked:
        problems.append(f"threads left running: {leaked}")
    if problems:
        pytest.fail("; ".join(problems))


def python() -> str:
    return sys.executable


@pytest.fixture
def cli_refusal(capsys, monkeypatch):
    """Call ``meshfit ARGS`` in this process (`meshfit.cli.main.main`) with arguments that
    must be refused before anything starts, and return the refusal's one stderr line.

    Checks what a subprocess run would show: exit code 2 and exactly one line on stderr; and
    what only an in-process call can check: `main` left os.environ as it found it. Starting
    workers (`launch.run`) or training in this process (`trainer.train`) is replaced by an
    AssertionError, so arguments that are wrongly accepted fail the test instead of training.
    MESHFIT_CPU=1 as in `subprocess_env`: device checks see the CPU even beside GPUs.
    The hygiene fixture checks for process groups, children and threads left behind."""
    import meshfit.cli.main as cli
    from meshfit import launch
    from meshfit.train import trainer

    def started(*args, **kwargs):
        raise AssertionError(f"the arguments were accepted: it would have started {args}")

    monkeypatch.setattr(launch, "run", started)
    monkeypatch.setattr(trainer, "train", started)
    monkeypatch.setenv("MESHFIT_CPU", "1")

    def call(*argv: str) -> str:
        env = dict(os.environ)
        capsys.readouterr()  # drop anything printed before
        rc = cli.main(list(argv))
        captured = capsys.readouterr()
        # (torch's inductor sets its cache folder on first import, whichever test imports it
        # first: not meshfit's doing)
        after = {k: v for k, v in os.environ.items()
                 if not (k == "TORCHINDUCTOR_CACHE_DIR" and k not in env)}
        assert after == env, "meshfit's main() changed os.environ"
        assert rc == 2, (rc, captured.out, captured.err)
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1, captured.err
        return lines[0]

    return call


@pytest.fixture
def one_thread():
    """One intra-op thread for tests of tiny models: two spin-waiting OpenMP threads slow them
    several-fold when other processes share the 2 cores. Use with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
