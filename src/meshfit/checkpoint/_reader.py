"""DCP's reader made safe (`SafeReader`, `SafePlanner`), and a format-3 checkpoint file read
with every 32 MiB block checked against the manifest before any of its bytes is used, each
tensor copied once, from the page cache into its destination. A module of its own, imported
at the first load: it subclasses DCP's classes (~2 s of imports with the DTensor and sympy DCP
pulls in, which `meshfit train` does not need at its start).

Safe: DCP reads its ``.metadata`` with `pickle.load` and its non-tensor values with
``torch.load(weights_only=False)``, either of which runs arbitrary code from a crafted file.
Here the index goes through an unpickler that only builds DCP's own metadata classes, torch
sizes, dtypes and layouts (`MetadataUnpickler`), and values through
``torch.load(weights_only=True)`` (`SafePlanner`).

Checked: with the manifest, a data file of format 3 is opened as a `VerifiedStream`, which
returns no byte of a block before the block's digest has matched (the next block is hashed
ahead by a thread while the current one is copied), so a corrupted block stops the load on
every rank before any of its bytes reaches a tensor (the blocks before it have been loaded,
each checked: what a failed load leaves in the model is checkpoint data, not the whole of
it); formats 1 and 2 are checked whole when first opened.

Copied once: DCP's own reader copies every tensor twice (`torch.load` reads the item into a
fresh tensor, then the destination copies that). `read_verified` instead reads only the item's
header with ``torch.load(map_location="meta")`` (shape, strides, dtype, no data) and copies the
bytes of its storage record, found in `torch.save`'s zip archive, from the file's memory map
into the destination; an item it cannot place that way (another dtype, a strided destination,
bytes of another byte order) is read as DCP reads it.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import mmap
import os
import pickle
import struct
import sys
import warnings
import zipfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType

from meshfit._compat.dcp import INDEX_PRIVATE_GLOBALS
from meshfit.checkpoint._digest import new_digest
from meshfit.checkpoint.manifest import CheckpointError, Manifest, checked, expected

__all__ = ["CheckingFileSystem", "MetadataUnpickler", "SafePlanner", "SafeReader",
           "VerifiedStream", "put", "read_verified"]


# ---------------------------------------------------------------------------- DCP, made safe
class MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata and nothing else."""

    _MODULES = ("torch.distributed.checkpoint.metadata",)
    _NAMES = {("torch", "Size"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
              ("pathlib", "PurePosixPath"), *INDEX_PRIVATE_GLOBALS}

    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if module in self._MODULES or (module, name) in self._NAMES or dtype:
            return super().find_class(module, name)
        raise CheckpointError(f"checkpoint metadata refers to {module}.{name}, which a DCP "
                              "index never holds; refusing to unpickle it")


class CheckingFileSystem(FileSystem):
    """DCP's file system, whose data files opened for reading are checked against `manifest`
    (None: not checked) before any of their bytes is used: format 3 opened as a
    `VerifiedStream` (each block as it is read); formats 1 and 2 hashed whole when first opened
    (from a memory map; the read after the check finds the page cache)."""

    def __init__(self, folder: Path, manifest: Manifest | None):
        super().__init__()
        self.folder, self.manifest, self.checked = Path(folder), manifest, set()

    @contextmanager
    def create_stream(self, path, mode):
        name = Path(path).name
        if self.manifest is None or "r" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        digests, block = expected(self.manifest, name)
        if block:
            stream = VerifiedStream(Path(path), self.manifest.files[name]["bytes"], block,
                                    digests)
            try:
                yield stream
            finally:
                stream.close()
            return
        if name not in self.checked:
            problem = checked(self.folder, self.manifest, [name])
            if problem:
                raise CheckpointError(problem)
            self.checked.add(name)
        with super().create_stream(path, mode) as stream:
            yield stream


class SafeReader(FileSystemReader):
    """DCP's file-system reader of `folder`, reading the index through `MetadataUnpickler`
    (`index`: read already) and, with `manifest`, each data file checked
    (`CheckingFileSystem`; format 3: read by `read_verified`, one pass over the file, each
    tensor copied once). Each file's items are read in the order they lie in it."""

    def __init__(self, folder: Path, index=None, manifest: Manifest | None = None):
        super().__init__(str(folder))
        self.fs = CheckingFileSystem(folder, manifest)
        self._index, self._manifest = index, manifest

    def read_metadata(self, *args, **kwargs):
        if self._index is not None:  # (read already, through the same unpickler)
            self._index.storage_meta.load_id = self.load_id
            return self._index
        rank = kwargs.get("rank")  # (DCP's names for the index of a save by rank, or not)
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        with open(Path(self.path) / name, "rb") as fh:
            metadata = MetadataUnpickler(fh).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        where = self.storage_data
        if self._manifest is None or any(getattr(where[item.storage_index],
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


def put(root, path, value) -> None:
    """``root[path[0]][path[1]]... = value``, making the containers on the way: DCP's path of
    a flattened key into a nested state dict (dict keys, list positions)."""
    for key, inner in itertools.pairwise(path):
        new = {} if isinstance(inner, str) else []
        if isinstance(root, dict):
            root = root.setdefault(key, new)
            continue
        root.extend([None] * (key + 1 - len(root)))
        if root[key] is None:
            root[key] = new
        root = root[key]
    if isinstance(root, list):
        root.extend([None] * (path[-1] + 1 - len(root)))
    root[path[-1]] = value


class SafePlanner(DefaultLoadPlanner):
    """DCP's load planner, reading values with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)  # primitives only, never code
        if self.flatten_state_dict:
            put(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


# ---------------------------------------------------------------------------- checked reading
class _ReadOnly(io.RawIOBase):
    """A seekable file read with `readinto`, `_size` bytes long, at `_pos`."""

    _size = _pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = offset + (0 if whence == 0 else self._pos if whence == 1 else self._size)
        return self._pos


class VerifiedStream(_ReadOnly):
    """A checkpoint file opened for reading (format 3) that returns no byte of a block before
    the block's digest has matched the manifest's. The file is memory-mapped; a thread hashes
    the next block ahead (reading it from the disk as it goes; XXH3 releases the GIL) while
    the caller deserializes the current one. The bytes are copied once, from the page cache
    to the caller, as a plain read does (`copy_into`: straight into a tensor): one pass over
    the file at the disk's speed, in place of a check pass before the read."""

    def __init__(self, path: Path, size: int, block: int, digests: list[str]):
        super().__init__()
        self._path, self._size, self._block, self._digests = path, size, block, digests
        self._pos, self._checked, self._ahead, self._pool = 0, set(), None, None
        self._lo = self._hi = 0  # the checked span [lo, hi) last served from
        self._released = 0  # bytes [0, released) unmapped from this process (`_let_go`)
        with open(path, "rb") as fh:
            mapped = os.fstat(fh.fileno()).st_size
            self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if mapped else None
        if self._map is not None and hasattr(self._map, "madvise"):
            self._map.madvise(mmap.MADV_SEQUENTIAL)
        self._view = memoryview(self._map) if self._map is not None else memoryview(b"")
        self._mapped = mapped

    def readinto(self, b) -> int:
        pos, n = self._pos, len(b)
        if self._lo <= pos and pos + n <= self._hi:  # (most reads: within the block at hand)
            memoryview(b).cast("B")[:] = self._view[pos:pos + n]
            self._pos = pos + n
            return n
        out, done = memoryview(b).cast("B"), 0
        while done < n and self._pos < self._size:
            k = self._pos // self._block
            self._check(k)
            self._lo, self._hi = k * self._block, min((k + 1) * self._block, self._size)
            take = min(n - done, self._hi - self._pos)
            out[done:done + take] = self._view[self._pos:self._pos + take]
            done += take
            self._pos += take
        return done

    def copy_into(self, dst: torch.Tensor, start: int) -> None:
        """Fill `dst` (bytes: a uint8 tensor, on any device) with the file's bytes from
        `start`, each block checked before its bytes are copied, while the next is hashed."""
        n, done = dst.numel(), 0
        while done < n:
            pos = start + done
            k = pos // self._block
            self._check(k)
            take = min(n - done, (k + 1) * self._block - pos)
            _quiet_frombuffer()
            dst[done:done + take].copy_(torch.frombuffer(self._map, dtype=torch.uint8,
                                                         count=take, offset=pos))
            done += take

    def _hash(self, k: int) -> None:
        start = k * self._block
        end = min(start + self._block, self._size)
        if end > self._mapped:
            raise CheckpointError(f"{self._path}: ends at byte {self._mapped}, the manifest "
                                  f"says {self._size} (truncated while loading)")
        digest = new_digest("xxh3_128")
        digest.update(self._view[start:end])
        if k >= len(self._digests) or digest.hexdigest() != self._digests[k]:
            raise CheckpointError(f"{self._path}: checksum differs from the manifest "
                                  f"(corrupted), in bytes {start}-{end}")

    def _check(self, k: int) -> None:
        if k not in self._checked:
            ahead, self._ahead = self._ahead, None
            if ahead is not None and ahead[0] == k:
                ahead[1].result()
            else:
                if ahead is not None:
                    ahead[1].exception()  # (wait; its error, if any, comes when it is read)
                self._hash(k)
            self._checked.add(k)
            self._let_go(k - 1)
        nxt = k + 1
        if (self._ahead is None and nxt * self._block < self._size
                and nxt not in self._checked):
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="meshfit-read")
            self._ahead = (nxt, self._pool.submit(self._hash, nxt))

    def _let_go(self, upto: int) -> None:
        """Unmap the blocks before `upto` from this process (read and copied: their pages stay
        in the page cache, unmapped, as a plain read leaves them, where the kernel reclaims
        them first when memory is short; touched again, they fault back in)."""
        end = min(max(upto, 0) * self._block, self._mapped)
        end -= end % mmap.PAGESIZE
        if end > self._released and hasattr(mmap, "MADV_DONTNEED"):
            try:
                self._map.madvise(mmap.MADV_DONTNEED, self._released, end - self._released)
            except OSError:  # (advice only)
                return
            self._released = end

    def close(self) -> None:
        if not self.closed:
            if self._ahead is not None:
                self._ahead[1].exception()  # (wait: it reads the mapping)
            if self._pool is not None:
                self._pool.shutdown()
            self._view.release()
            if self._map is not None:
                try:
                    self._map.close()
                except BufferError:  # (a tensor still views it: unmapped when it is freed)
                    pass
        super().close()


_FROMBUFFER_WARNED = False


def _quiet_frombuffer() -> None:
    """`torch.frombuffer` of a read-only buffer (the file's mapping, only ever read here)
    warns once per process that the tensor could be written through: have that once happen
    here, silenced."""
    global _FROMBUFFER_WARNED
    if not _FROMBUFFER_WARNED:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            torch.frombuffer(bytes(1), dtype=torch.uint8)
        _FROMBUFFER_WARNED = True


class _Part(_ReadOnly):
    """Bytes [`base`, `base` + `length`) of `stream`, as a seekable file of their own.
    `error`: the CheckpointError a read of it raised (a block whose digest differs), kept
    because torch's C++ archive reader, reading through `readinto`, replaces an error of the
    file object by one of its own (it said "'_Part' object has no attribute 'read'")."""

    def __init__(self, stream, base: int, length: int):
        super().__init__()
        self._stream, self._base, self._size, self._pos = stream, base, length, 0
        self.error: CheckpointError | None = None

    @property
    def size(self) -> int:
        return self._size

    def readinto(self, b) -> int:
        want = max(0, min(len(b), self._size - self._pos))
        if not want:
            return 0
        self._stream.seek(self._base + self._pos)
        try:
            got = self._stream.readinto(memoryview(b).cast("B")[:want])
        except CheckpointError as err:
            self.error = err
            raise
        self._pos += got
        return got


def _load(part: _Part, **kwargs):
    """``torch.load(part, weights_only=True)``; a block of it whose digest differs is that
    CheckpointError, not torch's error about the archive."""
    part.seek(0)
    try:
        return torch.load(part, weights_only=True, **kwargs)
    except Exception:
        if part.error is not None:
            raise part.error from None
        raise


def _record(part: _Part) -> tuple[int, int] | None:
    """(offset, bytes) of the one storage record of the `torch.save` archive `part`, read
    with the standard library's `zipfile` (the archive is a zip file whose records are stored
    uncompressed, the format torch documents); None where it holds another number of
    records, or bytes of another byte order than this machine's."""
    with zipfile.ZipFile(part) as archive:  # (reads the central directory only)
        infos = {info.filename.partition("/")[2]: info for info in archive.infolist()}
        data = [info for name, info in infos.items() if name.startswith("data/")]
        if len(data) != 1 or "byteorder" not in infos:
            return None
        order = _stored(part, infos["byteorder"])
        if order is None or part.read(order[1]) != sys.byteorder.encode():
            return None
        return _stored(part, data[0])


def _stored(part: _Part, info: zipfile.ZipInfo) -> tuple[int, int] | None:
    """(offset, bytes) of a record stored uncompressed, `part` positioned at its offset (not
    `ZipFile.read`: the CRC-32 it checks is left out of a checkpoint's files, whose blocks
    are hashed instead)."""
    if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
        return None
    part.seek(info.header_offset)
    header = part.read(30)  # the local file header: its name and extra field come next
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        return None
    name_bytes, extra_bytes = struct.unpack("<HH", header[26:30])
    offset = info.header_offset + 30 + name_bytes + extra_bytes
    part.seek(offset)
    return offset, info.file_size


def _narrow(tensor: torch.Tensor, offsets, lengths) -> torch.Tensor:
    """The part of a saved chunk a read item asks for."""
    for dim, (offset, length) in enumerate(zip(offsets, lengths)):
        if offset != 0 or length != tensor.size(dim):
            tensor = tensor.narrow(dim, offset, length)
    return tensor


def _same_size(req, target: torch.Tensor, found: torch.Tensor) -> None:
    if target.size() != found.size():
        raise RuntimeError(f"{req.storage_index.fqn}: the checkpoint holds a part of size "
                           f"{tuple(found.size())}, this job's is {tuple(target.size())}")


def _plain(tensor) -> bool:
    """A dense tensor whose bytes are its values (no subclass, no conjugate or negative view
    bit, not quantized)."""
    return (type(tensor) is torch.Tensor and tensor.layout == torch.strided
            and not tensor.is_quantized and not tensor.is_conj() and not tensor.is_neg())


def _copy_mapped(stream: VerifiedStream, part: _Part, base: int, req,
                 target: torch.Tensor) -> bool:
    """Copy the item's tensor from the file's mapping straight into `target`; False (nothing
    copied) where that cannot be done."""
    if target.numel() == 0 or not target.is_contiguous() or not _plain(target):
        return False
    try:
        meta = _load(part, map_location="meta")  # (no data is read)
        where = _record(part) if isinstance(meta, torch.Tensor) else None
    except Exception:  # (anything torch.load reads otherwise: left to it)
        if part.error is not None:
            raise part.error from None
        return False
    if where is None:
        return False
    record, record_bytes = where
    found = _narrow(meta, req.storage_offsets, req.lengths)
    _same_size(req, target, found)
    if found.dtype != target.dtype or not found.is_contiguous() or not _plain(found):
        return False
    first = found.storage_offset() * found.element_size()
    nbytes = found.numel() * found.element_size()
    if (first + nbytes > min(record_bytes, meta.untyped_storage().nbytes())
            or record + record_bytes > part.size):
        return False
    stream.copy_into(target.reshape(-1).view(torch.uint8), base + record + first)
    return True


def read_verified(reader, plan, planner) -> None:
    """DCP's `FileSystemReader.read_data` for files the reader's file system opens as a
    `VerifiedStream` (others are read as DCP reads them): each file's items in the order they
    lie in it; a tensor copied from the mapping into its destination (`_copy_mapped`) or,
    where that cannot be done, loaded with ``torch.load(weights_only=True)`` and copied;
    other values handed to the planner's `load_bytes`."""
    where = reader.storage_data
    per_file: dict[str, list] = {}
    for req in sorted(plan.items, key=lambda r: (str(where[r.storage_index].relative_path),
                                                 where[r.storage_index].offset)):
        per_file.setdefault(where[req.storage_index].relative_path, []).append(req)
    for relative_path, reqs in per_file.items():
        path = reader.fs.concat_path(reader.path, relative_path)
        with reader.fs.create_stream(path, "rb") as stream:
            for req in reqs:
                info = where[req.storage_index]
                part = _Part(stream, info.offset, info.length)
                if req.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(req, io.BytesIO(part.read()))
                    continue
                target = planner.resolve_tensor(req).detach()
                if not (isinstance(stream, VerifiedStream)
                        and _copy_mapped(stream, part, info.offset, req, target)):
                    tensor = _narrow(_load(part, map_location="cpu"), req.storage_offsets,
                                     req.lengths)
                    _same_size(req, target, tensor)
                    target.copy_(tensor)
                planner.commit_tensor(req, target)
