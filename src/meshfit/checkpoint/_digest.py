"""Digests of checkpoint files: a digest by its manifest name (XXH3-128, or SHA-256 in format
1), and a file stream that hashes every block of what is written through it."""

from __future__ import annotations

import hashlib
import io

import xxhash

__all__ = ["BlockHashingStream", "new_digest"]


def new_digest(algorithm: str):
    """A fresh digest: "xxh3_128" (`xxhash`) or a `hashlib` name."""
    if algorithm == "xxh3_128":
        return xxhash.xxh3_128()
    return hashlib.new(algorithm)


class BlockHashingStream(io.RawIOBase):
    """A file opened for writing whose bytes also go through a digest per `block` bytes, in
    order; at `close`, `record(bytes written, [hex digest of each block])`. A seek (never
    made by DCP's writer) makes the digests unusable: nothing is recorded, and the file is
    hashed from disk instead."""

    def __init__(self, raw, record, *, block: int, algorithm: str):
        super().__init__()
        self._raw, self._record, self._block, self._algorithm = raw, record, block, algorithm
        self._digest, self._digests = new_digest(algorithm), []
        self._bytes, self._in_block, self._sequential = 0, 0, True

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        done = self._raw.write(view)
        done = len(view) if done is None else done
        rest = view if done == len(view) else view[:done]
        if self._in_block + done < self._block:  # (nearly every write: within a block)
            self._digest.update(rest)
            self._in_block += done
            self._bytes += done
            return done
        while len(rest):
            part = rest[:self._block - self._in_block]
            self._digest.update(part)
            self._in_block += len(part)
            rest = rest[len(part):]
            if self._in_block == self._block:
                self._digests.append(self._digest.hexdigest())
                self._digest, self._in_block = new_digest(self._algorithm), 0
        self._bytes += done
        return done

    def tell(self) -> int:
        return self._raw.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        self._sequential = False
        return self._raw.seek(offset, whence)

    def seekable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._raw.fileno()

    def flush(self) -> None:
        self._raw.flush()

    def close(self) -> None:
        if not self.closed and self._sequential:
            last = [self._digest.hexdigest()] if self._in_block else []
            self._record(self._bytes, self._digests + last)
        super().close()
