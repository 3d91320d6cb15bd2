"""What the planner assumes of a machine when it has not measured it (`meshfit calibrate`
replaces these figures with measured ones).

Peak dense matmul throughput from the vendors' data sheets (no sparsity: half the
sheets' "with sparsity" figures): the planner takes `efficiency` of it as achievable.
`device_for_name` picks the entry of a CUDA device from its name (PCIe and NVL parts of
the H100/H200 have lower clocks and their own entries). Link figures are NCCL bus bandwidths
of the order nccl-tests reports for such machines, per GPU; latency per collective call.

"cpu" is this machine, not a data sheet: its memory is the host's physical memory, which
the ranks of a node share (`Device.shared`), and its processes talk over "loopback" (gloo's
TCP between processes of one host), not NVLink.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

__all__ = ["DEVICES", "INTERCONNECTS", "NETWORKS", "Device", "Link", "device_for_name",
           "parse_bytes"]

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
    fp32_ieee: float | None = None
    """Peak FLOP/s of fp32 matrix products without tensor cores (TF32 off, PyTorch's
    default for matmuls); None where `flops["fp32"]` already is that figure."""
    shared: bool = False
    """`memory` is one for all the ranks of a node (a CPU's host memory): each rank's
    budget is its share; False: `memory` is each rank's own (a GPU's)."""

    def memory_per_rank(self, ranks_per_node: int) -> float:
        """Bytes one of `ranks_per_node` ranks may use."""
        return self.memory / ranks_per_node if self.shared else self.memory

    def matmul_peak(self, dtype: str, *, tf32: bool = True) -> float:
        """Peak dense FLOP/s of matrix products in `dtype` ("fp32", "bf16", "fp16"); for
        fp32, TF32 tensor cores when `tf32`, plain fp32 units otherwise."""
        if dtype == "fp32" and not tf32 and self.fp32_ieee is not None:
            return self.fp32_ieee
        return self.flops[dtype]


@dataclass(frozen=True)
class Link:
    bandwidth: float
    """Bus bandwidth per rank, bytes/s."""
    latency: float
    """Seconds per collective call."""

    def __post_init__(self):  # (the cost model divides by the bandwidth)
        if not (0 < self.bandwidth < math.inf and 0 <= self.latency < math.inf):
            raise ValueError(f"Link(bandwidth={self.bandwidth!r}, latency={self.latency!r}): "
                             "the bandwidth must be > 0 bytes/s and the latency >= 0 s, both "
                             "finite")


def _host_memory() -> float:
    """This machine's physical memory in bytes (16 GiB where the OS does not say)."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):  # (no sysconf, or not these names)
        return 16.0 * GiB


DEVICES = {
    # name: memory, {fp32 (TF32 tensor cores), bf16, fp16} dense, fp32 without tensor cores
    "h100": Device("h100", 80 * GiB, {"fp32": 494e12, "bf16": 989e12, "fp16": 989e12},
                   fp32_ieee=67e12),
    "h100-pcie": Device("h100-pcie", 80 * GiB,
                        {"fp32": 378e12, "bf16": 756e12, "fp16": 756e12}, fp32_ieee=51e12),
    "h100-nvl": Device("h100-nvl", 94 * GiB,
                       {"fp32": 417e12, "bf16": 835e12, "fp16": 835e12}, fp32_ieee=60e12),
    "h200": Device("h200", 141 * GiB, {"fp32": 494e12, "bf16": 989e12, "fp16": 989e12},
                   fp32_ieee=67e12),
    "h200-nvl": Device("h200-nvl", 141 * GiB,
                       {"fp32": 417e12, "bf16": 835e12, "fp16": 835e12}, fp32_ieee=60e12),
    "a100": Device("a100", 80 * GiB, {"fp32": 156e12, "bf16": 312e12, "fp16": 312e12},
                   fp32_ieee=19.5e12),
    "v100": Device("v100", 32 * GiB, {"fp32": 15.7e12, "bf16": 15.7e12, "fp16": 125e12}),
    "l4": Device("l4", 24 * GiB, {"fp32": 60e12, "bf16": 121e12, "fp16": 121e12},
                 fp32_ieee=30.3e12),
    "t4": Device("t4", 16 * GiB, {"fp32": 8.1e12, "bf16": 8.1e12, "fp16": 65e12}),
    # this machine's memory, shared by its ranks; FLOP/s of the order of one x86 core's
    # AVX-512 fp32 (bf16/fp16 without AMX: emulated, slower)
    "cpu": Device("cpu", _host_memory(), {"fp32": 5e10, "bf16": 1e10, "fp16": 1e10},
                  efficiency=0.5, host_link=1e12, shared=True),
}


def device_for_name(name: str) -> tuple[str, Device] | None:
    """The `DEVICES` entry of a CUDA device called `name` (``torch.cuda.get_device_name``,
    e.g. "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA A100-SXM4-80GB"); None for an
    unknown device."""
    words = re.split(r"[^a-z0-9]+", name.lower())
    for family in ("h100", "h200", "a100", "v100", "l4", "t4"):
        if not any(w == family or (len(family) > 2 and w.startswith(family)) for w in words):
            continue
        for variant in ("pcie", "nvl"):
            if variant in words and f"{family}-{variant}" in DEVICES:
                return f"{family}-{variant}", DEVICES[f"{family}-{variant}"]
        return family, DEVICES[family]
    return None


INTERCONNECTS = {"nvlink": Link(bandwidth=360e9, latency=10e-6),  # inside a node
                 "pcie": Link(bandwidth=20e9, latency=15e-6),
                 # CPU processes of one host (gloo over TCP): of the order `meshfit
                 # calibrate --cpu` measures on a 2-core machine (all-reduce ~1.3 GB/s bus
                 # bandwidth, 0.2-0.5 ms per call)
                 "loopback": Link(bandwidth=1e9, latency=300e-6)}
# between nodes, per GPU (one NIC per GPU on InfiniBand machines)
NETWORKS = {"infiniband": Link(bandwidth=40e9, latency=8e-6),
            "ethernet": Link(bandwidth=3e9, latency=40e-6)}


def parse_bytes(text: str, field: str = "--gpu-memory") -> float:
    """"80GiB", "80 GB", "16g", "1.5TiB", or a number of bytes; one-line error otherwise."""
    units = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6,
             "mib": 2**20, "g": GiB, "gb": 1e9, "gib": GiB, "t": 2**40, "tb": 1e12,
             "tib": 2**40}
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in units or float(match.group(1)) <= 0:
        raise ValueError(f"{field}={text!r} is not a memory size; write e.g. 80GiB, 40GB or "
                         "16g")
    return float(match.group(1)) * units[match.group(2).lower()]
