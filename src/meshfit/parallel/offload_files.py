"""The files of ``offload="disk"`` (`meshfit.parallel.disk`): the run's private folder, held
by the run, and each state file written and read back with a check.

A folder is held by its run with an OS lock (``flock`` on the marker file inside it): a
second run given the same folder is refused in one line naming it and the process holding
it, instead of taking the first one's live state for a leftover and deleting it; the OS
releases the lock when the holding process ends however it ends, so a killed run's folder
(marker present, lock free) is reclaimed by the next run. ``flock`` and not ``fcntl``'s
record locks: those belong to the process and vanish when any of its descriptors of the
file closes; an ``flock`` belongs to the open file, and two opens conflict even within one
process.

Each file is written under a temporary name and renamed (never half written), and the
XXH3-128 digest of the bytes written is kept in memory; reading it back checks its size and
that digest before any byte is used. The hashing runs on the offload's reader and writer
threads (XXH3 releases the GIL), each piece of a file hashed as it is read or written, while
it is in the CPU's cache (`PIECE`); the cost is measured by
``benchmarks/disk_offload_check.py``. A failure is one line (`OffloadFileError`) naming the
file, the rank and what to do: a missing file, a truncated one, one whose bytes changed on
the disk, a full disk, a file over the process's size limit (``ulimit -f``).

Torch-free: the tensors' bytes come in as buffers.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import resource
import shutil
from pathlib import Path

import xxhash

from meshfit._files import unwritable

__all__ = ["MARKER", "PIECE", "OffloadFileError", "check_read", "check_writable",
           "digest", "free_bytes", "hold", "holder", "read_file", "release", "write_file"]

FILE_MODE = 0o600
MARKER = ".meshfit-offload"
"""The file that marks a folder as the offload's scratch and carries its run's lock (and the
holding process's id). A folder whose marker is not locked is an earlier run's leftover
(killed, or kept), which the next run may replace: its state is in the run's checkpoints,
never only here."""


class OffloadFileError(OSError, ValueError):
    """An offload file that cannot be written, or read back as it was written: one line
    naming the file, the rank and the fix (a ValueError too: the trainer reports it as one
    line, and the launcher names this rank); `errno` says why."""

    def __init__(self, code: int | None, message: str):
        super().__init__(message)  # (one argument: str() is the line, without "[Errno n]")
        self.errno = code


def _where(rank: int | None) -> str:
    return "" if rank is None else f" (rank {rank})"


def digest(view: memoryview) -> int:
    """The XXH3-128 digest of `view`'s bytes (the GIL released while hashing)."""
    return xxhash.xxh3_128(view).intdigest()


PIECE = 4 << 20
"""Files are read and written in pieces of 4 MiB, each hashed right after it is read or
written, while it is still in the CPU's cache: measured on this machine, hashing 256 MiB
that way adds 4-5 ms to its 42 ms read from the page cache, where hashing the whole buffer
after the read adds 7-8 ms, and handing pieces to a thread of their own cost more than it
hid (the hand-offs under the GIL)."""


def write_file(path: Path, view: memoryview, *, rank: int | None = None,
               hashed: bool = True) -> int | None:
    """`view`'s bytes in `path`, written under a temporary name and renamed (never half
    written); returns their digest (`hashed`; else None), taken piece by piece as they are
    written. An error is one line naming the file and the rank."""
    tmp = path.with_suffix(".tmp")
    hashing = xxhash.xxh3_128() if hashed else None
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
        with open(fd, "wb", buffering=0) as f:
            for start in range(0, len(view), PIECE):
                piece, done = view[start:start + PIECE], 0
                while done < len(piece):
                    done += f.write(piece[done:])
                if hashing is not None:
                    hashing.update(piece)
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise OffloadFileError(err.errno, f"offload='disk'{_where(rank)}: cannot write {path} "
                                          f"{_why_not_written(err)}") from None
    return None if hashing is None else hashing.intdigest()


def _why_not_written(err: OSError) -> str:
    """"(the reason); what to do" for a failed write."""
    if err.errno == errno.EFBIG:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        return (f"({err.strerror}: this process may write files of {limit} bytes at most, "
                "ulimit -f); raise the limit (ulimit -f unlimited) before starting the run")
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"({err.strerror}); free space on that disk or give another offload_dir"
    return f"({err.strerror or err}); give an offload_dir on a writable local disk"


def read_file(path: Path, view: memoryview, *, rank: int | None = None,
              hashed: bool = True) -> int | None:
    """Fill `view` from `path`; returns the digest of its bytes (`hashed`; else None),
    taken piece by piece as they are read: compare it with what was written (`check_read`)
    before using them. A missing, short or unreadable file is one line naming the file and
    the rank."""
    got = 0
    hashing = xxhash.xxh3_128() if hashed else None
    try:
        with open(path, "rb", buffering=0) as f:
            while got < len(view):
                n = f.readinto(view[got:got + PIECE])
                if not n:
                    break
                if hashing is not None:
                    hashing.update(view[got:got + n])
                got += n
    except FileNotFoundError:
        got = None
    except OSError as err:
        raise OffloadFileError(err.errno, f"offload='disk'{_where(rank)}: {path} cannot be "
                                          f"read ({err.strerror or err}); resume from the "
                                          "last checkpoint, with an offload_dir on a sound "
                                          "disk") from None
    check_read(path, got, len(view), None, None, rank=rank)
    return None if hashing is None else hashing.intdigest()


def check_read(path: Path, got: int | None, size: int, found: int | None,
               expected: int | None, *, rank: int | None = None) -> None:
    """One line naming the file and the rank when `got` bytes of `path` (None: it is
    missing) are not the `size` written, or their digest `found` is not the `expected` one
    (None: not checked)."""
    where = f"offload='disk'{_where(rank)}: {path}"
    if got is None:
        raise OffloadFileError(errno.ENOENT, f"{where} is missing (removed while the run used "
                                             "it): the folder is the run's own; resume from "
                                             "the last checkpoint")
    if got != size:
        raise OffloadFileError(errno.EIO, f"{where} holds {got} bytes, {size} expected "
                                          "(truncated); resume from the last checkpoint")
    if expected is not None and found != expected:
        raise OffloadFileError(errno.EIO, f"{where}: its {got} bytes differ from those this "
                                          "run wrote (overwritten or corrupted on the disk); "
                                          "nothing of it was used: resume from the last "
                                          "checkpoint, with an offload_dir no other process "
                                          "writes to")


# ---------------------------------------------------------------------------- the folder
def holder(folder: Path) -> int | None:
    """The id of the live process holding `folder` (0 when it is held but names no
    process); None when no live run holds it. Nothing is written."""
    try:
        fd = os.open(Path(folder) / MARKER, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            return int(text) if text.isdigit() else 0
        return None
    finally:
        os.close(fd)  # (and with it the lock, if it was taken here)


def _in_use(field: str, folder: Path, pid: int, held: Path | None = None) -> ValueError:
    what = "it" if held is None or held == folder else f"its {held.name}/"
    if pid and not _alive(pid):  # (a process forked by it, e.g. a DataLoader worker)
        return ValueError(f"{field}={str(folder)!r} is in use: process {pid}, which has ended, "
                          f"took {what}, and a process it started still holds it; wait for "
                          "that one to end, or give another offload_dir")
    who = f"process {pid}" if pid else "another process"
    return ValueError(f"{field}={str(folder)!r} is in use by another run ({who} holds {what}); "
                      "give each run its own offload_dir")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (another user's)
        return True
    return True


def hold(folder: Path) -> int:
    """Create `folder` for this run only (owner-only permissions), or reclaim an earlier
    run's leftover, and hold it: returns the descriptor of its locked marker (`release`
    gives it back). A folder a live run holds is refused, naming it and the process; any
    other folder with files in it is refused (a path given by mistake: nothing of it is
    deleted)."""
    folder = Path(folder)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())) \
            and not (folder / MARKER).is_file():
        raise ValueError(f"offload_dir={str(folder)!r} exists and is not an empty folder; "
                         "give a new path (meshfit creates it, private to the run)")
    for _ in range(3):  # (a run ending now may remove the folder between our open and lock)
        fd = _open_marker(folder)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            os.close(fd)
            raise _in_use("offload_dir", folder, int(text) if text.isdigit() else 0) from None
        try:
            if os.path.samestat(os.fstat(fd), os.stat(folder / MARKER)):
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    else:
        raise ValueError(f"offload_dir={str(folder)!r} keeps being removed while this run "
                         "creates it; give each run its own offload_dir")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    for entry in folder.iterdir():  # an earlier run's leftover (its lock is free): replaced
        if entry.name == MARKER:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    return fd


def _open_marker(folder: Path) -> int:
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(folder, 0o700)
        return os.open(folder / MARKER, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
    except OSError as err:
        raise ValueError(f"offload_dir={str(folder)!r} cannot be created "
                         f"({err.strerror or err}); give a writable folder on a local "
                         "disk") from None


def release(folder: str, fd: int, keep: bool) -> None:
    """Remove the folder (unless `keep`), then let go of its lock: no other run takes it
    while it is being removed."""
    try:
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


# ---------------------------------------------------------------------------- before a run
def free_bytes(folder: str | os.PathLike) -> int:
    """Free bytes on the disk `folder` is (or will be, once created) on."""
    probe = Path(folder)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def check_writable(folder: str | os.PathLike, field: str = "offload_dir") -> None:
    """One line when `folder` cannot be created or written by this process (a file where a
    folder should be, a read-only file system, no write permission on the nearest folder
    that exists), or, outside a job of several processes (before launch, or one process),
    when a live run holds it or a rank's folder in it (``rank-*``, as `meshfit.accelerator`
    names them). Nothing is written."""
    folder = Path(folder)
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    where = "" if probe == folder else f" (its nearest existing folder {str(probe)!r})"
    if not probe.is_dir():
        raise ValueError(f"{field}={str(folder)!r}: {str(probe)!r} is a file, not a folder; "
                         "give a folder path on a local disk")
    why = unwritable(probe)
    if why:
        raise ValueError(f"{field}={str(folder)!r}{where} {why}; give a writable folder on "
                         "a local disk")
    # (one rank of a job among others would see its siblings' folders held: each rank's
    # `hold` of its own folder decides there)
    if probe == folder and os.environ.get("WORLD_SIZE", "1") == "1":
        for held in (folder, *sorted(folder.glob("rank-*"))):
            pid = holder(held)
            if pid is not None:
                raise _in_use(field, folder, pid, held)
