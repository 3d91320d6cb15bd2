"""Optimizer state on disk (``offload="disk"``): ZeRO-Infinity's idea (Rajbhandari et al.
2021) with torch-native parts, for a model whose optimizer state does not fit in memory.

    optimizer = DiskOffload(torch.optim.AdamW(params, lr=1e-3), "/nvme/run-offload")
    ...
    loss.backward(); optimizer.step(); optimizer.zero_grad()

Each parameter's state tensors of its own shape (AdamW's ``exp_avg`` and ``exp_avg_sq``,
SGD's ``momentum_buffer``; under ZeRO-2/3 the rank's local shard of them; under ZeRO-1 those of
the rank's partition, by wrapping ZeroRedundancyOptimizer's local ``optim``) live in one file
each in the offload folder; small state (``step``) stays in memory. ``step()`` streams the
parameters in chunks of about `chunk_bytes` of state: a reader thread loads chunk i+1 while
the wrapped optimizer updates chunk i (its own ``step`` on that chunk's parameters only, so
the update is exactly the optimizer's: every supported optimizer updates a parameter from its
own state alone), and a writer thread writes chunk i back while chunk i+1 updates. Memory
for the step is bounded by about three chunks, not by the model. The threads overlap because
file reads and writes release the GIL (plain buffered files, `readinto` into preallocated
tensors, no copy; a maintained async-I/O library would add a dependency for the same
overlap on a local disk).

The folder is private to the run and held by it (`meshfit.parallel.offload_files`: created
with owner-only permissions and an OS lock on its marker; a folder a live run holds is
refused, one with files in it is refused unless an earlier run left it, marked and
unlocked) and removed by `close`, or when the object goes or the process exits, unless
`keep`. Each file is written to a temporary name and renamed, so a file is never
half-written, and the digest of what was written is kept in memory: a file read back is
checked against it before any of its bytes is used, so a file overwritten, truncated or
removed by anything else is one line naming the file and the rank, never a silently wrong
update. A write error (a full disk, ``ulimit -f``) is one line too, and the step's state
already in memory is not lost to a half-written file (the run stops; its last checkpoint is
intact). ``state_dict`` returns the offloaded tensors as memory maps of their files, checked
first (no copy in memory: a checkpoint of a model larger than memory streams them);
``load_state_dict`` writes them to the files (a state dict loaded into those maps in place
goes through it, as torch's ``set_optimizer_state_dict`` does). `mapped_state` (ZeRO-1's
checkpoints) lends maps that a load writes in place; `seal` then takes the digests of those
files as the load left them, so the next read checks them as any other.

Under ZeRO-3, `ParameterFiles` (``offload_params``) moves the parameter shards, the fp32
master weights, into memory-mapped files of a folder of their own beside the state's.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshfit._compat import fsdp as fsdp_internals
from meshfit.distributed import is_initialized
from meshfit.distributed.tensors import local_tensor
from meshfit.parallel.offload_files import (MARKER, OffloadFileError, check_read,
                                            check_writable, digest, free_bytes, hold, read_file,
                                            release, write_file)

__all__ = ["MARKER", "DiskOffload", "OffloadFileError", "ParameterFiles", "check_free_space",
           "check_writable", "disk_bandwidth", "free_bytes", "state_file_bytes"]


def _offloaded(param: torch.Tensor, value: Any) -> bool:
    """A state entry that goes to disk: a tensor of the parameter's own shape."""
    return isinstance(value, torch.Tensor) and value.shape == param.shape and value.numel() > 1


def state_file_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes the state of `optimizer` would take on disk per rank once every parameter has
    state (what `DiskOffload` writes): 8 B per local element for Adam/AdamW, 4 for SGD with
    momentum, 0 without."""
    per = {"Adam": 8, "AdamW": 8, "SGD": 4 if optimizer.defaults.get("momentum") else 0}
    each = per.get(type(optimizer).__name__)
    if each is None:
        raise ValueError(f"offload='disk' streams Adam, AdamW and SGD state; "
                         f"{type(optimizer).__name__} is not supported yet")
    return sum(local_tensor(p).numel() * each for g in optimizer.param_groups for p in g["params"]
               if p.requires_grad)


class DiskOffload(torch.optim.Optimizer):
    """`optimizer` with its per-parameter state in files under `folder` (see the module
    docstring). A torch.optim.Optimizer for isinstance checks and LR schedulers; the
    wrapped optimizer owns the parameter groups."""

    def __init__(self, optimizer: torch.optim.Optimizer, folder: str | os.PathLike, *,
                 chunk_bytes: int = 256 * 2**20, keep: bool = False, check: bool = True):
        # No super().__init__: the wrapped optimizer owns the parameters and their groups.
        state_file_bytes(optimizer)  # refuses optimizers whose state it cannot stream
        self.optimizer = optimizer
        self.folder = Path(folder)
        self.keep = keep
        self.check = check
        """Whether each file read back is checked against the digest of what was written
        (off only to measure what the check costs: benchmarks/disk_offload_check.py)."""
        self.rank = _rank()
        fd = hold(self.folder)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self._name = {id(p): f"p{i:05d}" for i, p in enumerate(params)}
        self._chunks: list[list[torch.Tensor]] = []
        chunk, size = [], 0
        for p in params:
            chunk.append(p)
            size += local_tensor(p).numel() * local_tensor(p).element_size() * 2
            if size >= chunk_bytes:
                self._chunks.append(chunk)
                chunk, size = [], 0
        if chunk:
            self._chunks.append(chunk)
        # {id(param): {key: (local shape, dtype)}} of what is on disk
        self._on_disk: dict[int, dict[str, tuple[torch.Size, torch.dtype]]] = {}
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="meshfit-disk-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="meshfit-disk-write")
        self._pending: list[Future] = []
        self._lock = threading.Lock()
        self._digests: dict[Path, int] = {}  # of each file as this run last wrote it
        self._lent: set[Path] = set()  # files whose memory maps were handed out
        self.bytes_read = self.bytes_written = 0
        self.seconds = {"reading": 0.0, "writing": 0.0, "updating": 0.0, "waiting": 0.0}
        """Summed over the steps: the threads' time reading and writing files, the time the
        step updated chunks, and the time it waited for a read or a write. The I/O hidden
        behind the update is ``1 - waiting / (reading + writing)``."""
        # the threads stopped and the folder removed (unless kept) when this object goes, or
        # at the interpreter's exit
        self._cleanup = weakref.finalize(self, _release, [self._reader, self._writer],
                                         str(self.folder), fd, keep)

    param_groups = property(lambda self: self.optimizer.param_groups,
                            lambda self, value: setattr(self.optimizer, "param_groups", value))
    defaults = property(lambda self: self.optimizer.defaults)
    state = property(lambda self: self.optimizer.state,
                     doc="In memory: the small state (``step``); the rest is on disk.")

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    # ---------------------------------------------------------------- files
    def _path(self, p: torch.Tensor, key: str) -> Path:
        return self.folder / f"{self._name[id(p)]}.{key}.bin"

    def _read(self, chunk: list[torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
        """The chunk's state from its files, each file checked against the digest of what
        was written before the chunk is handed to the update."""
        began = time.perf_counter()
        out: dict[int, dict[str, torch.Tensor]] = {}
        for p in chunk:
            for key, (shape, dtype) in self._on_disk.get(id(p), {}).items():
                local = torch.empty(shape, dtype=dtype)
                path = self._path(p, key)
                found = read_file(path, _bytes(local), rank=self.rank, hashed=self.check)
                size = local.numel() * local.element_size()
                with self._lock:  # (a file whose map was lent is taken as it is now)
                    lent = path in self._lent
                    expected = None if lent or found is None else self._digests.get(path)
                check_read(path, size, size, found, expected, rank=self.rank)
                with self._lock:  # (only a file that passed: a retry is checked again)
                    self._lent.discard(path)
                    self._digests[path] = found
                    self.bytes_read += size
                out.setdefault(id(p), {})[key] = local
        with self._lock:
            self.seconds["reading"] += time.perf_counter() - began
        return out

    def _write(self, items: list[tuple[Path, torch.Tensor]]) -> None:
        began = time.perf_counter()
        for path, local in items:
            written = write_file(path, _bytes(local), rank=self.rank, hashed=self.check)
            with self._lock:  # (the file is replaced: a map handed out no longer reaches it)
                self._lent.discard(path)
                self._digests[path] = written
                self.bytes_written += local.numel() * local.element_size()
        with self._lock:
            self.seconds["writing"] += time.perf_counter() - began

    def flush(self) -> None:
        """Wait for the last step's writes (their errors raise here)."""
        self._wait_writes()

    def _wait_writes(self) -> None:
        pending, self._pending = self._pending, []
        began = time.perf_counter()
        try:
            for future in pending:
                future.result()  # a write error surfaces here, as one line
        finally:
            self.seconds["waiting"] += time.perf_counter() - began

    # ---------------------------------------------------------------- the step
    def _place(self, p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """The state tensor of `p` holding `local` (a DTensor like `p` under FSDP2/TP)."""
        # deferred: torch.distributed.tensor adds ~0.5 s to the trainer's import, which loads
        # this module for every run (offload="disk" or not)
        from torch.distributed.tensor import DTensor

        local = local.to(local_tensor(p).device, non_blocking=True)
        if isinstance(p, DTensor):
            return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                      shape=p.shape, stride=p.stride())
        return local

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._wait_writes()  # the last step's writes end before any of its files is read
        groups = self.optimizer.param_groups
        every = [g["params"] for g in groups]
        reads = self._reader.submit(self._read, self._chunks[0])
        try:
            for i, chunk in enumerate(self._chunks):
                began = time.perf_counter()
                loaded = reads.result()
                self.seconds["waiting"] += time.perf_counter() - began
                if i + 1 < len(self._chunks):
                    reads = self._reader.submit(self._read, self._chunks[i + 1])
                ids = {id(p) for p in chunk}
                for p in chunk:
                    for key, local in loaded.get(id(p), {}).items():
                        self.optimizer.state[p][key] = self._place(p, local)
                for g, params in zip(groups, every):
                    g["params"] = [p for p in params if id(p) in ids]
                began = time.perf_counter()
                self.optimizer.step()
                evicted = self._evict(chunk)
                self.seconds["updating"] += time.perf_counter() - began
                self._pending.append(self._writer.submit(self._write, evicted))
        finally:
            for g, params in zip(groups, every):
                g["params"] = params
        return loss

    def _evict(self, chunk: list[torch.Tensor]) -> list[tuple[Path, torch.Tensor]]:
        """The chunk's offloaded state, taken out of memory, as (file, local tensor) pairs
        for the writer."""
        items = []
        for p in chunk:
            state = self.optimizer.state.get(p)
            if not state:
                continue
            for key in [k for k, v in state.items() if _offloaded(p, v)]:
                local = local_tensor(state.pop(key)).detach()
                if local.device.type != "cpu":
                    local = local.to("cpu")
                self._on_disk.setdefault(id(p), {})[key] = (local.shape, local.dtype)
                items.append((self._path(p, key), local))
        return items

    # ---------------------------------------------------------------- checkpoints
    def _mapped(self, p: torch.Tensor, key: str, *, lend: bool) -> torch.Tensor:
        """A memory map of the file of `p`'s `key`, checked as a read is (`read_file`);
        `lend`: whoever holds it may write the file (its next read takes it as it is)."""
        shape, dtype = self._on_disk[id(p)][key]
        path = self._path(p, key)
        n = 1
        for s in shape:
            n *= s
        try:  # (mapping a missing or short file is no error torch reports by file)
            size = path.stat().st_size
        except FileNotFoundError:
            size = None
        want = n * torch.empty((), dtype=dtype).element_size()
        check_read(path, size, want, None, None, rank=self.rank)
        local = torch.from_file(str(path), shared=True, size=n, dtype=dtype).view(shape)
        with self._lock:
            expected = None if path in self._lent or not self.check else self._digests.get(path)
        if expected is not None:  # (corrupted state is not saved into a checkpoint)
            check_read(path, want, want, digest(_bytes(local)), expected, rank=self.rank)
        if lend:
            with self._lock:
                self._lent.add(path)
        return self._place(p, local)

    def mapped_state(self, *, lend: bool = False) -> dict[torch.Tensor, dict[str, Any]]:
        """{parameter: its whole state}: the small entries from memory, the offloaded ones as
        memory maps of their files, each checked first. `lend`: the maps are written through
        (DCP loads into them in place), and their files are taken as they are by `seal`.
        New dicts; the wrapped optimizer's state is left as it is."""
        self._wait_writes()
        out = {p: dict(s) for p, s in self.optimizer.state.items()}
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                for key in self._on_disk.get(id(p), {}):
                    out.setdefault(p, {})[key] = self._mapped(p, key, lend=lend)
        return out

    def seal(self) -> None:
        """The files whose maps `mapped_state(lend=True)` handed out, hashed as they are now
        (what a checkpoint load wrote into them, itself checked against the checkpoint's
        digests): from here on a change to them on the disk is refused where it is read,
        as for every other file."""
        with self._lock:
            lent, self._lent = sorted(self._lent), set()
        for path in lent:
            size = path.stat().st_size
            local = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
            found = digest(_bytes(local))
            with self._lock:
                self._digests[path] = found

    def state_dict(self) -> dict:
        """The wrapped optimizer's state dict, its offloaded tensors as memory maps of their
        files, checked first (writes to them go to the files: DCP loads into them in place,
        then hands them to `load_state_dict`, which writes them anew)."""
        self._wait_writes()
        saved = {}
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                for key in self._on_disk.get(id(p), {}):
                    saved.setdefault(p, {})[key] = self._mapped(p, key, lend=False)
        for p, entries in saved.items():
            self.optimizer.state[p].update(entries)
        try:
            out = self.optimizer.state_dict()
            # (its per-parameter dicts are the live ones, about to lose the mapped entries)
            out["state"] = {i: dict(v) for i, v in out["state"].items()}
            return out
        finally:
            for p, entries in saved.items():
                for key in entries:
                    self.optimizer.state[p].pop(key, None)

    def load_state_dict(self, state_dict: dict) -> None:
        self._wait_writes()
        self.optimizer.load_state_dict(state_dict)
        items = []
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                state = self.optimizer.state.get(p, {})
                for key in [k for k, v in state.items() if _offloaded(p, v)]:
                    local = local_tensor(state.pop(key)).detach().to("cpu").clone()
                    self._on_disk.setdefault(id(p), {})[key] = (local.shape, local.dtype)
                    items.append((self._path(p, key), local))
        self._write(items)

    def close(self) -> None:
        """Finish the writes and remove the folder (unless `keep`)."""
        try:
            self._wait_writes()
        finally:
            self._cleanup()


def _bytes(local: torch.Tensor) -> memoryview:
    """The bytes of the contiguous CPU tensor `local`, without a copy."""
    return memoryview(local.contiguous().view(-1).view(torch.uint8).numpy())


def _rank() -> int | None:
    """This process's global rank, named in an error (None: one process)."""
    if is_initialized():
        return dist.get_rank()
    rank = os.environ.get("RANK")
    return int(rank) if rank is not None and rank.isdigit() else None


class ParameterFiles:
    """ZeRO-3's parameter shards in files (``offload_params``): each FSDP2 parameter's local
    shard (with its padding), the fp32 master weight, is moved into a file of `folder` and
    memory-mapped back in its place, so that the parameter, FSDP2's all-gather input and
    the optimizer's in-place update all use the file's pages.

    The model must be laid out with FSDP2's CPU offload policy (the shards on the host),
    without pinned memory (a pinned copy would be anonymous memory again). What is resident
    is then the page cache: the kernel reads a block's shard in when FSDP2 all-gathers it
    (ahead of use: FSDP2 prefetches the next block) and writes the optimizer's updates back;
    under memory pressure it drops clean pages instead of failing. 4-bit (tensor subclass)
    and empty shards stay as they are. The folder is private to the run and removed by
    `close`, when the object goes or at exit (unless `keep`); the mappings stay valid after
    (the files are unlinked, their pages stay until the model goes).

    Checked as the state files are: the digest of each file is kept in memory (`seal`: at
    creation, after each optimizer step and after a checkpoint load, the moments the run
    itself writes them), and `check` compares the files with it before they are used -- the
    first forward after a seal (a forward pre-hook that runs before FSDP2's all-gather), the
    optimizer step and a checkpoint save. A file another process changed through the disk
    (the map shares its pages) is then one line naming the file and the rank before any
    update or checkpoint takes it."""

    def __init__(self, model: torch.nn.Module, folder: str | os.PathLike, *,
                 keep: bool = False):
        self.hashing = True
        """Whether the files are sealed and checked (off only to measure what it costs:
        benchmarks/disk_offload_check.py --params; turned back on, `seal` first)."""
        params = fsdp_internals.fsdp_params(model)
        if not params:
            raise ValueError("offload_params=true: the model has no FSDP2 parameter shards; "
                             "use it with zero_stage=3 (dp_shard > 1)")
        self.folder = Path(folder)
        fd = hold(self.folder)
        self._cleanup = weakref.finalize(self, release, str(self.folder), fd, keep)
        self.rank = rank = _rank()
        self.bytes = 0
        """Bytes of parameter shards in files (this rank)."""
        self._files: list[tuple[Path, torch.Tensor]] = []
        self._digests: list[int] = []
        self._checked = True  # since the last seal
        for i, fsdp_param in enumerate(params):
            data = fsdp_internals.padded_shard(fsdp_param)
            if type(data) is not torch.Tensor or not data.is_floating_point() \
                    or data.numel() == 0:
                continue
            if data.device.type != "cpu":
                raise ValueError("offload_params=true needs the shards on the host (FSDP2's CPU "
                                 f"offload policy); this one is on {data.device}")
            path = self.folder / f"w{i:05d}.bin"
            self._digests.append(write_file(path, _bytes(data), rank=rank))
            mapped = torch.from_file(str(path), shared=True, size=data.numel(),
                                     dtype=data.dtype)
            # both views of the padded shard onto the file's pages, not pinned
            fsdp_internals.map_shard(fsdp_param, mapped.untyped_storage())
            self._files.append((path, mapped))
            self.bytes += data.numel() * data.element_size()
        self._hook = model.register_forward_pre_hook(self._before_forward, prepend=True)

    def seal(self) -> None:
        """Take each file's digest as it is now (the run has just written it)."""
        if not self.hashing:
            return
        self._digests = [digest(_bytes(mapped)) for _, mapped in self._files]
        self._checked = True

    def check(self) -> None:
        """Each file against its digest; `OffloadFileError` naming the first that differs."""
        if not self.hashing:
            return
        for (path, mapped), expected in zip(self._files, self._digests):
            size = mapped.numel() * mapped.element_size()
            try:  # (a shortened file would be a SIGBUS at the first page past its end)
                got = path.stat().st_size
            except FileNotFoundError:  # (removed: the map keeps the pages, checked below)
                got = size
            check_read(path, got, size, None, None, rank=self.rank)
            check_read(path, size, size, digest(_bytes(mapped)), expected, rank=self.rank)
        self._checked = True

    def _before_forward(self, module, args) -> None:
        if not self._checked:  # (once per step: accumulation's later forwards read the same)
            self.check()

    def after_step(self) -> None:
        """Called after each optimizer step: the files hold the update; the next forward
        checks them again."""
        self.seal()
        self._checked = False

    def close(self) -> None:
        """Remove the folder (unless `keep`)."""
        self._hook.remove()
        self._cleanup()


def _release(threads: list[ThreadPoolExecutor], folder: str, fd: int, keep: bool) -> None:
    for pool in threads:
        pool.shutdown(wait=True)
    release(folder, fd, keep)


def disk_bandwidth(folder: str | os.PathLike, nbytes: int = 2**30) -> tuple[float, float]:
    """(write, read) bytes/s of `folder`'s disk: one sequential file of `nbytes` written in
    64 MiB blocks and fsync'd, then read back after its pages are dropped from the page cache
    (``posix_fadvise(DONTNEED)``; where that is missing the read may be helped by the cache:
    an upper bound), then removed. The folder must exist."""
    path = Path(folder) / ".meshfit-bandwidth-probe"
    block = torch.ones(min(64 * 2**20, max(nbytes, 1)), dtype=torch.uint8).numpy()
    n = max(1, nbytes // block.nbytes)
    try:
        t0 = time.perf_counter()
        with open(path, "wb", buffering=0) as f:
            for _ in range(n):
                f.write(block)
            os.fsync(f.fileno())
        write = n * block.nbytes / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            if hasattr(os, "posix_fadvise"):  # (clean after the fsync: dropped, not written)
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                t0 = time.perf_counter()
            while f.readinto(block):
                pass
        read = n * block.nbytes / (time.perf_counter() - t0)
    finally:
        path.unlink(missing_ok=True)
    return write, read


def check_free_space(optimizer: torch.optim.Optimizer, folder: str | os.PathLike, *,
                     sharing: int = 1) -> int:
    """One line when the disk under `folder` has less free space than `sharing` ranks'
    state of `optimizer` (`state_file_bytes`) needs; returns the bytes this rank needs."""
    need = state_file_bytes(optimizer)
    free = free_bytes(folder)
    if need * sharing > free:
        raise ValueError(f"offload_dir={str(folder)!r}: the optimizer state needs "
                         f"{need * sharing / 2**30:.2f} GiB ({sharing} rank(s) x "
                         f"{need / 2**30:.2f}) and {free / 2**30:.2f} GiB is free there; "
                         "give a folder on a larger disk")
    return need
