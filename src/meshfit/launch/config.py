"""What a launch starts where: `LaunchConfig` (checked as it is built) and the GPUs the
workers see (``--gpus 0,2``: those devices, in that order, as the multi-GPU guide does by hand
with ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER=PCI_BUS_ID``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LaunchConfig", "gpu_environment", "parse_gpus", "visible_cuda_devices"]


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
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


def parse_gpus(text: str, flag: str = "--gpus") -> tuple[int, ...]:
    """``0,2`` -> (0, 2): distinct device indices, as `flag` gives them."""
    try:
        ids = tuple(int(x) for x in text.split(",") if x.strip() != "")
    except ValueError:
        raise ValueError(f"{flag}={text!r} must be a comma-separated list of device indices, "
                         f"e.g. {flag} 0,2") from None
    if not ids or len(set(ids)) != len(ids) or min(ids) < 0:
        raise ValueError(f"{flag}={text!r} must list distinct device indices >= 0, e.g. 0,2")
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
    # PCI bus order: the indices are nvidia-smi's (CUDA's default is fastest first).
    return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpus)}


def visible_cuda_devices() -> int:
    """CUDA devices this machine has, counted in PCI bus order before any selection."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
