"""The launcher's network: rendezvous stores that listen on loopback only, and node 0's port
checked before anything starts."""

from __future__ import annotations

import contextlib
import ipaddress
import socket

from meshfit.launch.resolve import LaunchConfig


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
