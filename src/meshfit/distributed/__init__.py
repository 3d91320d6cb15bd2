"""Processes, devices and mesh axes: where this process sits and how the job is laid out.

`init()` and the launcher are the only places in meshfit that read torchrun's environment
variables (RANK, WORLD_SIZE, LOCAL_RANK, ...). Everything else receives a `DistEnv`, a
`ParallelDims` or a `DeviceMesh` explicitly.

    dims.py        `ParallelDims`, the mesh axes (no torch)
    env.py         `init()`, `DistEnv`: this process's rank, device and backend
    collectives.py gather and reduce nested structures of tensors over a group
    tensors.py     this rank's part of a DTensor, bytes held per storage
    settle.py      barriers after which a gloo group can be destroyed safely
    spawn.py       `spawn(fn, n)`: a function on n new local ranks (tests, `plan --validate`)
"""

from __future__ import annotations

from meshfit._lazy import lazy_exports
from meshfit.distributed.dims import AXES, ParallelDims

# env.py imports torch: its names load on first use, so that the mesh axes (dims.py, no
# torch) can be read and checked without it.
_LAZY = {"DistEnv": "env", "cpu_requested": "env", "init": "env", "is_initialized": "env",
         "SpawnError": "spawn", "free_port": "spawn", "spawn": "spawn"}
__all__ = ["AXES", "DistEnv", "ParallelDims", "SpawnError", "cpu_requested", "free_port", "init",
           "is_initialized", "spawn"]

__getattr__, __dir__ = lazy_exports(
    __name__, {name: f"{__name__}.{module}" for name, module in _LAZY.items()}, globals())
