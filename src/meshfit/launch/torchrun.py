"""torchrun's argument list for a `LaunchConfig`, and the job run through
``torch.distributed.run`` in this process (meshfit does not re-implement the launcher), its
rendezvous stores listening on loopback only and node 0's port checked before it starts."""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import os
import signal
import socket
import sys

from meshfit.distributed.spawn import free_port
from meshfit.launch.resolve import LaunchConfig
from meshfit.launch.workers import (LAUNCHER_PID_ENV, MAX_RESTARTS_ENV, RESTART_ENV,
                                    failure_summary, quiet_agent, stopping_workers)

WORKER_ENTRY = "meshfit.launch"
"""The module torch's agent runs for each worker (`meshfit.launch.workers.enter_worker`,
through the package's ``__main__``), which then execs the worker's own command."""


def is_loopback(host: str) -> bool:
    """Whether `host` resolves to a loopback address (False when it does not resolve)."""
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def loopback_stores():
    """Make every TCPStore server the launcher starts for a loopback address listen on that
    address only. PyTorch's TCPStore server listens on every interface whatever address it is
    given (measured with torch 2.13: ``*:PORT`` for host "127.0.0.1"), so a single-node job's
    rendezvous — which holds the job's keys and barriers — would be reachable from the
    network. torch accepts an already listening socket instead (``master_listen_fd``); the
    launcher's stores (static rendezvous, c10d rendezvous backend, the workers' shared store)
    are given one bound to the loopback address. The workers only connect to the agent's
    store (torchrun's ``TORCHELASTIC_USE_AGENT_STORE``), they start no server of their own."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, \
        static_tcp_rendezvous

    real = dist.TCPStore

    class LoopbackTCPStore(real):
        def __init__(self, host_name, port, world_size=None, is_master=False, *args, **kwargs):
            if not (is_master and kwargs.get("master_listen_fd") is None
                    and is_loopback(host_name)):
                super().__init__(host_name, port, world_size, is_master, *args, **kwargs)
                return
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((socket.gethostbyname(host_name), int(port)))
                sock.listen(1024)
                kwargs["master_listen_fd"] = sock.fileno()
                super().__init__(host_name, sock.getsockname()[1], world_size, is_master,
                                 *args, **kwargs)
            except BaseException:
                sock.close()
                raise
            sock.detach()  # the store owns the descriptor now, and closes it

    patched = [(dist, "TCPStore"), (static_tcp_rendezvous, "TCPStore"),
               (c10d_rendezvous_backend, "TCPStore")]
    for module, name in patched:
        setattr(module, name, LoopbackTCPStore)
    try:
        yield
    finally:
        for module, name in patched:
            setattr(module, name, real)


def master_port_in_use(cfg: LaunchConfig) -> None:
    """One-line ValueError when node 0's rendezvous port is already taken, before anything
    starts (the store's bind would otherwise fail inside the agent, or a restart would wait
    on someone else's listener). Other nodes connect to node 0 and bind nothing."""
    if cfg.master_port is None or cfg.node_rank != 0:
        return
    host = cfg.master_addr if is_loopback(cfg.master_addr) or cfg.nnodes == 1 else ""
    try:
        addr = socket.gethostbyname(host) if host else ""
    except OSError:
        raise ValueError(f"--master-addr={cfg.master_addr!r} does not resolve to an address; "
                         "give a host name or IP address of node 0") from None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store binds
        try:
            s.bind((addr, cfg.master_port))
        except OSError as err:
            where = f"{cfg.master_addr}:{cfg.master_port}" if host else \
                f"port {cfg.master_port}"
            raise ValueError(f"--master-port={cfg.master_port}: {where} is not free "
                             f"({err.strerror}); give another port, or leave --master-port out "
                             "for a free one (single node)") from None


def torchrun_args(cfg: LaunchConfig, script: list[str], *, module: bool = False) -> list[str]:
    """torchrun's argument list for `cfg` followed by the script (or module) and its args."""
    port = cfg.master_port or free_port(cfg.master_addr)
    args = [f"--nnodes={cfg.nnodes}", f"--nproc-per-node={cfg.nproc}",
            f"--max-restarts={cfg.max_restarts}"]
    if cfg.max_restarts == 0:
        # Static rendezvous: node ranks as given, the store on master_addr (loopback by
        # default, so a single-node job is not joined from outside).
        args += [f"--node-rank={cfg.node_rank}", f"--master-addr={cfg.master_addr}",
                 f"--master-port={port}"]
    else:
        # The c10d rendezvous can restart the whole group after a failure (--max-restarts);
        # it assigns node ranks itself.
        args += ["--rdzv-backend=c10d", f"--rdzv-endpoint={cfg.master_addr}:{port}"]
        if cfg.nnodes == 1:
            args.append(f"--local-addr={cfg.master_addr}")
    if module:
        args.append("-m")
    return args + script


def _cores() -> int:
    """Cores this process may run on (a SLURM job's or a container's share), else all."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _say_where(cfg: LaunchConfig, target: list[str], prog: str) -> None:
    """A multi-node job's rendezvous is reachable from other machines by design: say where."""
    args = torchrun_args(cfg, target, module=True)
    port = next(a.split("=", 1)[1] for a in args
                if a.startswith(("--master-port=", "--rdzv-endpoint=")))
    where = port if ":" in port else f"{cfg.master_addr}:{port}"
    listens = "on loopback only" if is_loopback(cfg.master_addr) else "on every interface"
    print(f"{prog}: node {cfg.node_rank} of {cfg.nnodes}; the rendezvous store "
          f"is on {where} (node 0 listens there {listens})", file=sys.stderr)


def _attempt_args(cfg: LaunchConfig, target: list[str], attempt: int, ours: bool) -> list[str]:
    """torchrun's arguments for one attempt. Where meshfit restarts the group itself
    (`ours`), each attempt is a job without restarts of its own, on the given port first
    and a fresh one afterwards, told its attempt through the worker's environment."""
    if not ours:
        return torchrun_args(cfg, target, module=True)
    os.environ[RESTART_ENV] = str(attempt)
    os.environ[MAX_RESTARTS_ENV] = str(cfg.max_restarts)
    once = dataclasses.replace(cfg, max_restarts=0,
                               master_port=cfg.master_port if attempt == 0 else None)
    return torchrun_args(once, target, module=True)


def _attempts(cfg: LaunchConfig, target: list[str], prog: str) -> int:
    """Run the job's attempts until one succeeds or none is left; the exit code."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    parser = torchrun.get_args_parser()
    ours = cfg.nnodes == 1 and cfg.max_restarts > 0
    attempts = cfg.max_restarts + 1 if ours else 1
    with loopback_stores(), quiet_agent(), stopping_workers() as first:
        for attempt in range(attempts):
            try:
                torchrun.run(parser.parse_args(_attempt_args(cfg, target, attempt, ours)))
                return 0
            except ChildFailedError as err:
                summary = failure_summary(err.failures, first)
                first.clear()
                if attempt + 1 == attempts:
                    print(f"{prog}: {summary}", file=sys.stderr, flush=True)
                    return 1
                print(f"{prog}: {summary}; restarting the group ({attempt + 1} of "
                      f"{cfg.max_restarts}) on a fresh port", file=sys.stderr, flush=True)
    return 1


def run(cfg: LaunchConfig, script: list[str], *, module: bool = False,
        env: dict[str, str] | None = None, prog: str = "meshfit launch",
        say_stopped: bool = True) -> int:
    """Start the job through torch.distributed.run and wait; returns the exit code.
    `prog` begins the launcher's lines; `say_stopped=False` leaves the line about a signal
    to workers that print their own (`meshfit train`'s main rank).

    A single-node job with --max-restarts is restarted by meshfit, on a fresh loopback port
    per attempt, so no key, address or listener of the failed attempt is seen by the next
    one (torch 2.13's in-agent restart reuses the store, and measured 0 of 3 recoveries of a
    gloo script after ``kill -9`` of a worker). Multi-node jobs keep torchrun's own restarts
    (c10d rendezvous)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    os.environ.update(env or {})
    # torchrun sets one thread per worker (with a warning) when this is unset; share the
    # node's cores among the workers instead, which is the same on small machines.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _cores() // cfg.nproc)))
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    target = [WORKER_ENTRY, *(["-m"] if module else []), *script]
    if cfg.nnodes > 1:
        _say_where(cfg, target, prog)
    try:
        return _attempts(cfg, target, prog)
    except SignalException as err:  # the agent passed the signal on to the workers
        if say_stopped:
            name = signal.Signals(err.sigval).name
            print(f"{prog}: stopped by {name}; the workers were ended", file=sys.stderr,
                  flush=True)
        return 128 + int(err.sigval)
    finally:
        for name in (LAUNCHER_PID_ENV, RESTART_ENV, MAX_RESTARTS_ENV):
            os.environ.pop(name, None)
