"""A job whose workers promise to mark that they finished (`meshfit train`'s,
`meshfit.launch.finished`) succeeds only when each did: a worker that leaves with exit code 0
before its mark (ended by code it ran, in a way Python does not see) fails the job in one
line naming its local rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


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


# ------------------------------------------------------------ the command's own process
ENDERS = """
import ctypes

def c_exit(vocab_size=256):
    ctypes.CDLL(None).exit(0)  # C's exit: Python's own os._exit guard never sees it

"""

SUPERVISED = """
import os, pathlib, sys, time
from meshfit.launch.finished import report_end, supervise

code = supervise("meshfit test")  # (what `meshfit train` calls first; no torch here)
if code is not None:
    sys.exit(code)
if sys.argv[1] == "killed":
    os.kill(os.getpid(), 9)  # as the kernel's out-of-memory killer would
pathlib.Path(sys.argv[2]).write_text(str(os.getpid()))
time.sleep(120)
report_end()
"""


def test_a_command_that_a_c_library_ends_with_code_0_fails(tmp_path, subprocess_env):
    """`meshfit train` whose model factory calls C's exit(0) while the model is built (no
    Python code in that process can stop or see it): before, the command exited 0 with no
    output, having trained nothing; now it runs in a child the meshfit process waits on, and
    a child that leaves with code 0 without having ended through Python fails the command in
    one line, exit code 1."""
    (tmp_path / "enders.py").write_text(ENDERS)
    env = dict(subprocess_env, PYTHONPATH=f"{tmp_path}{os.pathsep}{subprocess_env['PYTHONPATH']}")
    proc = subprocess.run([sys.executable, "-m", "meshfit", "train", "--out",
                           str(tmp_path / "run"), "--model.factory=enders:c_exit"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "meshfit train: error: its process exited with code 0 before the command finished: "
        "something it ran ended the process early (os._exit, an exec, a C library's exit); "
        "the command is not complete"]


def test_a_command_killed_by_a_signal_ends_its_waiter_by_the_same(tmp_path, subprocess_env):
    """A command killed by SIGKILL (as the out-of-memory killer ends one) ends the meshfit
    process that waits on it by the same signal, silently, as it ended the process before
    there was a waiter."""
    proc = subprocess.run([sys.executable, "-c", SUPERVISED, "killed", str(tmp_path / "pid")],
                          env=subprocess_env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL and proc.stderr == "", proc.stderr


def test_the_command_dies_with_the_meshfit_process(tmp_path, subprocess_env):
    """kill -9 of the meshfit process that waits on its command: Linux's parent-death signal
    ends the command too (no training left running that nobody waits on). The command keeps
    the waiter's process group and session."""
    import psutil

    pid_file = tmp_path / "pid"
    proc = subprocess.Popen([sys.executable, "-c", SUPERVISED, "sleeps", str(pid_file)],
                            env=subprocess_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    command = None
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()) and proc.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        command = psutil.Process(int(pid_file.read_text()))
        assert command.ppid() == proc.pid  # the command runs in the waiter's child
        # in the waiter's process group and session: a terminal's Ctrl-C and Ctrl-Z reach
        # the command as they reached it without a waiter
        assert (os.getpgid(command.pid), os.getsid(command.pid)) == \
            (os.getpgid(proc.pid), os.getsid(proc.pid))
        proc.kill()
        proc.wait(timeout=30)
        # bound: the kernel signals at once; 30 s covers a machine under heavy load
        _, alive = psutil.wait_procs([command], timeout=30)
        assert [p for p in alive if p.status() != psutil.STATUS_ZOMBIE] == []
    finally:
        if command is not None and command.is_running():
            command.kill()  # (our child's child, by its PID)
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL


def test_a_signal_sent_to_the_command_and_the_waiter_stops_the_run_once(tmp_path,
                                                                         subprocess_env):
    """A signal sent to every process of the job (a terminal's Ctrl-C, ``kill %1``, a
    scheduler that signals each process in turn: here the command first, the waiting meshfit
    process 0.3 s later, so that the command has acted on its copy before the waiter gets
    its own) stops the run once, after its step, with a checkpoint and exit code 130: the
    waiter does not pass on a signal the command got itself, which would be a second signal
    and end the run at once. (A signal to the waiter alone is passed on:
    `test_train_resume.py`'s Ctrl-C to the launcher's PID.)"""
    import psutil

    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "meshfit", "train", "--out", str(out),
                             "--train.steps=5000", "--model.n_layer=1", "--train.log_every=1",
                             "--train.eval_every=0"], env=subprocess_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2) \
                and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()
        [command] = psutil.Process(proc.pid).children()
        command.send_signal(signal.SIGINT)  # our child's child, by its PID
        time.sleep(0.3)  # bound: SAME_S (1 s) apart is still one signal
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    ours = [line for line in err.splitlines() if line.startswith("meshfit train:")]
    assert len(ours) == 1 and "stopped by SIGINT after step" in ours[0], err
    step = int(ours[0].split("after step ")[1].split(";")[0])
    assert (out / "checkpoints" / f"step-{step}").is_dir()


def test_forwarding_passes_on_a_signal_only_the_waiter_got():
    """`Forwarding`'s decisions on a clock of its own: a signal only the waiter got is passed
    on `wait_s` later; one the command got too (before or after the waiter, within `same_s`)
    or has pending is not; the command's arrival of a passed-on signal is its echo, so the
    next signal that only the waiter gets is passed on again; a command's arrival long before
    does not count."""
    from meshfit.launch.finished import Forwarding

    f = Forwarding(same_s=1.0, wait_s=0.125)  # (times exact in binary)
    f.waiter_got(15, 10.0)
    assert f.next_due() == 10.125 and f.due(10.0625) == [] and f.due(10.125) == [15]
    f.command_got(15, 10.25)  # the echo of the one passed on
    f.waiter_got(15, 12.0)
    assert f.due(12.125) == [15]
    f.waiter_got(2, 20.0)
    assert f.due(20.0, pending=frozenset({2})) == []  # on its way to the command already
    f.waiter_got(2, 21.0)
    f.command_got(2, 21.0625)  # the same Ctrl-C reached both
    assert f.due(21.125) == [] and f.due(25.0) == [] and f.next_due() is None
    f.command_got(2, 30.0)  # the command first this time
    f.waiter_got(2, 30.9)
    assert f.due(31.0) == [] and f.due(40.0) == []
    f.command_got(1, 50.0)  # long before: another signal
    f.waiter_got(1, 55.0)
    assert f.due(55.125) == [1]


def test_a_pending_signal_is_read_from_the_process():
    """`pending_signals` reads what Linux holds for a process: a signal sent to a process
    that blocks it is pending (here a child of this test that blocks SIGUSR2)."""
    from meshfit.launch.finished import pending_signals

    code = ("import signal, sys, time\n"
            "signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR2])\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        assert signal.SIGUSR2 not in pending_signals(proc.pid)
        proc.send_signal(signal.SIGUSR2)
        deadline = time.monotonic() + 30  # (the kernel marks it at once)
        while signal.SIGUSR2 not in pending_signals(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert signal.SIGUSR2 in pending_signals(proc.pid)
    finally:
        proc.kill()
        proc.communicate()
    assert pending_signals(proc.pid) == frozenset()  # gone: none known
