"""Saving a checkpoint: written whole or not at all, every file hashed as it is written.

Atomic: all ranks write into ``step-<N>.tmp-<token>/``; once every rank has finished, rank 0
writes the manifest (`meshfit.checkpoint.manifest`), fsyncs, and renames the folder to
``step-<N>`` (then fsyncs the parent). A process killed at any moment leaves either the
previous checkpoints untouched plus a ``.tmp-`` folder, which nothing ever loads, or the new
complete one.

One pass over the data, as raw DCP makes: DCP's writer streams every byte through an XXH3-128
digest per block on its way to the file, and fsyncs each file (`meshfit.checkpoint._writer`).

In the background (`save_dcp_async`): the state is copied to host memory now and written by
a thread (DCP's `async_save`) or by a writer process of each rank's own
(`meshfit.checkpoint._writer_process`); `commit` once it is written.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch.distributed as dist

from meshfit._files import atomic_write_text, fsync_path
from meshfit.checkpoint import _writer_process
from meshfit.checkpoint.manifest import (BLOCK, FORMAT, HASHES, MANIFEST, CheckpointError,
                                         Manifest, entry, file_digest)
from meshfit.distributed import is_initialized
from meshfit.distributed.collectives import gather_object
from meshfit.distributed.settle import barrier as settled_barrier

__all__ = ["SIDECAR", "close_writer_process", "commit", "save_dcp", "save_dcp_async"]

SIDECAR = ".meshfit-digests-"
"""Digests a save's writer process leaves in the temporary folder for `commit` (removed
before the manifest is written; never part of a checkpoint)."""

_WRITTEN: dict[str, dict[str, tuple[int, list[str]]]] = {}
"""{temporary folder: {file: (bytes, block digests)}} of the saves this process wrote, until their
commit (an asynchronous save's writer thread fills its entry)."""


def _rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def _hashing_writer(folder: Path, digests: dict[str, tuple[int, list[str]]], *,
                    sidecar: bool = False):
    """DCP's file-system writer for `folder` (fsyncing every file, as by default), whose
    files are hashed as they are written: {file name: (bytes, block digests)} in `digests`
    (`sidecar`: also in files beside them, for a writer in another process)."""
    from meshfit.checkpoint._writer import HashingWriter  # (imports DCP: not at start-up)

    return HashingWriter(folder, digests, block=BLOCK, algorithm=HASHES[FORMAT],
                         sidecar=SIDECAR if sidecar else None)


def _new_tmp(folder: Path) -> Path:
    """A fresh temporary folder beside `folder`, the same path on every rank (a collective)."""
    token = [uuid.uuid4().hex[:12]]
    if is_initialized():
        dist.broadcast_object_list(token, src=0)
    folder = Path(folder)
    tmp = folder.with_name(f"{folder.name}.tmp-{token[0]}")
    problem = [None]
    if _rank() == 0:
        try:
            tmp.mkdir(parents=True)
        except OSError as err:
            problem = [f"cannot write the checkpoint {folder} ({err.strerror or err}); give a "
                       "folder on a writable disk with free space"]
    if is_initialized():
        dist.broadcast_object_list(problem, src=0)
        settled_barrier()
    if problem[0]:
        raise CheckpointError(problem[0])
    return tmp


def save_dcp(state: dict[str, Any], folder: Path, *, process_group=None) -> Path:
    """Write `state` with DCP into a fresh temporary folder beside `folder`; every rank calls
    it and gets the same temporary path. `commit` then makes it `folder`."""
    import torch.distributed.checkpoint as dcp  # (~2 s of imports: at the first save)

    tmp = _new_tmp(folder)
    digests = _WRITTEN.setdefault(str(tmp), {})
    try:
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(state, storage_writer=_hashing_writer(tmp, digests),
                     process_group=process_group, no_dist=not is_initialized())
    except Exception as err:  # a full disk, a file system gone read-only: nothing half-kept
        _WRITTEN.pop(str(tmp), None)
        shutil.rmtree(tmp, ignore_errors=True)
        free = shutil.disk_usage(tmp.parent).free if tmp.parent.exists() else None
        if isinstance(err, OSError) or (free is not None and free < 64 << 20):
            why = err.strerror if isinstance(err, OSError) and err.strerror else (
                f"the disk is full: {free / 2**20:.1f} MiB free")
            raise CheckpointError(f"cannot write the checkpoint {folder} ({why}); the previous "
                                  "checkpoints are untouched; free space or give another "
                                  "folder") from None
        raise
    return tmp


def save_dcp_async(state: dict[str, Any], folder: Path, *, process_group,
                   mode: str = "thread", stager=None):
    """`save_dcp` in the background: the state is copied to host memory now, the files are
    written by a thread (`mode="thread"`) or by a process of this rank's own
    (``"process"``: started at the first such save and kept, `close_writer_process`; `stager`:
    a `DefaultStager` staging into shared memory, kept between saves, so the copy reaches
    that process without another); returns (temporary folder, future). `process_group` must
    be a group of its own (gloo), so that the writer's collectives never interleave with
    training's. Wait for the future before `commit`."""
    tmp = _new_tmp(folder)
    digests = _WRITTEN.setdefault(str(tmp), {})
    if mode == "process":
        owned = stager is None
        if owned:
            stager = _shared_memory_stager()
        future = _writer_process.save(state, _hashing_writer(tmp, digests, sidecar=True),
                                      group=process_group, stager=stager)
        if owned:
            future.add_done_callback(lambda _: stager.close())
        return tmp, future
    import torch.distributed.checkpoint as dcp  # (as in save_dcp)
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        future = dcp.async_save(state, storage_writer=_hashing_writer(tmp, digests),
                                process_group=process_group, no_dist=not is_initialized(),
                                async_checkpointer_type=AsyncCheckpointerType.THREAD,
                                async_stager=stager)
    return tmp, getattr(future, "upload_completion", future)


def _shared_memory_stager():
    """A stager copying a state into shared memory, which a writer process maps."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # (DCP)

    return DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=True,
                                        use_async_staging=False, use_non_blocking_copy=False))


def close_writer_process() -> None:
    """End the process a process-based asynchronous save started (if any), after its saves."""
    _writer_process.close()


def _my_files(tmp: Path, rank: int) -> dict[str, dict[str, Any]]:
    """The manifest's lines of the files this rank wrote into `tmp` (rank 0: and the index),
    from the digests taken while they were written (this process's writer, or a writer
    process's, left beside them); a file written otherwise is read back and hashed."""
    mine = [p.name for p in sorted(tmp.iterdir()) if p.name.startswith(f"__{rank}_")]
    if rank == 0:
        mine.append(".metadata")
    written = _WRITTEN.pop(str(tmp), {})
    for side in sorted(tmp.glob(f"{SIDECAR}*.json")):  # (a writer process's digests)
        written.update({k: (v[0], v[1]) for k, v in json.loads(side.read_text()).items()})
    lines = {}
    for name in mine:
        path = tmp / name
        size = path.stat().st_size
        known = written.get(name)  # hashed while written (and fsync'd by DCP's writer)
        if known is None or known[0] != size:  # (another writer's file: read it back)
            fsync_path(path)
            known = (size, file_digest(path, HASHES[FORMAT], BLOCK))
        lines[name] = entry(size, known[1], BLOCK)
    return lines


def commit(tmp: Path, folder: Path, manifest: Manifest) -> Path:
    """Make `tmp` the checkpoint `folder`, as the module docstring says; a collective: every
    rank calls it after `save_dcp`. An existing `folder` (the same step saved again) is
    replaced only after the new one is complete."""
    rank = _rank()
    everyone = gather_object(_my_files(tmp, rank))
    if rank == 0:
        for side in tmp.glob(f"{SIDECAR}*"):  # (every rank has read them: it is past the gather)
            side.unlink()
        files = {k: v for part in everyone for k, v in part.items()}
        manifest = Manifest(**{**asdict(manifest), "files": files})
        atomic_write_text(tmp / MANIFEST, json.dumps(asdict(manifest), indent=1,
                                                     sort_keys=True))
        old = None
        if folder.exists():  # same step saved again: keep the old one until the new is in
            old = folder.with_name(f"{folder.name}.old-{uuid.uuid4().hex[:8]}")
            os.replace(folder, old)
        os.replace(tmp, folder)
        fsync_path(folder.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    if is_initialized():
        settled_barrier()
    return folder
