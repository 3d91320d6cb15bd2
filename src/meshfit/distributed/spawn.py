"""One process spawner: a function run on N new local ranks, their results back in rank order.

For work that starts its own ranks without a launcher: `meshfit plan --validate` (each
candidate layout measured on real processes) and the test suite's multi-process tests. Each
rank is a child process with torchrun's variables set (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT a free port), joins the group through
`meshfit.distributed.init`, runs ``fn(rank, world_size, *args)`` and ends the way a gloo
rank must end: `settle_all` before `destroy_process_group` (see `meshfit.distributed.settle`:
a plain barrier then destruction can hang or abort). A rank's result travels back serialised
by `torch.save` (tensors sent as shared memory would vanish with the process); a rank that
fails sends its traceback instead.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue as queues
import socket
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["SpawnError", "free_port", "spawn"]


class SpawnError(RuntimeError):
    """A spawned rank failed (its traceback is in the message) or did not report back."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (bound to port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _rank_main(fn: Callable, rank: int, world_size: int, port: int, args: tuple, channel,
               environ: Mapping[str, str] | None, backend: str | None, cpu: bool) -> None:
    if environ is not None:  # a forked rank takes the parent's environment of now
        os.environ.clear()
        os.environ.update(environ)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    if cpu:
        os.environ["MESHFIT_CPU"] = "1"  # gloo + CPU even beside GPUs
    # torch, env.py and settle.py load here, not at the top: this module is torch-free at
    # import (the `meshfit` command imports it before it has refused a bad config).
    import torch
    import torch.distributed as dist

    from meshfit.distributed.env import is_initialized

    torch.seed()  # a random seed of its own, as a new interpreter has (forked: the parent's)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "OMP_NUM_THREADS" not in os.environ:  # as torchrun: one intra-op thread per rank
        torch.set_num_threads(1)
    try:
        from meshfit.distributed.env import init
        from meshfit.distributed.settle import settle_all

        init(backend=backend)
        result = fn(rank, world_size, *args)
        settle_all()  # no gloo worker thread needs the GIL when the groups go
        buf = io.BytesIO()
        torch.save(result, buf)
        channel.put((rank, "ok", buf.getvalue()))
    except BaseException:  # any failure reaches the parent with its traceback
        channel.put((rank, "error", traceback.format_exc()))
    finally:
        if is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
          context: mp.context.BaseContext | None = None, backend: str | None = None,
          cpu: bool = False) -> list:
    """``fn(rank, world_size, *args)`` on `world_size` new ranks; each rank's result, in rank
    order. `fn` must be a module-level function and its result picklable by `torch.save`.

    `timeout`: seconds for all the ranks together; `context`: the multiprocessing context
    (default "spawn": fresh interpreters; a "forkserver" that has imported torch starts ranks
    in a fraction of the time, and each rank then takes this process's current environment);
    `backend`: as `init` (None: NCCL on GPUs, else gloo); `cpu`: gloo on the CPU even beside
    GPUs. Raises `SpawnError` naming the first rank that failed, with its traceback, or the
    ranks that did not report back in time; the ranks are ended (only these, by handle)
    before it returns or raises."""
    ctx = context or mp.get_context("spawn")
    channel = ctx.Queue()
    port = free_port()
    environ = dict(os.environ) if ctx.get_start_method() != "spawn" else None
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, port, args, channel,
                                                  environ, backend, cpu))
             for r in range(world_size)]
    for p in procs:
        p.start()
    import torch  # here: this module is torch-free at import (see _rank_main)

    results: dict[int, object] = {}
    error = None
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size and error is None:
            rank, status, payload = channel.get(timeout=max(0.1, deadline - time.monotonic()))
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                error = f"rank {rank} failed:\n{payload}"
    except queues.Empty:  # the time is up
        missing = [r for r in range(world_size) if r not in results]
        error = f"ranks {missing} did not report back within {timeout:g} s"
    finally:
        for p in procs:
            p.join(timeout=30 if error is None else 5)
            if p.is_alive():
                p.kill()
                p.join()
    if error is not None:
        raise SpawnError(error)
    return [results[r] for r in range(world_size)]
