"""A run exits 0 only when it finished what it was asked: code that a command calls (a model
factory, a plan, a module's forward) cannot end the process as if it had.

Three guards, for the places a process can end without meshfit deciding it:

* in the process itself (`no_silent_exit`): while a command runs, ``os._exit(0)`` and the
  ``os.exec*`` functions called in it raise `ProcessEndRefused`, one line naming the caller's
  file and line (a model factory's becomes its [model] key's error, as ``sys.exit`` does);
* around the command's process (`supervise`): the ``meshfit`` command runs the commands that
  call user code in a child it waits on; a child that leaves with exit code 0 without having
  reported that it ended through Python (a C library's ``exit`` or ``_exit``, which no
  Python code in that process can see) fails the command in one line;
* across processes (`FINISHED_ENV`): the launcher gives each worker a folder; a worker that
  finished its run writes its mark there (`mark_finished`) as its last act, and a worker that
  left with exit code 0 without one (`unfinished`) fails the job in one line.
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import os
import select
import signal
import sys
import time
from pathlib import Path

FINISHED_ENV = "MESHFIT_FINISHED_DIR"
"""Where the launcher's workers mark that they finished (a folder of this launcher's own)."""

_REAL = {"_exit": os._exit, "execv": os.execv, "execve": os.execve}


class ProcessEndRefused(BaseException):
    """Code called by a command tried to end its process as if the command had finished (a
    BaseException, as SystemExit is, so that no ``except Exception`` swallows it)."""


def exit_now(code: int) -> None:
    """End this process at once with `code` (``os._exit``, never refused): meshfit's own way
    out of a worker whose work is done or lost (a supervised command's end reported first)."""
    report_end()
    _REAL["_exit"](code)


@contextlib.contextmanager
def no_silent_exit(command: str):
    """While inside: ``os._exit(0)``, ``os.execv`` and ``os.execve`` (the other ``os.exec*``
    call these two) called in this process raise `ProcessEndRefused` instead of ending it
    with exit code 0 or as another program. Processes forked from it (data-loader workers)
    are not guarded. ``os._exit`` with another code ends the process as asked: a non-zero
    exit is not taken for success."""
    owner = os.getpid()

    def refuse(name: str, real, *args):
        if os.getpid() != owner or (name == "_exit" and args[0] != 0):
            return real(*args)
        caller = inspect.currentframe().f_back.f_back  # past the wrapper: os.<name>'s caller
        where = f"{caller.f_code.co_filename}:{caller.f_lineno}"
        call = f"os._exit({args[0]})" if name == "_exit" else f"os.{name}({args[0]!r}, ...)"
        raise ProcessEndRefused(f"{call} at {where} would end {command}'s process before it "
                                "finished; code a run calls (a model factory, a plan, a "
                                "module's forward) must return or raise")

    saved = {name: getattr(os, name) for name in _REAL}
    for name, real in saved.items():
        setattr(os, name, lambda *args, _n=name, _r=real: refuse(_n, _r, *args))
    try:
        yield
    finally:
        for name, real in saved.items():
            setattr(os, name, real)


def mark_finished() -> None:
    """A worker's last act once its run is complete: its mark in the launcher's folder (no
    launcher, no folder: nothing to do)."""
    folder = os.environ.get(FINISHED_ENV)
    if folder:
        (Path(folder) / os.environ.get("LOCAL_RANK", "0")).touch()


def unfinished(folder: Path, nproc: int) -> list[int]:
    """The local ranks of this node whose worker wrote no mark in `folder`."""
    return [r for r in range(nproc) if not (folder / str(r)).exists()]


def clear(folder: Path) -> None:
    """The marks of an earlier attempt removed (a restarted group marks afresh)."""
    for mark in folder.iterdir():
        mark.unlink()


# ------------------------------------------------------------------- the command's own process
END = 0xFF
"""The byte a supervised command writes to its waiter once it ended through Python (signal
numbers, the other bytes on that pipe, are below 128)."""
FORWARDED = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1",
                                                     "SIGUSR2") if hasattr(signal, name))
"""The signals a waiter passes on to its command."""
SAME_S = 1.0
"""How far apart the waiter's copy of a signal and the command's own copy of it may arrive and
still be one signal sent to both (a terminal's Ctrl-C, ``kill %1``, ``pkill``, a scheduler
that signals every process of the job): the waiter then does not pass it on. The command's
arrival is written at once by Python's C-level handler, so only the sender's loop and
scheduling delays part the two (milliseconds on a loaded 2-core machine)."""
WAIT_S = 0.05
"""How long the waiter waits, after a signal reached it, for the command's own copy before it
passes the signal on (a sender that signals the waiter first; a copy still pending in the
command, which Linux shows, counts as arrived)."""

_report: tuple[int, int] | None = None  # (write end, PID) in a supervised command's process


class Forwarding:
    """Which signals the waiter passes on to its command, and when. A signal that reached the
    waiter is passed on `wait_s` after it came unless the command got the same signal itself
    within `same_s` of it, or has it pending: it was sent to both, and passing it on would
    make it a second signal, which ends a run at once instead of after its checkpoint. The
    command's arrivals of a signal the waiter passed on are its echoes, not arrivals of their
    own."""

    def __init__(self, same_s: float = SAME_S, wait_s: float = WAIT_S):
        self.same_s, self.wait_s = same_s, wait_s
        self.waiting: list[tuple[int, float]] = []  # (signal, when it reached the waiter)
        self.direct: list[tuple[int, float]] = []  # (signal, when it reached the command)
        self.echoes: list[tuple[int, float]] = []  # (signal, when it was passed on)

    def waiter_got(self, sig: int, when: float) -> None:
        self.waiting.append((sig, when))

    def command_got(self, sig: int, when: float) -> None:
        echo = next((e for e in self.echoes if e[0] == sig), None)
        if echo is not None:
            self.echoes.remove(echo)
        else:
            self.direct.append((sig, when))

    def due(self, now: float, pending: frozenset[int] = frozenset()) -> list[int]:
        """The signals to pass on now (each then counted as passed on at `now`); `pending`:
        the signals the command has pending."""
        out = []
        for sig, when in list(self.waiting):
            seen = next((d for d in self.direct
                         if d[0] == sig and abs(d[1] - when) <= self.same_s), None)
            if seen is not None or sig in pending:  # one signal sent to both
                if seen is not None:
                    self.direct.remove(seen)
                self.waiting.remove((sig, when))
            elif now - when >= self.wait_s:
                self.waiting.remove((sig, when))
                self.echoes.append((sig, now))
                out.append(sig)
        horizon = now - 4 * self.same_s  # an arrival or an echo this old matches nothing now
        self.direct = [d for d in self.direct if d[1] >= horizon]
        self.echoes = [e for e in self.echoes if e[1] >= horizon]
        return out

    def next_due(self) -> float | None:
        return min((when + self.wait_s for _, when in self.waiting), default=None)


def pending_signals(pid: int) -> frozenset[int]:
    """The signals process `pid` has pending, not yet handled (Linux's /proc; elsewhere, or
    for a process gone: none known)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return frozenset()
    mask = 0
    for line in status.splitlines():
        if line.startswith(("SigPnd:", "ShdPnd:")):
            mask |= int(line.split()[1], 16)
    return frozenset(bit + 1 for bit in range(64) if mask >> bit & 1)


def supervise(command: str) -> int | None:
    """Run the rest of this command in a child process this one waits on, so that a command
    that exits with code 0 without having finished (a C library's ``exit(0)`` or ``_exit(0)``
    in code the command called, which no Python code in that process can see) fails instead,
    in one line naming the command. Returns None in the child, which goes on with the command
    and calls `report_end` when it ends through Python; in this process returns the exit code
    once the child is gone: the child's own code, 1 where it left with code 0 without that
    report; a child ended by a signal ends this process by the same signal.

    What the user sees is the command's: it keeps this process's group and terminal (Ctrl-C,
    Ctrl-Z and the terminal's size reach it as before), its output and its exit code. A
    signal sent to this process alone (``kill PID``, a test's ``send_signal``) is passed on
    (`Forwarding`; a signal this process ignores, as under ``nohup``, stays ignored); the
    child is SIGKILLed where this process dies (Linux's parent-death signal). Where the
    platform has no ``fork``, returns None at once and the command runs unwatched."""
    if not hasattr(os, "fork"):
        return None
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    watched = [sig for sig in FORWARDED if signal.getsignal(sig) is not signal.SIG_IGN]
    read, write = os.pipe()
    for fd in (read, write):
        os.set_blocking(fd, False)  # (`signal.set_wakeup_fd` needs it)
    arrived: list[tuple[int, float]] = []
    parent = os.getpid()
    # the handlers are set, and the signals held, before the fork: a signal that comes while
    # the child starts is passed on, not lost nor taken as Python's KeyboardInterrupt here
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, watched)
    previous = {sig: signal.signal(sig, lambda sig, _: arrived.append((sig, time.monotonic())))
                for sig in watched}
    try:
        child = os.fork()
    except BaseException:
        _restore(previous, old_mask)
        raise
    if child == 0:
        os.close(read)
        _restore(previous)
        _become_command(parent, write)
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        return None
    os.close(write)
    wake_read, wake_write = os.pipe()  # this process's own arrivals wake its wait
    for fd in (wake_read, wake_write):
        os.set_blocking(fd, False)
    old_wakeup = signal.set_wakeup_fd(wake_write, warn_on_full_buffer=False)
    signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
    try:
        status, ended = _wait(child, read, wake_read, arrived)
    finally:
        signal.set_wakeup_fd(old_wakeup)
        _restore(previous)
        for fd in (read, wake_read, wake_write):
            os.close(fd)
    return _end_as(status, ended, command)


def _restore(handlers: dict, mask=None) -> None:
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    if mask is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _become_command(parent: int, write: int) -> None:
    """The child's start: killed with its waiter (checked: the waiter may have died before
    that took effect), and each signal's arrival written at once to the waiter."""
    global _report
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    _report = (write, os.getpid())


def _end_as(status: int, ended: bool, command: str) -> int:
    """This process's exit code for the child's wait `status` (a child ended by a signal ends
    this process by the same signal, without a core file of its own)."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        with contextlib.suppress(ImportError, ValueError, OSError):
            import resource

            resource.setrlimit(resource.RLIMIT_CORE,
                               (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
        with contextlib.suppress(OSError, ValueError):  # (SIGKILL's cannot be set)
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        return 128 + sig  # (not reached: the signal ends this process)
    code = os.waitstatus_to_exitcode(status)
    if code == 0 and not ended:
        print(f"{command}: error: its process exited with code 0 before the command finished: "
              "something it ran ended the process early (os._exit, an exec, a C library's "
              "exit); the command is not complete", file=sys.stderr, flush=True)
        return 1
    return code


def _wait(child: int, read: int, wake: int, arrived: list) -> tuple[int, bool]:
    """Wait for `child`, passing the signals that reach this process on as `Forwarding`
    decides; its wait status and whether it reported its end."""
    forwarding, ended, status = Forwarding(), False, None
    try:
        exits = os.pidfd_open(child)  # readable once the child is gone
    except (AttributeError, OSError):  # not Linux >= 5.3: the wait polls
        exits = None
    watched = [read, wake] + ([exits] if exits is not None else [])
    try:
        while status is None:
            while arrived:
                forwarding.waiter_got(*arrived.pop(0))
            due = forwarding.next_due()
            timeout = 0.1 if exits is None else None
            if due is not None:
                timeout = max(0.0, min(1.0 if timeout is None else timeout,
                                       due - time.monotonic()))
            select.select(watched, [], [], timeout)
            with contextlib.suppress(BlockingIOError):
                os.read(wake, 4096)
            ended |= _drain(read, forwarding)
            pending = pending_signals(child) if forwarding.waiting else frozenset()
            for sig in forwarding.due(time.monotonic(), pending):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, sig)
            pid, wait_status = os.waitpid(child, os.WNOHANG)
            if pid:
                status = wait_status
        ended |= _drain(read, forwarding)
    finally:
        if exits is not None:
            os.close(exits)
    return status, ended


def _drain(read: int, forwarding: Forwarding) -> bool:
    """Read what the child wrote so far: its signals' arrivals and its end."""
    ended = False
    while True:
        try:
            data = os.read(read, 4096)
        except BlockingIOError:
            return ended
        if not data:  # every write end closed
            return ended
        now = time.monotonic()
        for byte in data:
            if byte == END:
                ended = True
            else:
                forwarding.command_got(byte, now)


def report_end() -> None:
    """A supervised command's process says it ended through Python (any exit code, an
    error's too); elsewhere, and in processes forked from it, nothing to do."""
    if _report is not None and _report[1] == os.getpid():
        with contextlib.suppress(OSError):
            os.write(_report[0], bytes([END]))
