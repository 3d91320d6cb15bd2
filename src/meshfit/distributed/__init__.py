"""Processes, devices and mesh axes: where this process sits and how the job is laid out.

`init()` and the launcher are the only places in meshfit that read torchrun's environment
variables (RANK, WORLD_SIZE, LOCAL_RANK, ...). Everything else receives a `DistEnv`, a
`ParallelDims` or a `DeviceMesh` explicitly.
"""

from meshfit.distributed.dims import AXES, ParallelDims
from meshfit.distributed.env import DistEnv, cpu_requested, init

__all__ = ["AXES", "DistEnv", "ParallelDims", "cpu_requested", "init"]
