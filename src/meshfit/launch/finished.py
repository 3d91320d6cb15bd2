"""A run exits 0 only when it finished what it was asked: code that `meshfit train` calls (a
model factory, a plan, a module's forward) cannot end the process as if it had.

Two guards, for the two places a process can end without meshfit deciding it:

* in the process itself (`no_silent_exit`): while a command runs, ``os._exit(0)`` and the
  ``os.exec*`` functions called in it raise `ProcessEndRefused`, one line naming the caller's
  file and line (a model factory's becomes its [model] key's error, as ``sys.exit`` does).
  What Python cannot see (a C library's ``exit``) is left to the second guard;
* across processes (`FINISHED_ENV`): the launcher gives each worker a folder; a worker that
  finished its run writes its mark there (`mark_finished`) as its last act, and a worker that
  left with exit code 0 without one (`unfinished`) fails the job in one line.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from pathlib import Path

FINISHED_ENV = "MESHFIT_FINISHED_DIR"
"""Where the launcher's workers mark that they finished (a folder of this launcher's own)."""

_REAL = {"_exit": os._exit, "execv": os.execv, "execve": os.execve}


class ProcessEndRefused(BaseException):
    """Code called by a command tried to end its process as if the command had finished (a
    BaseException, as SystemExit is, so that no ``except Exception`` swallows it)."""


def exit_now(code: int) -> None:
    """End this process at once with `code` (``os._exit``, never refused): meshfit's own way
    out of a worker whose work is done or lost."""
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
