"""Reading a format-3 checkpoint file: every 32 MiB block checked against the manifest
before any of its bytes is used, and each tensor copied once, from the page cache into its
destination.

DCP's own reader copies every tensor twice: `torch.load` reads the item into a fresh tensor,
then the destination copies that. `read_verified` instead reads only the item's header with
``torch.load(map_location="meta")`` (shape, strides, dtype, no data) and copies the bytes of
its storage record from the file's memory map into the destination; an item it cannot place
that way (another dtype, a strided destination, bytes of another byte order) is read as DCP
reads it.
"""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

import torch

from meshfit.checkpoint._digest import new_digest as _new_digest

__all__ = ["CheckpointError", "VerifiedStream", "read_verified"]


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as it is (one line: what differs, and where)."""


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
        import mmap

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
        digest = _new_digest("xxh3_128")
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
            from concurrent.futures import ThreadPoolExecutor

            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="meshfit-read")
            self._ahead = (nxt, self._pool.submit(self._hash, nxt))

    def _let_go(self, upto: int) -> None:
        """Unmap the blocks before `upto` from this process (read and copied: their pages stay
        in the page cache, unmapped, as a plain read leaves them, where the kernel reclaims
        them first when memory is short; touched again, they fault back in)."""
        import mmap

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
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            torch.frombuffer(bytes(1), dtype=torch.uint8)
        _FROMBUFFER_WARNED = True


class _Part(_ReadOnly):
    """Bytes [`base`, `base` + `length`) of `stream`, as a seekable file of their own."""

    def __init__(self, stream, base: int, length: int):
        super().__init__()
        self._stream, self._base, self._size, self._pos = stream, base, length, 0

    def readinto(self, b) -> int:
        want = max(0, min(len(b), self._size - self._pos))
        if not want:
            return 0
        self._stream.seek(self._base + self._pos)
        got = self._stream.readinto(memoryview(b).cast("B")[:want])
        self._pos += got
        return got


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
        meta = torch.load(part, map_location="meta", weights_only=True)  # (no data is read)
        part.seek(0)
        archive = torch._C.PyTorchFileReader(part)
        records = [n for n in archive.get_all_records() if n.startswith("data/")]
        if (not isinstance(meta, torch.Tensor) or len(records) != 1
                or not archive.has_record("byteorder")
                or bytes(archive.get_record("byteorder")).decode() != sys.byteorder):
            return False
        record, record_bytes = (archive.get_record_offset(records[0]),
                                archive.get_record_size(records[0]))
    except CheckpointError:
        raise
    except Exception:  # (anything torch.load reads otherwise: left to it)
        return False
    found = _narrow(meta, req.storage_offsets, req.lengths)
    _same_size(req, target, found)
    if found.dtype != target.dtype or not found.is_contiguous() or not _plain(found):
        return False
    first = found.storage_offset() * found.element_size()
    nbytes = found.numel() * found.element_size()
    if (first + nbytes > min(record_bytes, meta.untyped_storage().nbytes())
            or record + record_bytes > part._size):
        return False
    stream.copy_into(target.reshape(-1).view(torch.uint8), base + record + first)
    return True


def read_verified(reader, plan, planner) -> None:
    """DCP's `FileSystemReader.read_data` for files the reader's file system opens as a
    `VerifiedStream` (others are read as DCP reads them): each file's items in the order they
    lie in it; a tensor copied from the mapping into its destination (`_copy_mapped`) or,
    where that cannot be done, loaded with ``torch.load(weights_only=True)`` and copied;
    other values handed to the planner's `load_bytes`."""
    from torch.distributed.checkpoint.planner import LoadItemType

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
                    part.seek(0)
                    tensor = _narrow(torch.load(part, map_location="cpu", weights_only=True),
                                     req.storage_offsets, req.lengths)
                    _same_size(req, target, tensor)
                    target.copy_(tensor)
                planner.commit_tensor(req, target)
