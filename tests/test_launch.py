"""`meshfit launch` against plain torchrun, a simulated 2-node job, and bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshfit.train.launch import free_port

SCRIPT = Path(__file__).parent / "scripts" / "ddp_steps.py"
MESHFIT = [sys.executable, "-m", "meshfit.train.cli"]


def _run(cmd, env, timeout=120):
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def _results(folder: Path, world: int):
    out = [torch.load(folder / f"rank{r}.pt") for r in range(world)]
    assert [o["rank"] for o in out] == list(range(world))
    assert all(o["world"] == world for o in out)
    return out


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The script under `meshfit launch --nproc 2` (shared by the comparisons below)."""
    import os
    from conftest import REPO

    tmp = tmp_path_factory.mktemp("launch")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=str(REPO / "src"), TMPDIR=str(tmp), OMP_NUM_THREADS="1",
               MESHFIT_CPU="1")
    out = tmp / "meshfit"
    out.mkdir()
    _run([*MESHFIT, "launch", "--nproc", "2", str(SCRIPT), str(out)], env)
    return _results(out, 2)


def test_meshfit_launch_equals_torchrun(launched, tmp_path, subprocess_env):
    out = tmp_path / "torchrun"
    out.mkdir()
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
          "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(SCRIPT), str(out)],
         subprocess_env)
    torchrun = _results(out, 2)
    assert _same(launched[0], launched[1])  # DDP replicas agree
    assert _same(launched[0], torchrun[0]) and _same(launched[1], torchrun[1])


def test_two_nodes_on_one_machine_train_like_one_node(launched, tmp_path, subprocess_env):
    out = tmp_path / "nodes"
    out.mkdir()
    port = str(free_port())
    nodes = [subprocess.Popen([*MESHFIT, "launch", "--nnodes", "2", "--node-rank", str(r),
                               "--nproc", "1", "--master-addr", "127.0.0.1", "--master-port",
                               port, str(SCRIPT), str(out)], env=subprocess_env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    try:
        logs = [n.communicate(timeout=120)[0] for n in nodes]
    finally:
        for n in nodes:  # only the processes this test started
            if n.poll() is None:
                n.kill()
    assert [n.returncode for n in nodes] == [0, 0], "\n".join(logs)
    two_nodes = _results(out, 2)
    assert _same(two_nodes[0], launched[0]) and _same(two_nodes[1], launched[1])


def test_failing_worker_gives_nonzero_exit(tmp_path, subprocess_env):
    bad = tmp_path / "fail.py"
    bad.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    proc = subprocess.run([*MESHFIT, "launch", "--nproc", "2", str(bad)], env=subprocess_env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "worker(s) failed" in proc.stderr


def test_max_restarts_restarts_the_group_after_a_failure(tmp_path, subprocess_env):
    """Rank 1 fails once; with --max-restarts 1 the agent restarts both workers and the
    second attempt's process group forms and finishes (torchrun's elastic behaviour)."""
    flaky = tmp_path / "flaky.py"
    # The first attempt forms no process group (rank 0 waits to be stopped by the agent), so
    # the restarted group's rendezvous cannot meet a half-initialised first one.
    flaky.write_text(
        "import os, sys, time, torch.distributed as dist\n"
        "rank = int(os.environ['RANK'])\n"
        "attempt = os.environ['TORCHELASTIC_RESTART_COUNT']\n"
        "if attempt == '0':\n"
        "    if rank == 1:\n"
        "        sys.exit(5)\n"
        "    time.sleep(100)\n"
        "dist.init_process_group('gloo')\n"
        "dist.barrier()\n"
        f"open(os.path.join({str(tmp_path)!r}, f'done{{rank}}-{{attempt}}'), 'w').close()\n"
        "dist.destroy_process_group()\n")
    proc = subprocess.run([*MESHFIT, "launch", "--nproc", "2", "--max-restarts", "1", str(flaky)],
                          env=subprocess_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.glob("done*")) == ["done0-1", "done1-1"]


@pytest.mark.parametrize("args,match", [
    (["--gpus", "7", "--nproc", "1"], "--gpus names device(s) 7"),
    (["--gpus", "a,b"], "--gpus='a,b' must be a comma-separated list"),
    (["--nproc", "0"], "--nproc=0 must be >= 1"),
    (["--nnodes", "2", "--node-rank", "2", "--master-port", "1234"], "--node-rank=2 must be in"),
    (["--nnodes", "2"], "--master-port is required"),
])
def test_bad_launch_arguments_fail_before_starting(args, match, tmp_path, cli_refusal):
    marker = tmp_path / "started"
    script = tmp_path / "s.py"
    script.write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    line = cli_refusal("launch", *args, str(script))
    assert match in line, line
    assert not marker.exists()  # no process was started


def test_gpu_environment_orders_devices():
    from meshfit.train.launch import gpu_environment

    env = gpu_environment((2, 0), nproc=2, available=4)
    assert env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "2,0"}
    with pytest.raises(ValueError, match="--nproc=3 is more than the 2 device"):
        gpu_environment((0, 1), nproc=3, available=4)
