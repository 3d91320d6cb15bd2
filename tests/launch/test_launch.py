"""`meshfit launch` against plain torchrun, a simulated 2-node job, and bad input."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from meshfit.distributed.spawn import free_port

SCRIPT = Path(__file__).parent / "scripts" / "ddp_steps.py"
MESHFIT = [sys.executable, "-m", "meshfit"]


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
        "from meshfit.distributed.settle import settle_all\n"
        "settle_all()\n"  # a clean teardown on gloo (meshfit.distributed.settle)
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
    from meshfit.launch import gpu_environment

    env = gpu_environment((2, 0), nproc=2, available=4)
    assert env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "2,0"}
    with pytest.raises(ValueError, match="--nproc=3 is more than the 2 device"):
        gpu_environment((0, 1), nproc=3, available=4)


# ------------------------------------------------------------ accelerate launch's flags, SLURM
# In-process: argument mapping, the node-list parser, SLURM variables -> launch settings and
# the refusals; one real 2-process launch with accelerate's flags at the end.

def _resolve(args, environ=None):
    from meshfit import launch
    from meshfit.cli import launch as cli

    ns = cli._launch_parser().parse_args([*args, "train.py"])
    return launch.config_from_args(ns, {} if environ is None else environ)


@pytest.fixture
def no_slurm_env(monkeypatch):
    """This process's environment without SLURM's or torchrun's rendezvous variables (the
    suite may itself run inside a SLURM job)."""
    import os

    for name in list(os.environ):
        if name.startswith("SLURM_") or name in ("MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.delenv(name)
    return monkeypatch


@pytest.mark.parametrize("args,expected,env", [
    # accelerate's --num_processes is the total over the machines
    (["--num_processes", "4", "--num_machines", "2", "--machine_rank", "1",
      "--main_process_ip", "10.0.0.1", "--main_process_port", "29500"],
     dict(nproc=2, nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29500), {}),
    (["--num-processes=3"], dict(nproc=3, nnodes=1, master_addr="127.0.0.1", master_port=None),
     {}),  # the hyphen spelling, as accelerate accepts
    (["--num_processes", "2", "--main_process_port", "0"], dict(nproc=2, master_port=None), {}),
    (["--num_processes", "2", "--cpu", "--mixed_precision", "bf16"], dict(nproc=2),
     {"ACCELERATE_MIXED_PRECISION": "bf16", "ACCELERATE_USE_CPU": "True", "MESHFIT_CPU": "1"}),
    (["--mixed_precision", "no"], dict(nproc=1), {"ACCELERATE_MIXED_PRECISION": "no"}),
    (["--mixed_precision", "fp8"], dict(nproc=1), {"ACCELERATE_MIXED_PRECISION": "fp8"}),
    (["--gpu_ids", "all"], dict(gpus=None), {}),
    # the same setting given both ways, with the same value, is fine
    (["--nproc", "2", "--num_processes", "4", "--num_machines", "2", "--master-port", "7",
      "--main_process_port", "7"], dict(nproc=2, nnodes=2, master_port=7), {}),
])
def test_accelerate_flags_map_onto_launch_settings(args, expected, env):
    cfg, worker_env, notes = _resolve(args)
    assert {k: getattr(cfg, k) for k in expected} == expected
    assert worker_env == env and notes == []


@pytest.mark.parametrize("text,hosts", [
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("n1,n2", ["n1", "n2"]),
    ("gpu[8-10]", ["gpu8", "gpu9", "gpu10"]),  # no padding: the lower bound's width
    ("gpu[08-10]", ["gpu08", "gpu09", "gpu10"]),
    ("node[1]", ["node1"]),
    ("a[1-2]-ib[0-1]", ["a1-ib0", "a1-ib1", "a2-ib0", "a2-ib1"]),  # left bracket outermost
    ("login,c[001-002]-gpu,x.example.org", ["login", "c001-gpu", "c002-gpu", "x.example.org"]),
    (" node[1,3-4] ", ["node1", "node3", "node4"]),
])
def test_slurm_node_list_is_expanded_in_python(text, hosts):
    from meshfit.launch import expand_nodelist

    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("text,match", [
    ("node[01-03", "'[' without ']'"), ("node]1", "']' without '['"),
    ("node[[1-2]]", "nested '['"), ("node[3-1]", "runs backwards"),
    ("node[a-c]", "is not a number"), ("a,,b", "empty host name"),
    ("node[1-99999999]", "longer than"),
])
def test_bad_slurm_node_lists_are_one_line_errors(text, match):
    from meshfit.launch import expand_nodelist

    with pytest.raises(ValueError) as err:
        expand_nodelist(text)
    assert match in str(err.value) and "SLURM_JOB_NODELIST" in str(err.value)
    assert "\n" not in str(err.value)


def test_slurm_tasks_per_node_counts():
    from meshfit.launch import expand_tasks_per_node

    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("8") == [8]
    with pytest.raises(ValueError, match="is not SLURM's form"):
        expand_tasks_per_node("2(x),1")


_STEP = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_JOB_NUM_NODES": "4",
         "SLURM_JOB_NODELIST": "node[01-03,07]", "SLURM_STEP_NUM_NODES": "4",
         "SLURM_STEP_NODELIST": "node[01-03,07]", "SLURM_NODEID": "2",
         "SLURM_STEP_TASKS_PER_NODE": "1(x4)", "SLURM_GPUS_ON_NODE": "8",
         "SLURM_NTASKS_PER_NODE": "1"}


@pytest.mark.parametrize("args,environ,expected", [
    # `srun --ntasks-per-node=1 meshfit launch` on 4 nodes with 8 GPUs each
    ([], _STEP, dict(nproc=8, nnodes=4, node_rank=2, master_addr="node01", master_port=14242)),
    # flags win, field by field; accelerate's total divides by SLURM's node count
    (["--nproc", "2", "--master-port", "1234"], _STEP,
     dict(nproc=2, nnodes=4, node_rank=2, master_addr="node01", master_port=1234)),
    (["--num_processes", "16"], _STEP, dict(nproc=4, nnodes=4)),
    # MASTER_ADDR / MASTER_PORT set by the batch script win over the derived ones
    ([], {**_STEP, "MASTER_ADDR": "10.1.0.1", "MASTER_PORT": "23456"},
     dict(master_addr="10.1.0.1", master_port=23456)),
    # --cpu: one process per task, not per GPU
    (["--cpu"], {**_STEP, "SLURM_NTASKS_PER_NODE": "3"}, dict(nproc=3)),
    # the batch script itself on a one-node job: tasks per node, loopback and a free port
    ([], {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "c17",
          "SLURM_NTASKS_PER_NODE": "4", "SLURM_NODEID": "0"},
     dict(nproc=4, nnodes=1, node_rank=0, master_addr="127.0.0.1", master_port=None)),
    # older variable names only; a non-numeric job id still gives one port for every node
    ([], {"SLURM_JOBID": "a1", "SLURM_STEPID": "3", "SLURM_NNODES": "2",
          "SLURM_NODELIST": "x[1-2]", "SLURM_NODEID": "1"},
     dict(nproc=1, nnodes=2, node_rank=1, master_addr="x1")),
    (["--no-slurm"], _STEP, dict(nproc=1, nnodes=1, node_rank=0, master_addr="127.0.0.1")),
])
def test_slurm_variables_give_the_launch_settings(args, environ, expected):
    cfg, _, notes = _resolve(args, environ)
    assert {k: getattr(cfg, k) for k in expected} == expected
    if "--no-slurm" in args:
        assert notes == []
    else:
        assert len(notes) == 1 and notes[0].startswith("SLURM job ")


def test_slurm_derivation_is_printed_before_launching(no_slurm_env, tmp_path, capsys):
    """`meshfit launch` with no flags in an srun step: what it took from SLURM, one line."""
    import meshfit.cli.main as cli
    from meshfit import launch

    for k, v in _STEP.items():
        no_slurm_env.setenv(k, v)
    started = []
    no_slurm_env.setattr(launch, "run", lambda cfg, script, **kw: started.append((cfg, kw)) or 0)
    script = tmp_path / "train.py"
    script.write_text("")
    assert cli.main(["launch", str(script)]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["meshfit launch: SLURM job 4242 step: 4 node(s) (SLURM_STEP_NODELIST="
                   "node[01-03,07]), this is node 2 (SLURM_NODEID), 8 process(es) per node "
                   "(SLURM_GPUS_ON_NODE), rendezvous host node01 (the first host of "
                   "SLURM_STEP_NODELIST), port 14242 (10000 + SLURM job id mod 20000)"]
    (cfg, kw), = started
    assert (cfg.nproc, cfg.nnodes, cfg.node_rank, cfg.master_addr) == (8, 4, 2, "node01")


@pytest.mark.parametrize("args,match", [
    (["--nproc", "2", "--num_processes", "3"],
     "--nproc=2 (processes per node) and --num_processes=3 (3 per node over 1 machine(s)) "
     "disagree"),
    (["--nnodes", "2", "--num_machines", "3"], "--nnodes=2 and --num_machines=3 both set"),
    (["--node-rank", "0", "--machine_rank", "1", "--nnodes", "2"], "--machine_rank=1 both set"),
    (["--master-addr", "a", "--main_process_ip", "b"], "--master-addr=a and --main_process_ip=b"),
    (["--master-port", "5", "--main_process_port", "0"], "--main_process_port=0 (a free port)"),
    (["--gpus", "0", "--gpu_ids", "1"], "--gpus=0 and --gpu_ids=1 both choose the GPUs"),
    (["--gpu_ids", "a"], "--gpu_ids='a' must be a comma-separated list"),
    (["--cpu", "--multi_gpu"], "--cpu and --multi_gpu exclude each other"),
    (["--cpu", "--gpu_ids", "0"], "--cpu runs on the CPU; drop --gpus / --gpu_ids"),
    (["--mixed_precision", "fp32"], "--mixed_precision='fp32' must be one of no, fp16, bf16"),
    (["--num_processes", "3", "--num_machines", "2", "--main_process_port", "9"],
     "--num_processes=3 is the total over all 2 machines"),
    (["--num_processes", "0"], "--num_processes=0 must be >= 1"),
    (["--multi_gpu", "--num_processes", "1"], "--multi_gpu needs at least 2 processes"),
    (["--num_machines", "2", "--main_process_port", "0"], "works on one machine only"),
    (["--num_machines", "2", "--machine_rank", "2", "--main_process_port", "9"],
     "--machine_rank=2 must be in 0..1 (--num_machines=2)"),
])
def test_accelerate_flag_conflicts_are_refused_before_starting(args, match, tmp_path, cli_refusal,
                                                               no_slurm_env):
    script = tmp_path / "s.py"
    script.write_text("")
    line = cli_refusal("launch", *args, str(script))
    assert match in line, line


def test_multi_gpu_without_gpus_is_refused(tmp_path, cli_refusal, no_slurm_env):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA devices")
    script = tmp_path / "s.py"
    script.write_text("")
    line = cli_refusal("launch", "--multi_gpu", "--num_processes", "2", str(script))
    assert "--multi_gpu: this machine has no CUDA devices" in line


@pytest.mark.parametrize("environ,match", [
    ({**_STEP, "SLURM_STEP_TASKS_PER_NODE": "4(x4)"},
     "srun started 4 tasks on this node (SLURM_STEP_TASKS_PER_NODE=4(x4))"),
    ({k: v for k, v in _STEP.items() if k not in ("SLURM_STEP_ID", "SLURM_STEP_NUM_NODES",
                                                  "SLURM_STEP_NODELIST",
                                                  "SLURM_STEP_TASKS_PER_NODE")},
     "this SLURM job has 4 nodes but meshfit was started once, outside srun"),
    ({**_STEP, "SLURM_STEP_NODELIST": "node[01-03"}, "SLURM_STEP_NODELIST='node[01-03'"),
    ({**_STEP, "SLURM_STEP_NODELIST": "node[01-03]"},
     "names 3 host(s) but SLURM_STEP_NUM_NODES=4"),
    ({**_STEP, "SLURM_NODEID": "4"}, "SLURM_NODEID=4 is not below the 4 node(s)"),
    ({**_STEP, "SLURM_GPUS_ON_NODE": "gpu:8"}, "SLURM_GPUS_ON_NODE='gpu:8' is not a count"),
])
def test_inconsistent_slurm_jobs_are_refused_before_starting(environ, match, tmp_path,
                                                             cli_refusal, no_slurm_env):
    for k, v in environ.items():
        no_slurm_env.setenv(k, v)
    script = tmp_path / "s.py"
    script.write_text("")
    line = cli_refusal("launch", str(script))
    assert match in line, line


ACCELERATE_STYLE = """
import json, os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
keys = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "ACCELERATE_MIXED_PRECISION",
        "ACCELERATE_USE_CPU", "MESHFIT_CPU")
out = {k: os.environ.get(k) for k in keys}
out["sum"] = t.item()
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump(out, f)
from meshfit.distributed.settle import settle_all
settle_all()  # a clean teardown on gloo (meshfit.distributed.settle)
dist.destroy_process_group()
"""


def test_accelerate_style_launch_on_loopback(tmp_path, subprocess_env):
    """The one real launch: accelerate's flags start 2 gloo processes on 127.0.0.1 that see
    the precision and CPU choice as Accelerate passes them."""
    import json

    script = tmp_path / "acc.py"
    script.write_text(ACCELERATE_STYLE)
    env = {k: v for k, v in subprocess_env.items()
           if not k.startswith("SLURM_") and k not in ("MESHFIT_CPU", "ACCELERATE_USE_CPU",
                                                         "ACCELERATE_MIXED_PRECISION")}
    _run([*MESHFIT, "launch", "--num_processes", "2", "--num_machines", "1", "--machine_rank",
          "0", "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port()),
          "--mixed_precision", "bf16", "--cpu", str(script), str(tmp_path)], env, timeout=60)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, s in enumerate(seen):
        assert s == {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                     "MASTER_ADDR": "127.0.0.1", "ACCELERATE_MIXED_PRECISION": "bf16",
                     "ACCELERATE_USE_CPU": "True", "MESHFIT_CPU": "1", "sum": 3.0}


# ------------------------------------------------------ the job's processes end with it
# Workers that import nothing heavy: each writes its PID and waits to be ended.
SLEEPER = """
import os, pathlib, sys, time
pathlib.Path(sys.argv[1], f"pid{os.environ['RANK']}").write_text(str(os.getpid()))
time.sleep(120)
"""


def _start_sleepers(tmp_path, env, nproc=2, extra=()):
    import time

    import psutil

    script = tmp_path / "sleep.py"
    script.write_text(SLEEPER)
    proc = subprocess.Popen([*MESHFIT, "launch", "--nproc", str(nproc), *extra, str(script),
                             str(tmp_path)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60  # the launcher imports torch (~5 s on a loaded machine)
    files = [tmp_path / f"pid{r}" for r in range(nproc)]
    while not all(f.exists() and f.read_text() for f in files) and proc.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(f.exists() for f in files), proc.communicate(timeout=30)
    workers = [psutil.Process(int(f.read_text())) for f in files]
    assert all(w.is_running() for w in workers)
    return proc, workers


def _gone(workers, seconds: float) -> list:
    """The workers still running after `seconds` (psutil checks the PID and its start time,
    so a reused PID does not count)."""
    import psutil

    _, alive = psutil.wait_procs(workers, timeout=seconds)
    return [w for w in alive if w.status() != psutil.STATUS_ZOMBIE]


def _end(proc, workers):
    """Only what this test started, by PID."""
    for p in workers:
        if p.is_running():
            p.kill()
    if proc.poll() is None:
        proc.kill()
    proc.communicate()


def test_workers_die_with_a_killed_launcher(tmp_path, subprocess_env):
    """kill -9 of the launcher (its workers are in sessions of their own, so nothing else
    reaches them): the kernel's parent-death signal ends them."""
    import signal

    proc, workers = _start_sleepers(tmp_path, subprocess_env, extra=["--max-restarts", "1"])
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        # bound: the kernel signals at once; 30 s covers a machine under heavy load
        assert _gone(workers, 30) == []
    finally:
        _end(proc, workers)


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_ctrl_c_and_sigterm_end_the_job_with_one_line(sig, tmp_path, subprocess_env):
    import signal

    proc, workers = _start_sleepers(tmp_path, subprocess_env)
    try:
        proc.send_signal(getattr(signal, sig))
        _, err = proc.communicate(timeout=60)  # bound: the agent waits up to 30 s per worker
        assert _gone(workers, 5) == []
    finally:
        _end(proc, workers)
    assert proc.returncode == 128 + getattr(signal, sig)
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [f"meshfit launch: stopped by {sig}; the workers were ended"], err


FIRST_FAILURE = """
import os, sys, time
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    if os.environ["RANK"] == "1":
        raise RuntimeError("rank one broke: the data shard is missing")
    time.sleep(120)  # ended by the agent once rank 1 has failed

main()
"""


def test_failure_summary_names_the_rank_that_failed_first(tmp_path, subprocess_env):
    """Rank 1 fails; rank 0 is then stopped by the agent (exit code -15) and also counts as
    failed: the summary names rank 1, its exit code and its error's last lines (from
    torch's error file, written by ``@record``)."""
    script = tmp_path / "first.py"
    script.write_text(FIRST_FAILURE)
    proc = subprocess.run([*MESHFIT, "launch", "--nproc", "2", str(script)],
                          env=subprocess_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    ours = [line for line in proc.stderr.splitlines() if line.startswith("meshfit launch:")]
    assert len(ours) == 1, proc.stderr
    assert ours[0].startswith("meshfit launch: 2 worker(s) failed; first: rank 1 exit code 1: ")
    assert "RuntimeError: rank one broke: the data shard is missing" in ours[0]


PEER_FAILS = """
import time
import torch, torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
if dist.get_rank() == 1:
    time.sleep(0.5)
    raise RuntimeError("rank one broke")
dist.all_reduce(torch.ones(1))  # rank 0 waits here when rank 1's process ends
"""


def test_a_rank_whose_peer_died_says_so_in_one_line(tmp_path, subprocess_env):
    """Rank 1 fails while rank 0 waits in a collective: rank 1's traceback is its own error,
    kept; rank 0's, which only says that its peer is gone (gloo's "Connection closed by
    peer", a dozen lines), is one line naming that (`meshfit.launch.torchrun.run_as_main`),
    beside the launcher's summary."""
    script = tmp_path / "peer.py"
    script.write_text(PEER_FAILS)
    proc = subprocess.run([*MESHFIT, "launch", "--nproc", "2", str(script)],
                          env=subprocess_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.count("Traceback") == 1 and "[rank0]" not in proc.stderr, proc.stderr
    assert "RuntimeError: rank one broke" in proc.stderr  # rank 1's own, from its script
    assert f'File "{script}", line 9, in <module>' in proc.stderr  # its first frame
    assert re.search(r"^meshfit launch: rank 0 stopped: another rank of the job is gone "
                     r"\(Connection (closed|reset) by peer", proc.stderr, flags=re.M), proc.stderr


OUT_OF_MEMORY = """
import os, sys
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main():
    if os.environ["RANK"] == "1":
        with open(sys.argv[1] + "/cgroup.procs", "w") as fh:  # a 256 MiB memory cgroup
            fh.write(str(os.getpid()))
        hog = bytearray(1 << 30)  # 1 GiB, every page touched: the kernel ends this process
        for i in range(0, len(hog), 4096):
            hog[i] = 1
    import time
    time.sleep(120)  # ended by the agent once rank 1 has failed

main()
"""


def test_a_worker_ended_by_the_out_of_memory_killer_is_said_to_be(tmp_path, subprocess_env):
    """Rank 1 runs out of memory in a memory cgroup of its own (a container's limit, as the
    cgroup v1 hierarchy of this machine allows root to make): the kernel kills it with
    SIGKILL, and the summary says the out-of-memory killer did, not only "exit code -9"."""
    from meshfit.launch.torchrun import oom_kills

    root = Path("/sys/fs/cgroup/memory")
    if oom_kills() is None or not os.access(root, os.W_OK):
        pytest.skip("no writable memory cgroup here; test_failure_summary_on_sigkill covers "
                    "the summary's logic")
    group = root / f"meshfit-test-{os.getpid()}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(256 * 2**20))
        script = tmp_path / "oom.py"
        script.write_text(OUT_OF_MEMORY)
        proc = subprocess.run([*MESHFIT, "launch", "--nproc", "2", str(script), str(group)],
                              env=subprocess_env, capture_output=True, text=True, timeout=120)
    finally:
        group.rmdir()  # empty once its process is gone
    assert proc.returncode == 1
    ours = [line for line in proc.stderr.splitlines() if line.startswith("meshfit launch:")]
    assert len(ours) == 1, proc.stderr
    assert "first: rank 1 exit code -9 (SIGKILL): the kernel's out-of-memory killer ended it" \
        in ours[0], ours[0]


def test_failure_summary_on_sigkill(monkeypatch):
    """The summary's logic: SIGKILL with the out-of-memory count risen says so; without it,
    a hint; another failure is left as it is."""
    from types import SimpleNamespace

    from meshfit.launch import torchrun

    def failure(code):
        return SimpleNamespace(pid=7, exitcode=code, timestamp=1, error_file="",
                               message="", signal_name=lambda: "SIGKILL" if code == -9 else "",
                               error_file_data={})

    monkeypatch.setattr(torchrun, "_error_tail", lambda f: "")
    monkeypatch.setattr(torchrun, "oom_kills", lambda: 4)
    said = torchrun.failure_summary({1: failure(-9)}, {7}, oom_before=3)
    assert said.startswith("1 worker(s) failed; first: rank 1 exit code -9 (SIGKILL): the "
                           "kernel's out-of-memory killer ended it (oom_kill count 3 -> 4;")
    said = torchrun.failure_summary({1: failure(-9)}, {7}, oom_before=4)
    assert said.endswith("exit code -9 (SIGKILL): SIGKILL: the kernel's out-of-memory killer or "
                         "a kill -9; `dmesg` tells which")
    assert torchrun.failure_summary({1: failure(3)}, {7}, oom_before=0) == \
        "1 worker(s) failed; first: rank 1 exit code 3"


LEAVES_CHILDREN = """
import os, subprocess, sys, time

out, rank = sys.argv[1], os.environ["RANK"]
pids = [subprocess.Popen(["sleep", "45"]).pid]  # a child process, never waited for
pid = os.fork()  # a forked copy that outlives the worker
if pid == 0:
    time.sleep(45)
    os._exit(0)
pids.append(pid)
r, w = os.pipe()
first = os.fork()  # a daemon: double fork and a session of its own
if first == 0:
    os.setsid()
    if os.fork() == 0:
        os.write(w, str(os.getpid()).encode())
        time.sleep(45)
        os._exit(0)
    os._exit(0)
os.waitpid(first, 0)
pids.append(int(os.read(r, 32)))
with open(f"{out}/pids-{rank}", "w") as fh:
    fh.write(" ".join(map(str, pids)))
"""


def test_what_a_job_starts_ends_with_the_job(tmp_path, subprocess_env):
    """Each worker starts a child with subprocess.Popen, an os.fork copy and a double-forked
    setsid daemon, then returns: the launcher (a child subreaper) ends all six when the job
    is over, instead of leaving them running as torchrun does."""
    import psutil

    script = tmp_path / "leaves.py"
    script.write_text(LEAVES_CHILDREN)
    log = tmp_path / "log"
    with log.open("w") as out:  # a file, not a pipe: a child left behind would hold a pipe
        proc = subprocess.run([*MESHFIT, "launch", "--nproc", "2", str(script), str(tmp_path)],
                              env=subprocess_env, stdout=out, stderr=out, timeout=120)
    assert proc.returncode == 0, log.read_text()
    pids = [int(p) for rank in (0, 1) for p in (tmp_path / f"pids-{rank}").read_text().split()]
    assert len(pids) == 6
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    for pid in alive:  # (clean up before failing: they are ours)
        os.kill(pid, 9)
    assert alive == []


def test_master_port_in_use_is_refused_before_starting(tmp_path, cli_refusal):
    """Also with --max-restarts, where the agent used to wait on the port forever."""
    import socket

    script = tmp_path / "s.py"
    script.write_text("")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        for extra in ([], ["--max-restarts", "1"]):
            line = cli_refusal("launch", "--nproc", "2", *extra, "--master-port", port,
                               str(script))
            assert f"--master-port={port}: 127.0.0.1:{port} is not free" in line, line
        line = cli_refusal("train", "--nproc", "2", "--max-restarts", "1", "--master-port", port,
                           "--out", str(tmp_path / "run"))
        assert f"--master-port={port}: 127.0.0.1:{port} is not free" in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("environ,match", [
    ({"WORLD_SIZE": "2", "RANK": "0"}, "RANK=0, WORLD_SIZE=2 set in the environment"),
    ({"LOCAL_RANK": "1"}, "LOCAL_RANK=1 set in the environment"),
])
def test_inherited_rank_variables_are_refused_by_meshfit_train(environ, match, tmp_path,
                                                                cli_refusal, monkeypatch):
    """`meshfit train --nproc 1` trains in this process: WORLD_SIZE=2 left in the environment
    used to make it wait for a second rank until the process-group timeout."""
    for k, v in environ.items():
        monkeypatch.setenv(k, v)
    line = cli_refusal("train", "--nproc", "1", "--train.steps=2", "--out",
                       str(tmp_path / "run"))
    assert match in line and "meshfit train starts its own processes" in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("environ,match", [
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 is set but RANK is not"),
    ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK=2 is not in 0..1 (WORLD_SIZE=2)"),
    ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
     "LOCAL_RANK=2, LOCAL_WORLD_SIZE=2 do not fit WORLD_SIZE=2"),
    ({"WORLD_SIZE": "2", "RANK": "1"}, "WORLD_SIZE=2 needs MASTER_ADDR and MASTER_PORT"),
    ({"WORLD_SIZE": "0", "RANK": "0"}, "WORLD_SIZE=0 must be >= 1"),
])
def test_inconsistent_launcher_variables_are_refused_by_init(environ, match, monkeypatch):
    from meshfit.distributed import init

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for k, v in environ.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError) as err:
        init(backend="gloo", cpu=True)
    assert match in str(err.value) and "\n" not in str(err.value)


def test_a_rank_that_never_joins_is_a_bounded_one_line_error(monkeypatch):
    """Rank 0 of 2 alone: init waits timeout_s for rank 1, not forever (nor the 30 min
    default), and says so in one line."""
    from meshfit.distributed import init

    for k, v in dict(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2",
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(k, v)
    with pytest.raises(TimeoutError) as err:
        init(backend="gloo", timeout_s=1, cpu=True)
    assert "rank 0: the 2 ranks did not all join the process group within timeout_s=1 s" \
        in str(err.value) and "\n" not in str(err.value)


def test_help_and_refusals_do_not_import_torch(tmp_path):
    """`meshfit --help`, `meshfit train --help`, `meshfit launch --help` and refused arguments
    (launch flags, a config value, an --out that is a file) are answered before torch is
    imported (importing it takes seconds)."""
    (tmp_path / "file").write_text("")
    code = ("import sys, contextlib, io\n"
            "import meshfit.cli.main as cli\n"
            "with contextlib.redirect_stdout(io.StringIO()), "
            "contextlib.redirect_stderr(io.StringIO()):\n"
            "    for argv in (['--help'], ['train', '--help'], ['launch', '--help'],\n"
            "                 ['train', '--nproc', '0'], ['launch', '--nproc', '0', 'x.py'],\n"
            "                 ['train', '--train.steps=abc'],\n"
            f"                 ['train', '--out', {str(tmp_path / 'file')!r}]):\n"
            "        try:\n"
            "            assert cli.main(argv) in (0, 2), argv\n"
            "        except SystemExit:\n"
            "            pass\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    from conftest import REPO

    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"},
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


def test_train_on_two_nodes_shares_one_run_folder(tmp_path, subprocess_env):
    """Two `meshfit train` launchers as nodes 0 and 1 of one job, one --out (a shared file
    system): node 0 claims and locks the folder, node 1 joins its run instead of refusing a
    folder that holds a run or a lock; one metrics file, written by global rank 0."""
    out = tmp_path / "run"
    port = str(free_port())
    small = ["--train.steps=2", "--train.eval_every=0", "--train.log_every=1",
             "--train.global_batch_size=4", "--train.micro_batch_size=2",
             "--train.seq_len=32", "--train.eval_batches=1", "--model.n_layer=1",
             f"--data.cache_dir={tmp_path / 'cache'}"]
    nodes = []
    for rank in range(2):
        nodes.append(subprocess.Popen(
            [*MESHFIT, "train", "--nnodes", "2", "--node-rank", str(rank), "--nproc", "1",
             "--master-addr", "127.0.0.1", "--master-port", port, "--out", str(out), *small],
            env=subprocess_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        if rank == 0:  # node 1 comes once node 0 holds the folder, as on a real cluster
            deadline = time.monotonic() + 60
            while not (out / "config.toml").exists() and time.monotonic() < deadline:
                time.sleep(0.1)
    try:
        logs = [n.communicate(timeout=240)[0] for n in nodes]
    finally:
        for n in nodes:  # only the processes this test started
            if n.poll() is None:
                n.kill()
    assert [n.returncode for n in nodes] == [0, 0], "\n".join(logs)
    steps = [json.loads(x).get("step") for x in (out / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(x)]
    assert steps == [1, 2]


def test_meshfit_warnings_print_as_one_line(capsys, monkeypatch):
    """The `meshfit` command shows meshfit's own warnings (e.g. a token cache rebuilt after
    failing its checksum) as one prefixed line; other libraries' keep Python's format."""
    import warnings

    from meshfit.data import cache
    import meshfit.cli.main as cli

    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)  # restored after
    cli._one_line_warnings("meshfit train")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn_explicit("data: token cache x.bin failed\n its checksum", UserWarning,
                               filename=cache.__file__, lineno=1)
        warnings.warn_explicit("elsewhere", UserWarning, filename="/elsewhere/lib.py",
                               lineno=3)
    err = capsys.readouterr().err
    assert "meshfit train: warning: data: token cache x.bin failed its checksum\n" in err
    assert "elsewhere" not in err  # left to Python's (here pytest's) own warning display


@pytest.mark.parametrize("name, value, wanted", [
    ("LOGLEVEL", "LOUD", "LOGLEVEL='LOUD' in the environment (torchrun's log level) is not a "
                         "logging level"),
    ("OMP_NUM_THREADS", "abc", "OMP_NUM_THREADS='abc' in the environment is not a number of "
                               "threads"),
    ("OMP_NUM_THREADS", "0", "OMP_NUM_THREADS='0'"),
])
@pytest.mark.parametrize("command", ["train", "launch"])
def test_bad_environment_variables_are_one_line_before_anything(name, value, wanted, command,
                                                                tmp_path, monkeypatch, capsys):
    from meshfit.cli.launch import check_environment
    from meshfit.cli.main import main

    for good in ({"LOGLEVEL": "debug"}, {"LOGLEVEL": "10"}, {"OMP_NUM_THREADS": "4,2"}):
        check_environment(good)
    monkeypatch.setenv(name, value)
    script = tmp_path / "s.py"
    script.write_text("")
    argv = (["train", "--nproc", "1", "--out", str(tmp_path / "run")] if command == "train"
            else ["launch", "--nproc", "1", str(script)])
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and wanted in err[0], err
    assert not (tmp_path / "run").exists()
