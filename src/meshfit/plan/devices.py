"""What the planner assumes of a machine when it has not measured it (`meshfit calibrate`
replaces these figures with measured ones).

Peak dense matmul throughput from the vendors' data sheets (SXM parts; no sparsity): the
planner takes `efficiency` of it as achievable. Link figures are NCCL bus bandwidths of the
order nccl-tests reports for such machines, per GPU; latency per collective call.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEVICES", "INTERCONNECTS", "NETWORKS", "Device", "Link", "parse_bytes"]

GiB = 2**30


@dataclass(frozen=True)
class Device:
    name: str
    memory: float
    """Bytes of device memory."""
    flops: dict[str, float]
    """Peak dense FLOP/s by dtype: fp32 (tf32 tensor cores where they exist), bf16, fp16."""
    efficiency: float = 0.5
    """Share of the peak a transformer's matmuls reach in practice (MFU-style)."""
    host_link: float = 25e9
    """Bytes/s between host and device memory (CPU offload traffic)."""


@dataclass(frozen=True)
class Link:
    bandwidth: float
    """Bus bandwidth per rank, bytes/s."""
    latency: float
    """Seconds per collective call."""


DEVICES = {
    "h100": Device("h100", 80 * GiB, {"fp32": 494e12, "bf16": 989e12, "fp16": 989e12}),
    "h200": Device("h200", 141 * GiB, {"fp32": 494e12, "bf16": 989e12, "fp16": 989e12}),
    "a100": Device("a100", 80 * GiB, {"fp32": 156e12, "bf16": 312e12, "fp16": 312e12}),
    "v100": Device("v100", 32 * GiB, {"fp32": 15.7e12, "bf16": 15.7e12, "fp16": 125e12}),
    "l4": Device("l4", 24 * GiB, {"fp32": 60e12, "bf16": 121e12, "fp16": 121e12}),
    "t4": Device("t4", 16 * GiB, {"fp32": 8.1e12, "bf16": 8.1e12, "fp16": 65e12}),
    "cpu": Device("cpu", 16 * GiB, {"fp32": 5e10, "bf16": 1e10, "fp16": 1e10},
                  efficiency=0.5, host_link=1e12),
}

INTERCONNECTS = {  # inside a node
    "nvlink": Link(bandwidth=360e9, latency=10e-6),
    "pcie": Link(bandwidth=20e9, latency=15e-6),
}

NETWORKS = {  # between nodes, per GPU (one NIC per GPU on InfiniBand machines)
    "infiniband": Link(bandwidth=40e9, latency=8e-6),
    "ethernet": Link(bandwidth=3e9, latency=40e-6),
}


def parse_bytes(text: str, field: str = "--gpu-memory") -> float:
    """"80GiB", "80 GB", "16g", "1.5TiB", or a number of bytes; one-line error otherwise."""
    import re

    units = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6,
             "mib": 2**20, "g": GiB, "gb": 1e9, "gib": GiB, "t": 2**40, "tb": 1e12,
             "tib": 2**40}
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in units or float(match.group(1)) <= 0:
        raise ValueError(f"{field}={text!r} is not a memory size; write e.g. 80GiB, 40GB or "
                         "16g")
    return float(match.group(1)) * units[match.group(2).lower()]
