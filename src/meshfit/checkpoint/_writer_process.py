"""A writer process of each rank's own for background saves (``async_save="process"``): the
files are written by a process of its own, so that no writer thread holds the training
process's GIL.

Public APIs only: a spawned process (`torch.multiprocessing`, whose pickler shares the staged
tensors' memory instead of copying it), a `TCPStore`, `init_process_group` and `dcp.save`.
DCP's own process-based checkpointer (``async_save(async_checkpointer_type=PROCESS)``) keeps
its process in a private module global that no public call ends or replaces, logs INFO lines
at every request from the child, and after one rank's writer died it left the others' writers
in a process group with a dead peer: every later save failed, or waited forever (a new writer
in its rendezvous on one rank, `all_gather_object` on the other).

The writers of a save group's ranks form a gloo group of their own, meeting through a
`TCPStore` hosted by rank 0's training process, which outlives them. Each rank's wait for a
save watches its own writer: one that failed (died by any signal, exited, or could not start)
is recorded in the store with its rank and how; every rank's wait then ends (stopping its own
writer, which would wait for the failed peer in a collective) with the same one line, naming
that rank. At the next save the ranks agree that a writer is unusable (any failure, on any
rank) and each starts a new one, in a new group.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from meshfit.checkpoint.manifest import CheckpointError
from meshfit.distributed import is_initialized
from meshfit.distributed.env import peer_lost

__all__ = ["WriterProcessError", "close", "save"]

_POLL_S = 0.1
"""How often a rank waiting for its writer looks at it and at the store: a writer's death is
noticed within this."""
_PEER_GRACE_S = 5.0
"""How long a writer's error that says a peer has gone waits for that peer's rank to record
why (its writer's death, noticed within `_POLL_S`); past it, the error itself is reported."""
_READY, _STOP = "ready", "stop"


class WriterProcessError(CheckpointError):
    """A background save's writer process died or could not start; `rank`: the rank whose
    writer it was (every rank of the save reports the same)."""

    def __init__(self, rank: int, why: str):
        super().__init__(why)
        self.rank = rank


@dataclass(frozen=True)
class _Meeting:
    """Where the writers of a save group meet (rank 0's store), and this writer's place."""

    host: str
    port: int
    rank: int
    world: int


# ---------------------------------------------------------------------------- the process
def _writer_main(meeting: _Meeting | None, conn) -> None:
    """The writer process: joins the other ranks' writers in a gloo group of their own
    (`meeting`; None: a single process), says it is ready, then writes each state it is sent
    until told to stop or its training process is gone."""
    try:
        if meeting is not None:
            store = dist.TCPStore(meeting.host, meeting.port, is_master=False)
            dist.init_process_group("gloo", store=store, rank=meeting.rank,
                                    world_size=meeting.world)
        conn.send(_READY)
    except Exception as err:
        conn.send(_picklable(err))
        return
    try:
        _serve(conn, no_dist=meeting is None)
    finally:
        if is_initialized():
            dist.destroy_process_group()


def _serve(conn, *, no_dist: bool) -> None:
    """Write each (state, storage writer) received with `dcp.save`; answer None or the error."""
    import torch.distributed.checkpoint as dcp  # (~2 s of imports: the writer process's only)

    while True:
        try:
            request = conn.recv()
        except EOFError:  # (the training process is gone)
            return
        if isinstance(request, str) and request == _STOP:
            return
        try:
            with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
                warnings.simplefilter("ignore", UserWarning)
                dcp.save(request[0], storage_writer=request[1], no_dist=no_dist)
            answer = None
        except Exception as err:
            answer = _picklable(err)
        del request  # (the staged state's shared memory: not held between saves)
        conn.send(answer)


def _picklable(err: BaseException) -> BaseException:
    """`err`, or a RuntimeError of its text where it does not travel through a pipe."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}")


# ---------------------------------------------------------------------------- the rank's side
class _Writer:
    """This rank's writer process: started by its first save, sent one save at a time (by a
    thread of its own, which then waits for the answer and watches the writers), stopped."""

    def __init__(self, meeting: _Meeting | None, store, rank: int):
        self.meeting, self.store, self.rank = meeting, store, rank
        self.process = self.conn = None
        self.failed = False
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="meshfit-writer")

    @classmethod
    def meet(cls, group) -> _Writer:
        """A writer for this rank of `group`, where the writers meet agreed now (a collective
        over `group`): rank 0's training process hosts their store."""
        if not is_initialized():
            return cls(None, None, 0)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        store, where = None, [None]
        if rank == 0:
            host = os.environ.get("MASTER_ADDR") or socket.getfqdn()
            store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
            where = [(host, store.port)]
        dist.broadcast_object_list(where, group=group, group_src=0)
        host, port = where[0]
        if store is None:
            store = dist.TCPStore(host, port, is_master=False)
        return cls(_Meeting(host, port, rank, world), store, dist.get_rank())

    def usable(self) -> bool:
        return not self.failed and (self.process is None or self.process.is_alive())

    def submit(self, state: dict[str, Any], writer) -> Future:
        return self._pool.submit(self._save, state, writer)

    def _save(self, state: dict[str, Any], writer) -> None:
        try:
            if self.process is None:
                self._start()
            try:
                self.conn.send((state, writer))
            except OSError:  # (a writer gone already: `_answer` says how)
                pass
            self._answer()
        except BaseException as err:
            self.failed = True  # (a new set of writers for the next save)
            self._record(err)
            raise

    def _record(self, err: BaseException) -> None:
        """Record in the store that this rank's writer failed (not where the failure is
        another rank's), so that the other ranks' waits end instead of their writers waiting
        for this one in a collective."""
        if self.store is None or getattr(err, "rank", self.rank) != self.rank:
            return
        why = str(err) if isinstance(err, WriterProcessError) else (
            f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[-1][:200]}")
        try:
            self.store.set(f"failed/{self.meeting.rank}", json.dumps([self.rank, why]))
            self.store.add("failed", 1)
        except (RuntimeError, OSError):  # (rank 0's training process is gone: the job ends)
            pass

    def _start(self) -> None:
        context = mp.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_writer_main, args=(self.meeting, child),
                                       name=f"meshfit-writer-{self.rank}", daemon=True)
        self.process.start()
        child.close()  # (so that the writer's death is an end of file here)
        self._answer()

    def _answer(self) -> Any:
        """The writer's answer to what it was sent; its error raised (after waiting a moment
        for a peer's recorded failure, where it says a peer has gone); a writer dead here, or
        failed on another rank, a WriterProcessError naming that rank."""
        while not self.conn.poll(_POLL_S):
            if not self.process.is_alive():
                break
            peer = self._peer_failure()
            if peer is not None:
                self._kill()  # (it would wait for the dead peer in a collective)
                raise peer
        try:
            answer = self.conn.recv()
        except (EOFError, OSError):  # (dead; a reset where it died with a request unread)
            raise self._died() from None
        if isinstance(answer, BaseException):
            deadline = time.monotonic() + (_PEER_GRACE_S if peer_lost(answer) else 0.0)
            while (peer := self._peer_failure()) is None and time.monotonic() < deadline:
                time.sleep(_POLL_S)
            raise peer or answer
        return answer

    def _died(self) -> WriterProcessError:
        """This rank's writer has died: how."""
        self.process.join(timeout=5)
        code = self.process.exitcode
        if code is None:  # (its pipe broke, yet it runs: ended here)
            why = "its writer process stopped answering"
            self._kill()
        elif code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:  # (a real-time signal: no name)
                name = f"signal {-code}"
            why = f"its writer process was killed by {name}"
        else:
            why = f"its writer process exited with code {code}"
        return WriterProcessError(self.rank, why)

    def _peer_failure(self) -> WriterProcessError | None:
        """The recorded failure of the lowest rank's writer, if one has failed."""
        if self.store is None or not self.store.check(["failed"]):
            return None
        for r in range(self.meeting.world):
            if self.store.check([f"failed/{r}"]):
                return WriterProcessError(*json.loads(self.store.get(f"failed/{r}")))
        return None

    def _kill(self) -> None:
        if self.process is not None and self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)

    def close(self) -> None:
        """End the writer after its saves: asked to stop, then terminated if it has not
        within 5 s; one whose save failed is killed (it may wait for a dead peer)."""
        self._pool.shutdown(wait=True)
        if self.failed:
            self._kill()
        if self.process is not None and self.process.is_alive():
            try:
                self.conn.send(_STOP)
            except OSError:
                pass
            self.process.join(timeout=5)
            if self.process.is_alive():
                self.process.terminate()
                self.process.join(timeout=5)
            self._kill()
        if self.conn is not None:
            self.conn.close()
        self.store = None


_WRITER: _Writer | None = None
"""This process's writer (None: none started, or closed)."""


def save(state: dict[str, Any], writer, *, group, stager) -> Future:
    """Stage `state` with `stager` (into shared memory) and have this rank's writer process
    write it with `writer` (a DCP storage writer); a collective over `group` (every rank's
    training process calls it), which first agrees whether every rank's writer is usable and
    otherwise starts a new set. The future fails with a WriterProcessError where a writer
    died, or with the writer's error."""
    global _WRITER
    usable = _WRITER is not None and _WRITER.usable()
    everyone = [usable]
    if is_initialized():
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, usable, group=group)
    if not all(everyone):
        if _WRITER is not None:
            _WRITER.close()
        _WRITER = _Writer.meet(group)
    staged = stager.stage(state)
    if isinstance(staged, Future):
        staged = staged.result()
    return _WRITER.submit(staged, writer)


def close() -> None:
    """End this rank's writer process, after its saves (a later save starts another)."""
    global _WRITER
    writer, _WRITER = _WRITER, None
    if writer is not None:
        writer.close()
