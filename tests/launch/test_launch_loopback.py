"""A single-node job is reachable on loopback only: every socket the launcher and its workers
listen on (the rendezvous store, gloo's pairs) is bound to 127.0.0.0/8. PyTorch's TCPStore
alone would listen on every interface; `meshfit.launch.loopback_stores` binds it."""

from __future__ import annotations

import ipaddress
import subprocess
import sys
import time

import psutil
import pytest

SCRIPT = """
import os, sys, time, pathlib, torch.distributed as dist
from meshfit.distributed import init
if sys.argv[3] == "fail-first" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    if os.environ["RANK"] == "1":
        sys.exit(3)  # the first attempt fails; the restarted group is the one checked
    time.sleep(60)  # ended by the agent
env = init()
dist.barrier()
if env.rank == 0:
    pathlib.Path(sys.argv[1]).write_text("up")
pathlib.Path(sys.argv[2]).exists() or time.sleep(0)
deadline = time.time() + 60
while not pathlib.Path(sys.argv[2]).exists() and time.time() < deadline:
    time.sleep(0.05)
from meshfit.distributed.settle import settle_all
settle_all()  # a clean teardown on gloo (meshfit.distributed.settle)
dist.destroy_process_group()
"""


def _listening(pid: int) -> list[str]:
    found = []
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            found += [c.laddr.ip for c in proc.net_connections(kind="inet")
                      if c.status == psutil.CONN_LISTEN]
        except psutil.Error:
            continue
    return found


@pytest.mark.parametrize("extra,mode", [([], "once"), (["--max-restarts", "1"], "fail-first")],
                         ids=["static", "restarted"])
def test_single_node_job_listens_on_loopback_only(extra, mode, tmp_path, subprocess_env):
    """Also after a restart: the failed attempt's store and the new one's."""
    script, up, done = tmp_path / "job.py", tmp_path / "up", tmp_path / "done"
    script.write_text(SCRIPT)
    proc = subprocess.Popen([sys.executable, "-m", "meshfit", "launch", "--nproc", "2",
                             *extra, str(script), str(up), str(done), mode], env=subprocess_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not up.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert up.exists(), proc.communicate(timeout=30)
        addresses = _listening(proc.pid)
        done.write_text("done")
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # our own child, by its PID
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    if mode == "fail-first":
        assert "first: rank 1 exit code 3; restarting the group (1 of 1)" in err, err
    assert addresses, "no listening socket found: the check would prove nothing"
    assert all(ipaddress.ip_address(a).is_loopback for a in addresses), addresses
