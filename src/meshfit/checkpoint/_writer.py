"""DCP's file-system writer whose files are hashed as they are written
(`meshfit.checkpoint.save.hashing_writer`). A module of its own: it subclasses DCP's
classes, so importing it imports DCP, which `meshfit train` does not need before its first
save; and its classes are found by name in a process-based asynchronous save's writer
process, which unpickles the writer.

Files written through it carry no CRC-32 per record (`meshfit._compat.dcp.crc32_skipped`):
`torch.save` computes one by default (about 1.6 GB/s on one core, as slow as a fast disk),
`torch.load` never checks it, and the manifest's XXH3-128 digest of every block, checked
before any byte is used, replaces it."""

from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from meshfit._compat.dcp import crc32_skipped
from meshfit._files import atomic_write_text
from meshfit.checkpoint._digest import BlockHashingStream
from meshfit.distributed import is_initialized

__all__ = ["HashingFileSystem", "HashingWriter"]


class HashingFileSystem(FileSystem):
    """DCP's file system, whose files opened for writing are hashed as they are written, a
    digest per `block` bytes: {file name: (bytes, block digests)} in `digests`. Picklable (a
    process-based asynchronous save sends the writer to its writing process)."""

    def __init__(self, digests: dict[str, tuple[int, list[str]]], *, block: int,
                 algorithm: str):
        self.digests, self.block, self.algorithm = digests, block, algorithm
        self._lock = threading.Lock()

    def __getstate__(self):
        return {"digests": dict(self.digests), "block": self.block, "algorithm": self.algorithm}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path, mode):
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        name = Path(path).name

        def record(nbytes: int, blocks: list[str]) -> None:
            with self._lock:
                self.digests[name] = (nbytes, blocks)

        with open(path, mode) as raw, crc32_skipped():
            stream = BlockHashingStream(raw, record, block=self.block,
                                        algorithm=self.algorithm)
            try:
                yield stream
            finally:
                stream.close()

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        with self._lock:  # (DCP writes ".metadata.tmp", then renames it)
            if Path(path).name in self.digests:
                self.digests[Path(new_path).name] = self.digests.pop(Path(path).name)


class HashingWriter(FileSystemWriter):
    """DCP's file-system writer (fsyncing every file, as by default) over `HashingFileSystem`.
    `sidecar` (a file-name prefix): it runs in a process of its own (a process-based
    asynchronous save), so it also writes the digests into the folder, in a file per rank and
    one for the index, named `sidecar`..., where `commit` reads them."""

    def __init__(self, folder: Path, digests: dict, *, block: int, algorithm: str,
                 sidecar: str | None = None):
        super().__init__(str(folder), sync_files=True)
        self.fs = HashingFileSystem(digests, block=block, algorithm=algorithm)
        self.sidecar = sidecar

    def _leave(self, tag: str) -> None:
        if self.sidecar:
            atomic_write_text(Path(self.path) / f"{self.sidecar}{tag}.json",
                              json.dumps({k: list(v) for k, v in self.fs.digests.items()}))

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        future.wait()  # (written already: DCP's file-system writer returns a done future)
        rank = self.rank if self.rank is not None else (
            dist.get_rank() if is_initialized() else 0)
        self._leave(f"rank{rank}")
        return future

    def finish(self, metadata, results) -> None:
        super().finish(metadata, results)
        self._leave("index")
