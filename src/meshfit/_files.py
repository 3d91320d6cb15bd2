"""Writing files so that a failure never leaves a half-written one: the helpers every
writer of meshfit uses (run folders, model folders, adapters, checkpoints' neighbours,
trackers, caches). Standard library only.

    atomic_write_text(path, text)      # temp in the same folder + fsync + rename + dir fsync
    atomic_write_dir(folder, fill)     # the same for a folder that fill(tmp) writes
    append_line(path, line_bytes)      # a whole line or nothing (cut back on a failed write)
    tmp = temp_sibling(target)         # ".<name>.tmp.<host>.<pid>.<rand>" beside target
    replace_dir(tmp, target)           # a folder put in place of another
    remove_stale_temps(target)         # leftovers of killed writers on this host

A failing write (a full disk, a file too large, a read-only file system, no permission)
raises `WriteFailed`: one line naming the path and the reason; an OSError and a ValueError.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["WriteFailed", "append_line", "atomic_write", "atomic_write_bytes",
           "atomic_write_dir", "atomic_write_text", "fsync_path", "fsync_tree",
           "new_file_mode", "os_reason", "remove_stale_temps", "replace_dir", "stale_temps",
           "temp_sibling"]


class WriteFailed(OSError, ValueError):
    """A file of the run could not be written (full disk, file too large, read-only file
    system, no permission): one line naming the path and the reason. An OSError with the
    original errno, and a ValueError, so `meshfit` prints it as its one-line error."""

    def __str__(self) -> str:
        return str(self.strerror)


def os_reason(err: OSError) -> str:
    """An OSError's reason in words: "No space left on device (ENOSPC)"."""
    name = errno.errorcode.get(err.errno or 0)
    text = err.strerror or str(err)
    return f"{text} ({name})" if name else text


def _umask() -> int:
    """This process's umask, read without changing it (Linux: /proc/self/status)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def new_file_mode(path: Path, *, folder: bool = False) -> int:
    """The mode `path` keeps when replaced: its own, or what open() (`folder`: mkdir) would
    give a new one under this process's umask."""
    try:
        return os.stat(path).st_mode & 0o7777
    except OSError:
        return (0o777 if folder else 0o666) & ~_umask()


def atomic_write(path: Path, fill: Callable[[BinaryIO], object]) -> None:
    """Replace `path` by what ``fill(file)`` writes, atomically: a temporary file in the same
    folder, filled, flushed and fsynced, renamed over `path`, then the folder fsynced. A
    reader sees the old file or the new one, never part of one. The temporary file is removed
    on every exit path; a failing write (a full disk, a file too large, a read-only file
    system, no permission) raises `WriteFailed` (one line) naming `path` and the reason, and
    leaves the old file intact; an error of a file `fill` reads is raised as it is."""
    path = Path(path)
    tmp, filling = None, False
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), new_file_mode(path))  # mkstemp's is 0600
            filling = True
            fill(fh)
            filling = False
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        tmp = None
        fsync_path(path.parent)
    except OSError as err:
        if filling and err.filename is not None:
            raise  # a file the filler reads, as it was raised (writing this one names no file)
        raise WriteFailed(err.errno, f"cannot write {path}: {os_reason(err)}; the previous "
                                     "file (if any) is unchanged") from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """`atomic_write` of `data`."""
    atomic_write(path, lambda fh: fh.write(data))


def append_line(path: Path, data: bytes) -> None:
    """Append `data` (one whole line) to `path`: on an O_APPEND descriptor, so it lands after
    everything else; if the write fails part-way (a full disk, RLIMIT_FSIZE), the file is cut
    back to its previous length, so the line is whole or absent, and `WriteFailed` names the
    path and the reason. Meant for a file one process writes (the run folder is locked)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as err:
        raise WriteFailed(err.errno, f"cannot append to {path}: {os_reason(err)}") from None
    try:
        before = os.fstat(fd).st_size
        done = 0
        try:
            while done < len(data):  # a short write: the next one says why (or completes it)
                done += os.write(fd, data[done:])
        except OSError as err:
            if done:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, before)
            raise WriteFailed(err.errno, f"cannot append to {path}: {os_reason(err)}; the lines "
                                         "before this one are intact") from None
        except BaseException:
            if done < len(data):
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, before)
            raise
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """`atomic_write_bytes` of `text` encoded as UTF-8."""
    atomic_write_bytes(path, text.encode("utf-8"))


# Temporary siblings: ".<name>.tmp.<host>.<pid>.<random>" (a folder being written) and
# ".<name>.old.<host>.<pid>" (the previous folder during the swap). Host and PID say whether
# the writer still lives; the random part never holds a dot.
_HOST = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"


def temp_sibling(target: Path, *, file: bool = False) -> Path:
    """A new, empty temporary folder (`file`: file) beside `target` (same file system, so a
    rename puts it in place), named after `target`, this host and this process, so that
    `remove_stale_temps(target)` finds it if the process is killed before removing it. Its
    mode is `target`'s, or a new file's (folder's) under the umask."""
    prefix = f".{target.name}.tmp.{_HOST}.{os.getpid()}."
    if not file:
        tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
        os.chmod(tmp, new_file_mode(target, folder=True))  # mkdtemp's is 0700
        return tmp
    fd, name = tempfile.mkstemp(prefix=prefix, dir=target.parent)
    try:
        os.fchmod(fd, new_file_mode(target))  # mkstemp's is 0600
    finally:
        os.close(fd)
    return Path(name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def stale_temps(target: Path) -> list[Path]:
    """Temporary siblings of `target` left by saves on this host whose process has ended
    (killed mid-save: no cleanup ran). Those of live processes and of other hosts (a shared
    file system) are not listed."""
    pattern = re.compile(rf"\.{re.escape(target.name)}\.(?:tmp|old)\.([A-Za-z0-9-]+)\.(\d+)"
                         r"(?:\.[a-z0-9_]+)?")
    found = []
    try:
        entries = list(os.scandir(target.parent))
    except FileNotFoundError:
        return []
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match and match[1] == _HOST and not _alive(int(match[2])):
            found.append(Path(entry.path))
    return sorted(found)


def remove_stale_temps(target: Path) -> list[Path]:
    """Remove `stale_temps(target)`; returns what was removed. A previous folder moved aside
    by a swap that was killed before the new one took its place is put back instead, when
    `target` is missing."""
    removed = stale_temps(target)
    for path in removed:
        if path.name.startswith(f".{target.name}.old.") and not os.path.lexists(target):
            os.replace(path, target)
        elif path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return removed


def fsync_path(path: Path) -> None:
    """fsync a file or a folder (a folder's fsync makes renames and new names in it durable)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if Path(path).is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """fsync every file and folder below `folder`, then `folder` itself."""
    for root, dirs, files in os.walk(folder):
        for name in files:
            fsync_path(Path(root) / name)
    for root, dirs, _ in os.walk(folder, topdown=False):
        for name in dirs:
            fsync_path(Path(root) / name)
    fsync_path(folder)


def replace_dir(src: Path, dst: Path) -> None:
    """Put the folder `src` in place of `dst` (an existing `dst` is kept if that fails)."""
    # rename(2) cannot replace a non-empty directory, so move the old one aside first and put
    # it back if the second rename fails.
    if not dst.exists():
        os.replace(src, dst)
        return
    old = dst.with_name(f".{dst.name}.old.{_HOST}.{os.getpid()}")
    if old.exists():  # left by an earlier swap of this process that could not finish
        shutil.rmtree(old, ignore_errors=True)
    os.replace(dst, old)
    try:
        os.replace(src, dst)
    except BaseException:
        os.replace(old, dst)
        raise
    shutil.rmtree(old, ignore_errors=True)


def atomic_write_dir(target: Path, fill: Callable[[Path], object]) -> Path:
    """Replace the folder `target` by what ``fill(tmp)`` writes into a new `temp_sibling`:
    every file in it fsynced, renamed into place (`replace_dir`), the parent fsynced, so a
    failure never leaves a half written folder where a complete one was. The temporary
    folder is removed on every exit path a process lives through (KeyboardInterrupt
    included); one left by a killed writer is removed by the next write of `target`
    (`remove_stale_temps`). Returns `target`."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(target)
    tmp = temp_sibling(target)
    try:
        fill(tmp)
        fsync_tree(tmp)
        replace_dir(tmp, target)
        fsync_path(target.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful rename
    return target


def unwritable(folder: Path) -> str | None:
    """Why this process cannot create files in the existing `folder` ("is on a read-only
    file system", "is not writable by this user"), or None. Nothing is written."""
    if os.statvfs(folder).f_flag & os.ST_RDONLY:
        return "is on a read-only file system"
    if not os.access(folder, os.W_OK | os.X_OK):
        return "is not writable by this user"
    return None
