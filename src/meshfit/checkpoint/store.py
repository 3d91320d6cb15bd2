"""Checkpoint folders on disk: written whole or not at all, read without unpickling anything.

A checkpoint is a folder of `torch.distributed.checkpoint` (DCP) files — every rank writes
its own shards, nothing is gathered on one rank — plus ``manifest.json``:

    step-<N>/
        .metadata           DCP's index of every tensor and value (which file, which chunk)
        __<rank>_<i>.distcp each rank's shards
        manifest.json       step, layout, world size, every file's size and checksum, versions

Atomic: all ranks write into ``step-<N>.tmp-<token>/``; once every rank has finished, rank 0
writes the manifest, fsyncs, and renames the folder to ``step-<N>`` (then fsyncs the
parent). The checksums are taken while the files are written: DCP's writer streams every
byte through an XXH3-128 digest on its way to the file (and fsyncs each file), so a save
makes one pass over the data, as raw DCP does. A digest covers each `BLOCK` (32 MiB) of a
file (manifest format 3), so that a reader can check every block before using it. XXH3-128
and not SHA-256: the checksum guards against a truncated, overwritten or corrupted file; a
manifest is no signature (anyone who can rewrite a file can rewrite it too), and what keeps a
crafted checkpoint from running code is the restricted reading below, not the hash. XXH3
runs at memory speed (about 10 GB/s here against SHA-256's 1.2). Checkpoints of format 2
(one XXH3-128 per file) and 1 (SHA-256) still load. A process killed at any moment leaves
either the previous checkpoints untouched plus a ``.tmp-`` folder, which nothing ever loads,
or the new complete one. `latest` only returns folders whose manifest matches their files.

Safe: DCP reads its ``.metadata`` with `pickle.load` and its non-tensor values with
``torch.load(weights_only=False)``, either of which runs arbitrary code from a crafted file.
Here the metadata goes through an unpickler that only builds DCP's own metadata classes,
torch sizes, dtypes and layouts, and values through ``torch.load(weights_only=True)``; and
before anything is read, the folder is checked against the manifest (no extra file, no
missing one, sizes equal, the index's checksum). `load_dcp` with the manifest then reads
each data file once: no byte of a block is used before the block's digest has matched
(`meshfit.checkpoint._reader`; the next block is hashed ahead by a thread while the current
one is copied), so a corrupted block stops the load on every rank before any of its bytes
reaches a tensor (the blocks before it have been loaded, each checked: what a failed load
leaves in the model is checkpoint data, not the whole of it). Each tensor is copied once,
from the file's memory map into its destination, where DCP's reader copies it twice.
`verify` checks every file up front, each rank the files it wrote itself, the rest shared
out by size.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
import uuid
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshfit._files import atomic_write_text, fsync_path
from meshfit.checkpoint._digest import new_digest as _new_digest
from meshfit.checkpoint._reader import CheckpointError, VerifiedStream, read_verified
from meshfit.distributed.settle import barrier as settled_barrier

__all__ = ["CheckpointError", "Manifest", "Verification", "close_writer_process", "commit",
           "incomplete_reason", "is_complete", "latest", "list_complete", "load_dcp", "prune",
           "read_index", "save_dcp", "save_dcp_async", "saved_keys", "skipped", "start_verify",
           "verify"]

MANIFEST = "manifest.json"
FORMAT = 3
"""3: an XXH3-128 digest of every `BLOCK` bytes of each file (taken while writing, checked
while reading); 2: one XXH3-128 per file; 1: one SHA-256 per file (both still read)."""
READ_FORMATS = (1, 2, 3)
HASHES = {1: "sha256", 2: "xxh3_128", 3: "xxh3_128"}
BLOCK = 32 << 20
"""Format 3's block: the unit a reader checks before using any of its bytes."""
_STEP_DIR = re.compile(r"^step-(\d+)$")


# ---------------------------------------------------------------------------- the manifest
@dataclass(frozen=True, kw_only=True)
class Manifest:
    """What a committed checkpoint holds; `manifest.json` in its folder."""

    format: int = FORMAT
    step: int
    """Optimizer steps taken when it was saved."""
    world_size: int
    layout: dict[str, Any]
    """The saving job's layout: mesh sizes, engine, ZeRO stage (`Layout.summary`)."""
    model: dict[str, Any]
    """Each model's parameter names and global shapes: a checkpoint of another model is
    refused by name before any tensor is read."""
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    """File name -> {"bytes": size, "block_bytes": `BLOCK`, "xxh3_128_blocks": [hex digest of
    each block]}; formats 1 and 2: {"bytes": size, "sha256" or "xxh3_128": hex digest}."""
    versions: dict[str, str] = field(default_factory=dict)
    """meshfit and torch versions of the saving job."""

    @classmethod
    def read(cls, folder: Path) -> Manifest:
        path = folder / MANIFEST
        try:
            data = json.loads(path.read_text())
            return cls(**data)
        except FileNotFoundError:
            raise CheckpointError(f"{folder}: no {MANIFEST}; it is not a complete meshfit "
                                  "checkpoint (a save that was interrupted leaves none)") from None
        except (json.JSONDecodeError, TypeError) as err:
            raise CheckpointError(f"{path}: not a readable manifest ({err})") from None


def _file_digest(path: Path, algorithm: str = "xxh3_128",
                 block: int | None = None) -> str | list[str]:
    """The file's digest (`block`: the digest of every `block` bytes, a list), hashed from a
    read-only memory map of it (no copy of the bytes: 3x faster than reading into a buffer,
    measured on a cached 167 MiB shard)."""
    import mmap

    digest, digests = _new_digest(algorithm), []
    step = block or 64 << 20
    with path.open("rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size:
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                view = memoryview(mapped)
                try:
                    for start in range(0, size, step):
                        digest.update(view[start:start + step])
                        if block:
                            digests.append(digest.hexdigest())
                            digest = _new_digest(algorithm)
                finally:
                    view.release()
    return digests if block else digest.hexdigest()


def _entry(nbytes: int, digests: list[str]) -> dict[str, Any]:
    """A file's line in a format-3 manifest."""
    return {"bytes": nbytes, "block_bytes": BLOCK, "xxh3_128_blocks": digests}


def _expected(manifest: Manifest, name: str) -> tuple[str | list[str] | None, int | None]:
    """(digest or block digests, block size) the manifest holds for file `name`."""
    entry = manifest.files[name]
    if manifest.format >= 3:
        return entry.get("xxh3_128_blocks"), entry.get("block_bytes")
    return entry.get(HASHES[manifest.format]), None


SIDECAR = ".meshfit-digests-"
"""Digests a save's writer process leaves in the temporary folder for `commit` (removed
before the manifest is written; never part of a checkpoint)."""


def _hashing_writer(folder: Path, digests: dict[str, tuple[int, list[str]]], *,
                    sidecar: bool = False):
    """DCP's file-system writer for `folder` (fsyncing every file, as by default), whose
    files are hashed as they are written: {file name: (bytes, block digests)} in `digests`
    (`sidecar`: also in files beside them, for a writer in another process)."""
    from meshfit.checkpoint._writer import HashingWriter  # (imports DCP: not at start-up)

    return HashingWriter(folder, digests, block=BLOCK, algorithm=HASHES[FORMAT],
                         sidecar=SIDECAR if sidecar else None)


_WRITTEN: dict[str, dict[str, tuple[int, list[str]]]] = {}
"""{temporary folder: {file: (bytes, block digests)}} of the saves this process wrote, until their
commit (an asynchronous save's writer thread fills its entry)."""


# ---------------------------------------------------------------------------- saving
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _gather(obj) -> list:
    if not _distributed():
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _new_tmp(folder: Path) -> Path:
    """A fresh temporary folder beside `folder`, the same path on every rank (a collective)."""
    token = [uuid.uuid4().hex[:12]]
    if _distributed():
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
    if _distributed():
        dist.broadcast_object_list(problem, src=0)
        settled_barrier()
    if problem[0]:
        raise CheckpointError(problem[0])
    return tmp


def save_dcp(state: dict[str, Any], folder: Path, *, process_group=None) -> Path:
    """Write `state` with DCP into a fresh temporary folder beside `folder`; every rank calls
    it and gets the same temporary path. `commit` then makes it `folder`."""
    import torch.distributed.checkpoint as dcp

    tmp = _new_tmp(folder)
    digests = _WRITTEN.setdefault(str(tmp), {})
    try:
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(state, storage_writer=_hashing_writer(tmp, digests),
                     process_group=process_group, no_dist=not _distributed())
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
    (``"process"``: DCP's process-based checkpointer, started at the first such save and
    kept; `stager`: a `DefaultStager` staging into shared memory, kept between saves, so
    the copy reaches that process without another); returns (temporary folder, future).
    `process_group` must be a group of its own (gloo), so that the writer's collectives
    never interleave with training's. Wait for the future before `commit`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    tmp = _new_tmp(folder)
    digests = _WRITTEN.setdefault(str(tmp), {})
    kind = AsyncCheckpointerType.PROCESS if mode == "process" else AsyncCheckpointerType.THREAD
    if mode == "process":
        _quiet_writer_process()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        future = dcp.async_save(
            state, storage_writer=_hashing_writer(tmp, digests, sidecar=mode == "process"),
            process_group=process_group, no_dist=not _distributed(),
            async_checkpointer_type=kind, async_stager=stager)
    return tmp, getattr(future, "upload_completion", future)


def _writer_process_main(pg_init_info, parent_conn) -> None:
    """The writer process's entry: DCP's own, without the INFO lines it logs to stderr at
    every request."""
    from torch.distributed.checkpoint import _async_process_executor as executor

    executor._init_logger = lambda rank: None
    executor._AsyncCheckpointProcess._checkpointing_subprocess(pg_init_info, parent_conn)


def _quiet_writer_process() -> None:
    """Have DCP start its writer process at `_writer_process_main` (a function of this module,
    which the spawned process imports by name)."""
    from torch.distributed.checkpoint import _async_process_executor as executor

    cls = executor._AsyncCheckpointProcess
    if not getattr(cls, "_meshfit_quiet", False):
        cls._checkpointing_subprocess = staticmethod(_writer_process_main)
        cls._meshfit_quiet = True


def close_writer_process() -> None:
    """End the process a process-based asynchronous save started (if any), after its saves."""
    from torch.distributed.checkpoint import _async_process_executor as executor

    process, executor._CHECKPOINT_PROCESS = executor._CHECKPOINT_PROCESS, None
    if process is not None:
        process.__del__()  # (sends it the request to stop, then waits up to 5 s)


def commit(tmp: Path, folder: Path, manifest: Manifest) -> Path:
    """Make `tmp` the checkpoint `folder`, as the module docstring says; a collective: every
    rank calls it after `save_dcp`. An existing `folder` (the same step saved again) is
    replaced only after the new one is complete."""
    rank = _rank()
    mine = [p.name for p in sorted(tmp.iterdir()) if p.name.startswith(f"__{rank}_")]
    if rank == 0:
        mine.append(".metadata")
    written = _WRITTEN.pop(str(tmp), {})
    for side in sorted(tmp.glob(f"{SIDECAR}*.json")):  # (a writer process's digests)
        written.update({k: (v[0], v[1]) for k, v in json.loads(side.read_text()).items()})
    hashes = {}
    for name in mine:
        path = tmp / name
        size = path.stat().st_size
        known = written.get(name)  # hashed while written (and fsync'd by DCP's writer)
        if known is None or known[0] != size:  # (another writer's file: read it back)
            fsync_path(path)
            known = (size, _file_digest(path, HASHES[FORMAT], BLOCK))
        hashes[name] = _entry(size, known[1])
    everyone = _gather(hashes)
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
    if _distributed():
        settled_barrier()
    return folder


# ---------------------------------------------------------------------------- finding
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
    named = _STEP_DIR.match(folder.name)
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
            if (m := _STEP_DIR.match(path.name)) and path.is_dir()]


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


# ---------------------------------------------------------------------------- loading
def verify(folder: Path) -> Manifest:
    """The folder's manifest, after checking that it holds exactly the listed files with
    their sizes and checksums (each rank hashes a share of the files). One-line
    CheckpointError naming the first difference, on every rank."""
    return start_verify(folder).result()


class Verification:
    """A checkpoint's check under way (`start_verify`): `manifest` and the DCP index are
    checked; the files' checksums are being taken by a thread. `result()` waits for them on
    every rank (a collective) and returns the manifest or raises the first difference."""

    def __init__(self, manifest: Manifest, future):
        self.manifest, self._future = manifest, future

    def result(self) -> Manifest:
        if self._future is None:  # (nothing hashed here, on any rank: nothing to agree on)
            return self.manifest
        problem = self._future.result()
        problems = [p for p in _gather(problem) if p]
        if problems:
            raise CheckpointError(problems[0])
        return self.manifest


def start_verify(folder: Path, *, hash_files: bool = True) -> Verification:
    """Check `folder` against its manifest: the list of files, their sizes, and the DCP index's
    checksum (so that the index may be read), now, on every rank (a collective); the
    checksums of this rank's share of the other files (`_share`) in a thread, while the
    caller prepares its load. Call `result()` before reading any tensor. `hash_files=False`:
    the data files' checksums are left to the reader (`load_dcp` with the manifest checks each
    file when it first opens it)."""
    from concurrent.futures import Future, ThreadPoolExecutor

    folder = Path(folder)
    problem = None
    try:
        manifest = Manifest.read(folder)
        if manifest.format not in READ_FORMATS:
            raise CheckpointError(f"{folder}: manifest format {manifest.format}, this meshfit "
                                  f"reads formats {', '.join(map(str, READ_FORMATS))}; load it "
                                  "with the meshfit that wrote it")
        present = {p.name for p in folder.iterdir()} - {MANIFEST}
        extra, missing = sorted(present - set(manifest.files)), sorted(
            set(manifest.files) - present)
        if extra:
            raise CheckpointError(f"{folder}: {extra[0]} is not part of the checkpoint (not in "
                                  "its manifest); remove it, nothing unlisted is ever read")
        if missing:
            raise CheckpointError(f"{folder}: {missing[0]} listed in the manifest is missing")
        named = _STEP_DIR.match(folder.name)
        if named and int(named.group(1)) != manifest.step:
            raise CheckpointError(f"{folder}: its manifest says step {manifest.step}, its name "
                                  f"step {named.group(1)}; the manifest was edited or moved")
        wrong = {name: f["bytes"] for name, f in manifest.files.items()
                 if (folder / name).stat().st_size != f["bytes"]}
        for name in sorted(wrong):
            size = (folder / name).stat().st_size
            raise CheckpointError(f"{folder / name}: {size} bytes, the manifest says "
                                  f"{wrong[name]} (truncated or overwritten)")
        if ".metadata" in manifest.files:  # the index, read before any tensor: checked first
            problem = _checked(folder, manifest, [".metadata"])
    except CheckpointError as err:
        manifest, problem = None, str(err)
    problems = [p for p in _gather(problem) if p]
    if problems:
        raise CheckpointError(problems[0])
    world = dist.get_world_size() if _distributed() else 1
    share = [n for n in _share(manifest.files, _rank(), world) if n != ".metadata"]
    if not hash_files:
        return Verification(manifest, None)
    if not share:
        done: Future = Future()
        done.set_result(None)
        return Verification(manifest, done)
    pool = ThreadPoolExecutor(1, thread_name_prefix="meshfit-verify")
    future = pool.submit(_checked, folder, manifest, share)
    pool.shutdown(wait=False)
    return Verification(manifest, future)


def _checked(folder: Path, manifest: Manifest, names: list[str]) -> str | None:
    """The first of `names` whose checksum differs from `manifest`'s, as a one-line problem."""
    algorithm = HASHES[manifest.format]
    for name in names:
        expected, block = _expected(manifest, name)
        found = _file_digest(folder / name, algorithm, block)
        if found != expected:
            where = ""
            if block and isinstance(expected, list):
                k = next((i for i, (a, b) in enumerate(zip(found, expected)) if a != b),
                         min(len(found), len(expected)))
                size = (folder / name).stat().st_size
                where = f", in bytes {k * block}-{min((k + 1) * block, size)}"
            return f"{folder / name}: checksum differs from the manifest (corrupted){where}"
    return None


def _share(files: dict[str, dict[str, Any]], rank: int, world: int) -> list[str]:
    """The files `rank` of `world` checks: those it wrote (``__<rank>_*``), then the rest
    (other ranks' files, the index) each to the rank with the fewest bytes so far, largest
    first; the same answer on every rank."""
    load = [0] * world
    owner: dict[str, int] = {}
    rest = []
    for name, f in files.items():
        m = re.match(r"^__(\d+)_", name)
        if m and int(m.group(1)) < world:
            owner[name] = int(m.group(1))
            load[owner[name]] += f["bytes"]
        else:
            rest.append(name)
    for name in sorted(rest, key=lambda n: (-files[n]["bytes"], n)):
        owner[name] = min(range(world), key=lambda r: (load[r], r))
        load[owner[name]] += files[name]["bytes"]
    return sorted(n for n, r in owner.items() if r == rank)


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata and nothing else."""

    _MODULES = ("torch.distributed.checkpoint.metadata",)
    _NAMES = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
              ("torch", "Size"), ("torch.serialization", "_get_layout"),
              ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath")}

    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if module in self._MODULES or (module, name) in self._NAMES or dtype:
            return super().find_class(module, name)
        raise CheckpointError(f"checkpoint metadata refers to {module}.{name}, which a DCP "
                              "index never holds; refusing to unpickle it")


def _safe_reader(folder: Path, index=None, manifest: Manifest | None = None):
    """DCP's file-system reader of `folder` reading the index through the restricted
    unpickler (`index`: read already). With `manifest`, no byte of a data file is used before
    it has been checked against the manifest: format 3 checks each block as it is read
    (`VerifiedStream`, `read_verified`: one pass over the file, each tensor copied once);
    formats 1 and 2 check the whole file when the reader first opens it (hashed from a memory
    map; the read after the check finds the page cache). Each file's items are read in the
    order they lie in it."""
    import dataclasses
    from contextlib import contextmanager

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import FileSystem

    checked: set[str] = set()

    class CheckingFileSystem(FileSystem):
        @contextmanager
        def create_stream(self, path, mode):
            name = Path(path).name
            if manifest is None or "r" not in mode:
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            expected, block = _expected(manifest, name)
            if block:
                stream = VerifiedStream(Path(path), manifest.files[name]["bytes"], block,
                                         expected)
                try:
                    yield stream
                finally:
                    stream.close()
                return
            if name not in checked:
                problem = _checked(Path(folder), manifest, [name])
                if problem:
                    raise CheckpointError(problem)
                checked.add(name)
            with super().create_stream(path, mode) as stream:
                yield stream

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            if index is not None:  # (read already, through the same unpickler)
                index.storage_meta.load_id = self.load_id
                return index
            rank = kwargs.get("rank")
            with open(self._get_metadata_path(rank), "rb") as fh:
                metadata = _MetadataUnpickler(fh).load()
            if getattr(metadata, "storage_meta", None) is None:
                from torch.distributed.checkpoint.metadata import StorageMeta

                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def read_data(self, plan, planner):
            where = self.storage_data
            if manifest is None or any(getattr(where[item.storage_index],
                                               "transform_descriptors", None)
                                       for item in plan.items):
                items = sorted(plan.items, key=lambda item: (
                    str(where[item.storage_index].relative_path),
                    where[item.storage_index].offset))
                return super().read_data(dataclasses.replace(plan, items=items), planner)
            read_verified(self, plan, planner)
            done: torch.futures.Future = torch.futures.Future()
            done.set_result(None)
            return done

    reader = SafeReader(str(folder))
    reader.fs = CheckingFileSystem()
    return reader


def _safe_planner(keys: set[str] | None = None):
    """DCP's load planner, reading values with ``torch.load(weights_only=True)``; with
    `keys`, the planner that builds those entries whole from the index alone (no state to
    fill: `meshfit.checkpoint.export`)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

    class SafePlanner(DefaultLoadPlanner if keys is None else _EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            obj = torch.load(value, weights_only=True)  # primitives only, never code
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn],
                            obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafePlanner() if keys is None else SafePlanner(keys=keys)


def read_index(folder: Path):
    """The checkpoint's DCP index (`Metadata`), read through the restricted unpickler."""
    return _safe_reader(folder).read_metadata()


def saved_keys(folder: Path) -> set[str]:
    """The flattened keys the checkpoint in `folder` holds (read from its DCP index)."""
    return set(read_index(folder).state_dict_metadata)


def load_dcp(state: dict[str, Any], folder: Path, *, process_group=None,
             on_missing: Callable[[str], str] | None = None, index=None,
             manifest: Manifest | None = None) -> None:
    """Fill `state` in place from the DCP files in `folder` (checked with `verify` first, or,
    with `manifest`, `start_verify(..., hash_files=False)` first and each file as it is
    opened), resharding DTensors to whatever layout `state` has. Keys of `state` absent from
    the checkpoint are an error naming the first one."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():  # the single-process notice, as in save_dcp
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=_safe_reader(folder, index, manifest),
                     planner=_safe_planner(), process_group=process_group,
                     no_dist=not _distributed())
    except CheckpointError:
        raise
    except CheckpointException as err:  # a rank's failure, gathered to every rank by DCP
        for failure in err.failures.values():
            found = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(found, CheckpointError):
                raise CheckpointError(str(found)) from None
        raise CheckpointError(f"{folder}: cannot be loaded into this job "
                              f"({str(err).strip().splitlines()[-1][:200]})") from None
    except Exception as err:  # DCP reports a missing key as a RuntimeError on every rank
        text = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        missing = re.search(r"Missing key in checkpoint state_dict: ([^\s.]+(?:\.[^\s]+)?)", text)
        if missing:
            name = missing.group(1).rstrip(".")
            hint = on_missing(name) if on_missing else ""
            raise CheckpointError(f"{folder}: the checkpoint has no {name!r}{hint}") from None
        raise CheckpointError(f"{folder}: cannot be loaded into this job ({text[:200]})") from None
