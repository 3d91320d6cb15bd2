"""Accelerate's ``ParallelismConfig`` (``from accelerate.parallelism_config import
ParallelismConfig``), for scripts written against it: the sizes of the data-parallel,
tensor- and context-parallel axes and the names Accelerate derives from them. Passed as
``Accelerator(parallelism_config=...)`` it becomes the `meshfit.ParallelDims` of the same
sizes (`meshfit.accelerator.arguments`); ``accelerator.torch_device_mesh`` is meshfit's mesh,
whose flattened ``dp_cp`` and ``dp_shard_cp`` axes carry Accelerate's names.

A size left None reads ``PARALLELISM_CONFIG_<AXIS>_SIZE`` (what ``accelerate launch``'s
config sets), else 1. ``sp_size`` (DeepSpeed's Ulysses) must stay 1 in meshfit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

__all__ = ["ParallelismConfig"]

_AXES = ("dp_replicate", "dp_shard", "tp", "cp", "sp")


@dataclass
class ParallelismConfig:
    dp_replicate_size: int | None = None
    dp_shard_size: int | None = None
    tp_size: int | None = None
    cp_size: int | None = None
    cp_backend: str | None = None
    sp_size: int | None = None
    sp_backend: str | None = None
    tp_handler: Any = None
    cp_handler: Any = None
    sp_handler: Any = None

    def __post_init__(self) -> None:
        for axis in _AXES:
            name = f"{axis}_size"
            if getattr(self, name) is None:
                raw = os.environ.get(f"PARALLELISM_CONFIG_{axis.upper()}_SIZE", "1")
                try:
                    setattr(self, name, int(raw))
                except ValueError:
                    raise ValueError(f"PARALLELISM_CONFIG_{axis.upper()}_SIZE={raw!r} must be "
                                     "an integer") from None
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelismConfig({name}={value!r}) must be an integer >= 1")
        if self.cp_backend is None:
            self.cp_backend = os.environ.get("PARALLELISM_CONFIG_CP_BACKEND", "torch")
        if self.sp_backend is None:
            self.sp_backend = os.environ.get("PARALLELISM_CONFIG_SP_BACKEND", "deepspeed")

    # the names Accelerate derives from the sizes
    def _enabled(self, *axes: str) -> list[str]:
        return [a for a in axes if getattr(self, f"{a}_size") > 1]

    dp_replicate_enabled = property(lambda self: self.dp_replicate_size > 1)
    dp_shard_enabled = property(lambda self: self.dp_shard_size > 1)
    tp_enabled = property(lambda self: self.tp_size > 1)
    cp_enabled = property(lambda self: self.cp_size > 1)
    sp_enabled = property(lambda self: self.sp_size > 1)
    dp_dim_names = property(lambda self: self._enabled("dp_replicate", "dp_shard"),
                            doc="The axes whose ranks read different data.")
    non_dp_dim_names = property(lambda self: self._enabled("tp", "cp", "sp"),
                                doc="The axes whose ranks read the same batch.")
    dp_shard_cp_dim_names = property(lambda self: self._enabled("dp_shard", "cp"),
                                     doc="The axes FSDP shards over (flattened: dp_shard_cp).")
    dp_cp_dim_names = property(lambda self: self._enabled("dp_replicate", "dp_shard", "cp"),
                               doc="The axes a loss is averaged over (flattened: dp_cp).")
    active_mesh_dims = property(lambda self: self.dp_dim_names + self.non_dp_dim_names)

    @property
    def fsdp_dim_names(self) -> list[str]:
        return [*self._enabled("dp_replicate"), "dp_shard_cp"]

    @property
    def total_size(self) -> int:
        return (self.dp_replicate_size * self.dp_shard_size * self.tp_size * self.cp_size
                * self.sp_size)

    @property
    def non_data_parallel_size(self) -> int:
        return self.tp_size * self.cp_size * self.sp_size

    @property
    def data_parallel_size(self) -> int:
        return self.dp_replicate_size * self.dp_shard_size

    def to_json(self) -> dict:
        return {f"{a}_size": getattr(self, f"{a}_size") for a in _AXES} | {
            "cp_backend": self.cp_backend, "sp_backend": self.sp_backend}
