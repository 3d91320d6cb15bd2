"""The run folder (`meshfit train --out OUT`): checked before anything is written, locked
while a run writes to it, and every file in it replaced atomically.

    check_run_folder(out, resume=False, overwrite=False)   # one-line ValueError, no writes
    with RunLock(out, overwrite=False):                    # OUT/.meshfit.lock, flock'ed
        atomic_write_text(out / "config.toml", text)       # temp + fsync + rename

The lock is ``fcntl.flock`` on ``OUT/.meshfit.lock``, which holds the PID of the process that
took it. The kernel drops a flock when the process holding it ends, however it ends (kill -9
included), so a lock left behind by a dead run is free again at once: only the flock means
anything, not the file. Its descriptor is not inherited by child processes.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time
from pathlib import Path
from typing import Self

from meshfit._files import WriteFailed, append_line, atomic_write_text, os_reason, unwritable

__all__ = ["LOCK_FILE", "RUN_MARKERS", "RUN_OUTPUTS", "RunLock", "WriteFailed", "append_line",
           "atomic_write_text", "check_run_folder", "remove_run_outputs"]

LOCK_FILE = ".meshfit.lock"
RUN_MARKERS = ("metrics.jsonl", "config.toml", "checkpoints")
"""Any of these in OUT means a run has written there."""
RUN_OUTPUTS = ("metrics.jsonl", "config.toml", "checkpoints", "model", "adapter", "tracking",
               "pipeline.json", "pipeline_timings.jsonl", "pipeline_chart.png", "metrics.png",
               "metrics.jsonl.tmp")  # the last: the temporary name of earlier versions
"""What `meshfit train` (and `meshfit plot` / `meshfit pipeline-chart` by default) write into
OUT; ``--overwrite`` removes these and the temporary files beside them, nothing else."""
_TEMP_PREFIXES = tuple(f".{name}." for name in RUN_OUTPUTS)


def _pathconf(path: Path, name: str, default: int) -> int:
    """The file system's limit `name` at `path` (POSIX's minimum guess when it has none)."""
    try:
        value = os.pathconf(path, name)
    except (OSError, ValueError):
        return default
    return value if value > 0 else default


def check_run_folder(out: Path, *, resume: bool, overwrite: bool, claim: bool = True) -> None:
    """Refuse a run folder the run could not or should not write into, with a one-line
    ValueError naming ``--out=...``, the problem and the fix. Writes nothing.

    `claim` False (a node other than node 0 of a multi-node job, joining the run node 0
    claims): only whether the folder can be written is checked, not whether a run holds it."""
    out = Path(out)
    flag = f"--out={str(out)!r}"
    if resume and overwrite:
        raise ValueError(f"{flag}: --resume continues the run there and --overwrite deletes it; "
                         "give one of them")
    absolute = Path(os.path.abspath(out))
    # the closest that exists (as anything: a file too); the root always does
    existing = next(p for p in (absolute, *absolute.parents) if os.path.lexists(p))
    if existing != absolute and not existing.is_dir():
        raise ValueError(f"{flag}: {existing} is a file, not a folder, so no run folder can be "
                         "made under it; give an --out whose parents are folders")
    if existing == absolute and not absolute.is_dir():
        what = "a broken symbolic link" if absolute.is_symlink() else "a file, not a folder"
        raise ValueError(f"{flag} is {what}; give the path of a folder (new or a run's) as --out")
    name_max = _pathconf(existing, "PC_NAME_MAX", 255)
    for part in absolute.parts:
        if len(os.fsencode(part)) > name_max:
            raise ValueError(f"{flag}: the name {part[:40]!r}... is {len(os.fsencode(part))} "
                             f"bytes, longer than the {name_max} this file system allows; "
                             "give a shorter --out")
    path_max = _pathconf(existing, "PC_PATH_MAX", 4096)
    if len(os.fsencode(str(absolute))) + 64 > path_max:  # room for checkpoints/step-N/...
        raise ValueError(f"{flag} is {len(os.fsencode(str(absolute)))} bytes long; with the "
                         f"files a run writes under it that exceeds the {path_max} this system "
                         "allows; give a shorter --out")
    why = unwritable(existing)
    if why:
        raise ValueError(f"{flag}: {existing} {why}; give an --out in a folder you can "
                         "write to")
    if existing != absolute or not claim:
        return  # a new folder, or node 0's run: nothing more to check
    holder = _lock_holder(absolute)
    if holder is not None:
        raise ValueError(f"{flag}: a run (PID {holder}) is writing to this folder now (it holds "
                         f"{absolute / LOCK_FILE}); wait for it to end, or give another --out")
    found = [name for name in RUN_MARKERS if (absolute / name).exists()]
    if found and not resume and not overwrite and not _trained(absolute):
        found = []  # stopped before its first step: nothing to keep, the new run replaces it
    if found and not resume and not overwrite:
        raise ValueError(f"{flag} already holds a run ({', '.join(found)}); continue it with "
                         "--resume, start over with --overwrite, or give another --out; nothing "
                         "was changed")


def _trained(folder: Path) -> bool:
    """Whether the run in `folder` got anywhere: a training step logged, a checkpoint, a
    model or an adapter written. A run stopped (Ctrl-C, SIGTERM) between writing its
    config.toml and its first step leaves only that, and an evaluation line."""
    if any((folder / name).exists() for name in ("model", "adapter")):
        return True
    checkpoints = folder / "checkpoints"
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        return True
    metrics = folder / "metrics.jsonl"
    try:
        lines = metrics.read_text(encoding="utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return False
    except OSError:
        return True  # unreadable: keep it safe
    return any('"loss"' in line for line in lines)


def _read_pid(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 64).decode("ascii", "replace").strip()
    return text if text.isdigit() else "unknown"


def _lock_holder(folder: Path) -> str | None:
    """The PID (as text) of the live process holding ``folder``'s run lock; None if free."""
    try:
        fd = os.open(folder / LOCK_FILE, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except OSError:
        return None  # unreadable: RunLock will say why when it opens it
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_pid(fd)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _flock_briefly(fd: int, patience_s: float = 0.25) -> None:
    """LOCK_EX without waiting for a holder, but through `check_run_folder`'s probe of
    another process (a shared lock held for microseconds); BlockingIOError if held."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.01)


class RunLock:
    """Hold ``OUT/.meshfit.lock`` (creating OUT) while a run writes to OUT; a second run gets
    a one-line ValueError naming the first one's PID. With `overwrite`, once locked, the
    previous run's outputs are removed (`remove_run_outputs`). Released on exit."""

    def __init__(self, out: Path, *, overwrite: bool = False):
        self.out, self.overwrite = Path(out), overwrite
        self.path = self.out / LOCK_FILE
        self.fd: int | None = None

    def __enter__(self) -> Self:
        flag = f"--out={str(self.out)!r}"
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise ValueError(f"{flag}: cannot create {self.path}: {os_reason(err)}; give an --out "
                             "you can write to") from None
        try:
            _flock_briefly(fd)
        except BlockingIOError:
            pid = _read_pid(fd)
            os.close(fd)
            raise ValueError(f"{flag}: a run (PID {pid}) is writing to this folder now (it holds "
                             f"{self.path}); wait for it to end, or give another --out") from None
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
            if self.overwrite:
                remove_run_outputs(self.out)
        except BaseException:
            self.release()
            raise
        return self

    def release(self) -> None:
        """Drop the lock (the file stays)."""
        if self.fd is not None:
            fd, self.fd = self.fd, None
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            os.close(fd)  # closing the last descriptor releases the flock

    def __exit__(self, *exc) -> None:
        self.release()


def remove_run_outputs(out: Path) -> list[str]:
    """Remove a previous run's outputs from `out` (the names in `RUN_OUTPUTS`, and temporary
    files named after them); returns the names removed, sorted."""
    removed = []
    for entry in os.scandir(out):
        if entry.name not in RUN_OUTPUTS and not entry.name.startswith(_TEMP_PREFIXES):
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)
        removed.append(entry.name)
    return sorted(removed)
