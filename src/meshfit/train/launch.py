"""`meshfit launch`: torch.distributed.run (torchrun's elastic agent) with safer defaults.

meshfit does not re-implement the launcher: it builds torchrun's argument list and runs
``torch.distributed.run`` in this process. Differences from plain torchrun:

* a single-node job binds its rendezvous to 127.0.0.1 on a free port (torchrun's default is
  29500 on every interface, which collides between jobs);
* ``--gpus 0,2`` chooses the devices and their order, as the multi-GPU guide does by hand with
  ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER=PCI_BUS_ID``;
* every argument is checked before any process starts.

The workers see exactly torchrun's environment, so a script written for torchrun runs
unchanged under `meshfit launch` and the other way round.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import socket
import sys
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """What to start where."""

    nproc: int = 1
    """Worker processes on this node (torchrun's --nproc-per-node)."""
    nnodes: int = 1
    """Number of nodes (machines) in the job."""
    node_rank: int = 0
    """This node's rank among the nodes, 0 .. nnodes-1."""
    master_addr: str = "127.0.0.1"
    """Address of node 0, which hosts the rendezvous store."""
    master_port: int | None = None
    """Port of the rendezvous store; None: a free port (single node only)."""
    max_restarts: int = 0
    """How often the agent restarts the whole group after a worker fails."""
    gpus: tuple[int, ...] | None = None
    """CUDA devices to use, in this order (None: all visible ones)."""

    def __post_init__(self) -> None:
        for name in ("nproc", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)} must be >= 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank={self.node_rank} must be in 0..{self.nnodes - 1} "
                             f"(--nnodes={self.nnodes})")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts={self.max_restarts} must be >= 0")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError(f"--master-port={self.master_port} must be in 1..65535")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("--master-port is required with --nnodes > 1: every node must "
                             "name the same port on --master-addr")


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (bound to port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def parse_gpus(text: str) -> tuple[int, ...]:
    try:
        ids = tuple(int(x) for x in text.split(",") if x.strip() != "")
    except ValueError:
        raise ValueError(f"--gpus={text!r} must be a comma-separated list of device indices, "
                         "e.g. --gpus 0,2") from None
    if not ids or len(set(ids)) != len(ids) or min(ids) < 0:
        raise ValueError(f"--gpus={text!r} must list distinct device indices >= 0, e.g. 0,2")
    return ids


def gpu_environment(gpus: tuple[int, ...], nproc: int, available: int) -> dict[str, str]:
    """Environment that exposes `gpus`, in that order, to the workers."""
    missing = [g for g in gpus if g >= available]
    if missing:
        have = f"devices 0..{available - 1}" if available else "no CUDA devices"
        raise ValueError(f"--gpus names device(s) {','.join(map(str, missing))} but this machine "
                         f"has {have}; list only existing devices (nvidia-smi -L shows them)")
    if nproc > len(gpus):
        raise ValueError(f"--nproc={nproc} is more than the {len(gpus)} device(s) in --gpus; "
                         "start one process per device")
    # PCI bus order makes the indices match nvidia-smi's (CUDA's default is fastest first).
    return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpus)}


def visible_cuda_devices() -> int:
    """CUDA devices this machine has, counted in PCI bus order before any selection."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


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


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def loopback_stores():
    """Make every TCPStore server the launcher starts for a loopback address listen on
    that address only.

    PyTorch's TCPStore server listens on every interface whatever address it is given
    (measured with torch 2.13: ``*:PORT`` for host "127.0.0.1"), so a single-node job's
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
                    and _is_loopback(host_name)):
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


def run(cfg: LaunchConfig, script: list[str], *, module: bool = False,
        env: dict[str, str] | None = None) -> int:
    """Start the job through torch.distributed.run and wait; returns the exit code."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    os.environ.update(env or {})
    # torchrun sets one thread per worker (with a warning) when this is unset; share the
    # node's cores among the workers instead, which is the same on small machines.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.nproc)))
    parser = torchrun.get_args_parser()
    args = torchrun_args(cfg, script, module=module)
    if cfg.nnodes > 1:  # reachable from other machines by design: say where
        port = next(a.split("=", 1)[1] for a in args
                    if a.startswith(("--master-port=", "--rdzv-endpoint=")))
        where = port if ":" in port else f"{cfg.master_addr}:{port}"
        print(f"meshfit launch: node {cfg.node_rank} of {cfg.nnodes}; the rendezvous store "
              f"is on {where} (node 0 listens there on every interface)", file=sys.stderr)
    try:
        with loopback_stores():
            torchrun.run(parser.parse_args(args))
    except SignalException as err:  # the agent passed the signal on to the workers
        return 128 + int(err.sigval)
    except ChildFailedError as err:
        failures = err.failures  # global rank -> ProcessFailure
        detail = ""
        if failures:
            rank = min(failures)
            detail = f"; first: rank {rank} exit code {failures[rank].exitcode}"
        print(f"meshfit launch: {len(failures)} worker(s) failed{detail}", file=sys.stderr)
        return 1
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=1, help="worker processes on this node")
    parser.add_argument("--nnodes", type=int, default=1, help="number of nodes")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's rank")
    parser.add_argument("--master-addr", default="127.0.0.1", help="address of node 0")
    parser.add_argument("--master-port", type=int, default=None,
                        help="rendezvous port (default: a free port, single node)")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="restart the group this often after a worker fails")
    parser.add_argument("--gpus", default=None, help="CUDA devices in order, e.g. 0,2")


def config_from_args(ns: argparse.Namespace) -> tuple[LaunchConfig, dict[str, str]]:
    """Validated launch settings and the extra worker environment; raises ValueError."""
    gpus = parse_gpus(ns.gpus) if ns.gpus is not None else None
    cfg = LaunchConfig(nproc=ns.nproc, nnodes=ns.nnodes, node_rank=ns.node_rank,
                       master_addr=ns.master_addr, master_port=ns.master_port,
                       max_restarts=ns.max_restarts, gpus=gpus)
    env = gpu_environment(gpus, cfg.nproc, visible_cuda_devices()) if gpus else {}
    return cfg, env
