"""A job whose workers promise to mark that they finished (`meshfit train`'s,
`meshfit.launch.finished`) succeeds only when each did: a worker that leaves with exit code 0
before its mark (ended by code it ran, in a way Python does not see) fails the job in one
line naming its local rank."""

from __future__ import annotations

import subprocess
import sys

WORKER = """
import ctypes, os
from meshfit.launch.finished import mark_finished

if os.environ["LOCAL_RANK"] == "1":
    ctypes.CDLL(None)._exit(0)  # C's _exit: no Python code can stop or see it
mark_finished()
"""

LAUNCHER = """
import sys
from meshfit.launch import LaunchConfig, run

sys.exit(run(LaunchConfig(nproc=2), [sys.argv[1]], prog="meshfit train",
             finished_marks=True))
"""


def test_a_worker_that_exits_0_without_finishing_fails_the_job(tmp_path, subprocess_env):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    proc = subprocess.run([sys.executable, "-c", LAUNCHER, str(script)], env=subprocess_env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "meshfit train: the worker(s) of local rank 1 exited with code 0 but did not finish the "
        "run: something it ran ended the process early (os._exit, an exec, a C library's exit); "
        "the run is not complete"]
    assert not list(tmp_path.glob("meshfit-finished-*"))  # the marks' folder is removed
