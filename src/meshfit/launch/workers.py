"""The launcher's workers: how each one starts (`enter_worker`: dying with the launcher), how
the agent stops them (`stopping_workers`, `quiet_agent`), and a failure summed up in one line
(`failure_summary`)."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys

LAUNCHER_PID_ENV = "MESHFIT_LAUNCHER_PID"
RESTART_ENV = "MESHFIT_RESTART_COUNT"
MAX_RESTARTS_ENV = "MESHFIT_MAX_RESTARTS"
"""The attempt of a single-node job that meshfit restarts itself (0 on the first) and the
restarts allowed: `enter_worker` hands them to the worker as torchrun's own
TORCHELASTIC_RESTART_COUNT and TORCHELASTIC_MAX_RESTARTS (each attempt's agent counts 0)."""


def enter_worker(argv: list[str]) -> None:
    """``python -m meshfit.launch ARGS``: how the agent starts each worker. Asks Linux to
    SIGKILL this process when the launcher dies (PR_SET_PDEATHSIG; kept across exec), checks
    that the launcher was not already gone before that took effect, then replaces itself with
    ``python -u ARGS``, the command torchrun would have run: same PID, same environment (with
    the restart count of the whole job where meshfit restarts it), so a script written for
    torchrun runs unchanged under `meshfit launch` and the other way round."""
    launcher = os.environ.pop(LAUNCHER_PID_ENV, "")
    restart, most = os.environ.pop(RESTART_ENV, ""), os.environ.pop(MAX_RESTARTS_ENV, "")
    if restart.isdigit() and most.isdigit():
        os.environ["TORCHELASTIC_RESTART_COUNT"] = restart
        os.environ["TORCHELASTIC_MAX_RESTARTS"] = most
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1: PR_SET_PDEATHSIG
    if launcher.isdigit() and os.getppid() != int(launcher):
        sys.exit(f"meshfit launch: the launcher (PID {launcher}) ended before this worker "
                 "started; not running it")
    os.execv(sys.executable, [sys.executable, "-u", *argv])


@contextlib.contextmanager
def stopping_workers():
    """How the agent stops its workers, adjusted; yields the PIDs of the workers that had
    failed when it began stopping the rest (it terminates the others, exit code -15, and
    reports them as failed too, with timestamps of one-second resolution).

    The agent passes the signal it got on to the workers: a Ctrl-C (SIGINT) would raise
    KeyboardInterrupt in every Python worker, one traceback each. They get SIGTERM instead
    (`meshfit train`'s workers treat both alike: checkpoint, one line)."""
    from torch.distributed.elastic.multiprocessing import api

    real = api.SubprocessContext._close
    first: set[int] = set()

    def _close(self, death_sig, timeout: int = 30):
        if not getattr(self, "_meshfit_closing", False):
            self._meshfit_closing = True
            first.update(f.pid for f in self._failures.values())
        if death_sig == signal.SIGINT:
            death_sig = signal.SIGTERM
        return real(self, death_sig, timeout)

    api.SubprocessContext._close = _close
    try:
        yield first
    finally:
        api.SubprocessContext._close = real


@contextlib.contextmanager
def quiet_agent():
    """torch's elastic agent keeping its errors but not its per-worker warnings nor its
    "failed (exitcode ...)" line, which meshfit's summary replaces; unless LOGLEVEL asks for
    its own logs."""
    if os.environ.get("LOGLEVEL"):
        yield
        return

    def quiet(record) -> bool:
        return record.levelno >= 40 and not str(record.msg).startswith("failed (exitcode")

    loggers = [logging.getLogger(name) for name in list(logging.Logger.manager.loggerDict)
               if name.startswith("torch.distributed.elastic")]
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)


def _error_tail(failure, lines: int = 3) -> str:
    """The last lines of a failed worker's error, from torch's error file (scripts decorated
    with torch's ``@record``, and `meshfit train`'s workers), joined into one line."""
    message = failure.message
    if isinstance(message, dict):
        text = message.get("extraInfo", {}).get("py_callstack") or message.get("message", "")
    else:
        text = str(message or "")
    if not text or text.startswith(("To enable traceback", "Signal ")):
        return ""
    kept = [line.strip() for line in text.splitlines() if line.strip()][-lines:]
    return " | ".join(kept)


def failure_summary(failures: dict, first: set[int]) -> str:
    """One line: how many workers failed, which rank failed first (not one the agent stopped
    afterwards), its exit code and the end of its error."""
    if not failures:
        return "the workers failed"
    early = {r: f for r, f in failures.items() if f.pid in first} or failures
    rank = min(early, key=lambda r: (early[r].timestamp, r))
    f = early[rank]
    code = str(f.exitcode)
    if f.exitcode < 0:
        code += f" ({f.signal_name()})"
    tail = _error_tail(f)
    return (f"{len(failures)} worker(s) failed; first: rank {rank} exit code {code}"
            + (f": {tail}" if tail else ""))
