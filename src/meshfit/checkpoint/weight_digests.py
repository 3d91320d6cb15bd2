"""Digests of the weight files meshfit writes outside its checkpoints (``OUT/model/``,
`meshfit export`, `Accelerator.save_model`), and their check by every meshfit reader.

A checkpoint's files are listed with their digests in its manifest; a model folder is read
by other tools too (transformers' ``from_pretrained``, inference servers), so its digests go
in a file beside the weights that those tools ignore, ``meshfit-digests.json``::

    {"format": 1, "files": {"model.safetensors": {"bytes": ..., "block_bytes": 1048576,
                                                  "xxh3_128_blocks": ["...", ...]}}}

The digests of a format-3 manifest (`meshfit.checkpoint.manifest`: XXH3-128 of every block,
at memory speed; here blocks of 1 MiB), taken from the file once it is written and fsynced. A reader
checks the files it reads (`check_files`: whole, before anything is loaded; `Checker`: the
blocks under the bytes a rank reads, for `meshfit.checkpoint.pretrained.load_into`), and a
difference is one line naming the file, the bytes and the tensors in them. As with a
manifest, this guards against a corrupted, truncated or overwritten file, not against an
adversary (who could rewrite the digests too).

A folder without the file (a user's own Hugging Face folder) is read as it is; a file the
digests do not list (a shard meshfit did not write) is read unchecked. A writer replacing a
listed file first drops its entry, so a write killed half-way leaves the file unchecked,
never falsely refused.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from meshfit._files import atomic_write_text
from meshfit.checkpoint._digest import new_digest
from meshfit.checkpoint.manifest import CheckpointError, entry, file_digest

__all__ = ["DIGESTS", "Checker", "check_files", "forget", "record"]

DIGESTS = "meshfit-digests.json"
FORMAT = 1
_ALGORITHM = "xxh3_128"
BLOCK = 1 << 20
"""1 MiB: a difference is located to a MiB of the file (and the few tensors in it), and a
rank reading its slice of a tensor checks little beyond it; the digests of a 28 GB file take
about 1 MB of JSON."""


def _read(folder: Path) -> dict | None:
    """The folder's digests {"format", "files"}; None when it has none. One line when the
    file is there but unreadable (it is never ignored: that would turn its check off)."""
    path = folder / DIGESTS
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path} is not readable ({type(err).__name__}); copy or export "
                              f"the model again, or delete {DIGESTS} to read the folder "
                              "unchecked") from None
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a meshfit digest file of format {FORMAT}; copy "
                              f"or export the model again, or delete {DIGESTS} to read the "
                              "folder unchecked")
    return data


def _write(folder: Path, files: dict) -> None:
    if not files:
        (folder / DIGESTS).unlink(missing_ok=True)
        return
    atomic_write_text(folder / DIGESTS, json.dumps(
        {"format": FORMAT, "files": files}, indent=1, sort_keys=True) + "\n")


def forget(path: Path) -> None:
    """Drop `path`'s entry from the digests beside it (before the file is replaced)."""
    path = Path(path)
    data = _read(path.parent)
    if data is not None and path.name in data["files"]:
        files = dict(data["files"])
        del files[path.name]
        _write(path.parent, files)


def record(path: Path) -> None:
    """Add (or replace) `path`'s entry in the digests beside it: its size and the digest of
    every `BLOCK` bytes, hashed from the file as written."""
    path = Path(path)
    data = _read(path.parent) or {"files": {}}
    digests = file_digest(path, _ALGORITHM, BLOCK)
    _write(path.parent, {**data["files"],
                         path.name: entry(path.stat().st_size, digests, BLOCK)})


def _tensors_in(path: Path, start: int, end: int) -> str:
    """" (tensors a, b and N more)" for the tensors of the safetensors file `path` whose bytes
    overlap [start, end); "" when the header cannot say."""
    try:
        with path.open("rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length))
        spans = sorted((t["data_offsets"], k) for k, t in header.items()
                       if k != "__metadata__" and isinstance(t, dict))
        names = [k for (lo, hi), k in spans if 8 + length + lo < end and 8 + length + hi > start]
    except (OSError, struct.error, ValueError, KeyError, TypeError, IndexError):
        return ""
    if not names:
        return " (the file's header)" if start < 8 + length else ""
    more = f" and {len(names) - 2} more" if len(names) > 2 else ""
    return f" (tensors {', '.join(names[:2])}{more})"


def _problem(path: Path, line: dict, blocks: range | None = None) -> str | None:
    """The first difference between the file `path` and its digest entry `line` (in the
    blocks `blocks`; None: all), as one line; None when they agree."""
    size = path.stat().st_size if path.is_file() else None
    if size is None:
        return f"{path} is listed in {DIGESTS} and missing; copy or export the model again"
    if size != line["bytes"]:
        return (f"{path}: {size} bytes, {DIGESTS} says {line['bytes']} (truncated or "
                "overwritten); copy or export the model again")
    block, wanted = line["block_bytes"], line["xxh3_128_blocks"]
    found = file_digest(path, _ALGORITHM, block) if blocks is None else None
    for k in blocks if blocks is not None else range(len(wanted)):
        digest = found[k] if found is not None else _block_digest(path, k, block)
        if digest != wanted[k]:
            lo, hi = k * block, min((k + 1) * block, size)
            return (f"{path}: bytes {lo}-{hi}{_tensors_in(path, lo, hi)} differ from their "
                    f"digest in {DIGESTS} (the file is corrupted); copy or export the model "
                    f"again (or, if you rewrote it on purpose, delete {DIGESTS})")
    return None


def _block_digest(path: Path, k: int, block: int) -> str:
    digest = new_digest(_ALGORITHM)
    with path.open("rb", buffering=0) as fh:
        fh.seek(k * block)
        digest.update(fh.read(block))
    return digest.hexdigest()


def check_files(folder, names=None) -> bool:
    """Check the files `names` of `folder` (default: every file its digests list) against
    their digests, whole; one-line `CheckpointError` naming the first file and bytes that
    differ. False when the folder has no digests (nothing to check), else True."""
    folder = Path(folder)
    data = _read(folder)
    if data is None:
        return False
    for name in sorted(data["files"] if names is None else names):
        line = data["files"].get(name)
        if line is not None and (problem := _problem(folder / name, line)):
            raise CheckpointError(problem)
    return True


class Checker:
    """The checks of a reader that reads parts of a folder's files (each rank its slice of
    each tensor): `check(name, start, end)` before bytes [start, end) of file `name` are
    used checks the blocks under them, each block once per `Checker`. Nothing is checked
    for a folder without digests, nor for a file they do not list."""

    def __init__(self, folder):
        self.folder = Path(folder)
        data = _read(self.folder)
        self.files = {} if data is None else data["files"]
        self._checked: dict[str, set[int]] = {}
        self._sized: set[str] = set()

    def check(self, name: str, start: int, end: int) -> None:
        line = self.files.get(name)
        if line is None or end <= start:
            return
        path, block = self.folder / name, line["block_bytes"]
        if name not in self._sized:  # (its size first: a truncated file reads past its end)
            if problem := _problem(path, line, range(0)):
                raise CheckpointError(problem)
            self._sized.add(name)
        done = self._checked.setdefault(name, set())
        todo = [k for k in range(start // block, (end - 1) // block + 1) if k not in done]
        if todo and (problem := _problem(path, line, range(todo[0], todo[-1] + 1))):
            raise CheckpointError(problem)
        done.update(todo)
