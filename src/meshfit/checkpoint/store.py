"""The checkpoints under a folder (a run's ``checkpoints/``): which ``step-<N>`` folders are
complete, the newest complete one, pruning the old ones and the leftovers of interrupted
saves.

A ``step-<N>`` folder is complete when its manifest reads and lists exactly its files with
their sizes (`meshfit.checkpoint.manifest`; the checksums are checked before loading, by
`verify` or by the reader). A save that was interrupted leaves either a ``.tmp-`` folder,
which nothing ever loads, or a complete checkpoint (`meshfit.checkpoint.save`): `latest`
only ever returns a complete one, and `skipped` says why each newer folder was passed over.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from meshfit.checkpoint.manifest import MANIFEST, STEP_DIR, CheckpointError, Manifest

__all__ = ["incomplete_reason", "is_complete", "latest", "list_complete", "prune", "skipped"]


def is_complete(folder: Path) -> bool:
    """A committed checkpoint folder: its manifest reads and lists exactly its files with
    their sizes (checksums are checked by `verify`, before loading)."""
    return incomplete_reason(folder) is None


def incomplete_reason(folder: Path) -> str | None:
    """Why `folder` is not a complete checkpoint (None: it is)."""
    try:
        manifest = Manifest.read(folder)
    except CheckpointError as err:
        return str(err).removeprefix(f"{folder}: ")
    present = {p.name for p in folder.iterdir()} - {MANIFEST}
    missing = sorted(set(manifest.files) - present)
    if missing:
        more = ", ..." if len(missing) > 3 else ""
        return (f"{len(missing)} of its {len(manifest.files)} files missing: "
                f"{', '.join(missing[:3])}{more}")
    extra = sorted(present - set(manifest.files))
    if extra:
        return f"{extra[0]} is not in its manifest"
    for name, f in sorted(manifest.files.items()):
        size = (folder / name).stat().st_size
        if size != f["bytes"]:
            return f"{name} has {size} bytes, the manifest says {f['bytes']}"
    named = STEP_DIR.match(folder.name)
    if named and int(named.group(1)) != manifest.step:
        return f"its manifest says step {manifest.step}"
    return None


def skipped(root: Path) -> list[tuple[Path, str]]:
    """The ``step-<N>`` folders under `root` that are not complete checkpoints, and why
    (newest first): what `latest` passed over."""
    found = [(step, path, incomplete_reason(path)) for step, path in _step_folders(root)]
    return [(path, why) for _, path, why in sorted(found, reverse=True) if why is not None]


def _step_folders(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every ``step-<N>`` folder under `root`, complete or not."""
    root = Path(root)
    if not root.is_dir():
        return []
    return [(int(m.group(1)), path) for path in root.iterdir()
            if (m := STEP_DIR.match(path.name)) and path.is_dir()]


def list_complete(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete ``step-<N>`` checkpoint under `root`, oldest first."""
    return sorted((step, path) for step, path in _step_folders(root) if is_complete(path))


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint under `root` (None when there is none)."""
    found = list_complete(root)
    return found[-1][1] if found else None


def prune(root: Path, keep: int, *, writing: Path | None = None) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints, and leftover temporary folders
    of interrupted saves except `writing` (a save in flight). Rank 0 only. Returns what was
    deleted."""
    root = Path(root)
    removed = []
    for _, path in list_complete(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(path)
        removed.append(path)
    for path in root.glob("step-*.tmp-*") if root.is_dir() else ():
        if writing is not None and path.resolve() == Path(writing).resolve():
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed
