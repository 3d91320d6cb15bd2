"""`ParallelDims`: the size of each parallel axis, validated against the world size."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

__all__ = ["AXES", "ParallelDims"]

# Mesh axes in the order torchtitan lays them out: pipeline outermost (crosses nodes most
# cheaply: one activation per micro-batch), tensor parallel innermost (needs the fastest
# links, i.e. stays inside a node), see Megatron-LM (Narayanan et al., 2021), section 3.
AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """The size of each parallel axis. Their product is the number of processes.

    A size of -1 means "all the ranks the other axes leave"; at most one axis may be -1.
    The default puts every rank on ``dp_replicate``: plain data parallel (DDP).
    """

    pp: int = 1
    """Pipeline-parallel stages."""
    dp_replicate: int = -1
    """Data-parallel replicas (DDP; with dp_shard > 1, replicas of a sharded group: HSDP)."""
    dp_shard: int = 1
    """Data-parallel ranks that shard parameters, gradients and optimizer state (ZeRO/FSDP)."""
    cp: int = 1
    """Context-parallel ranks (the sequence split across ranks)."""
    tp: int = 1
    """Tensor-parallel ranks (Megatron-style layer splits; keep them inside a node)."""
    ep: int = 1
    """Expert-parallel ranks for mixture-of-experts layers."""
    world_size: int | None = None
    """Number of processes; None: resolved from the process group by `resolve`."""

    _mesh: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        auto = []
        for name in AXES:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"ParallelDims.{name}={value!r} must be an integer >= 1 "
                                 "(or -1 for 'the remaining ranks')")
            if value == -1:
                auto.append(name)
            elif value < 1:
                raise ValueError(f"ParallelDims.{name}={value} must be >= 1 "
                                 "(or -1 for 'the remaining ranks')")
        if len(auto) > 1:
            raise ValueError(f"ParallelDims: {', '.join(auto)} are all -1; at most one axis "
                             "may take 'the remaining ranks', give the others explicit sizes")
        if self.world_size is not None:
            if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) \
                    or self.world_size < 1:
                raise ValueError(f"ParallelDims.world_size={self.world_size!r} must be an "
                                 "integer >= 1")
            self._check_product(self.world_size, auto)

    def _fixed_product(self) -> int:
        product = 1
        for name in AXES:
            product *= max(getattr(self, name), 1)
        return product

    def _check_product(self, world_size: int, auto: list[str]) -> None:
        fixed = self._fixed_product()
        sizes = " x ".join(f"{n}={getattr(self, n)}" for n in AXES if getattr(self, n) != 1)
        sizes = sizes or "all axes 1"
        if auto:
            if world_size % fixed:
                raise ValueError(f"ParallelDims: {sizes} needs the world size ({world_size}) "
                                 f"to be a multiple of {fixed}; change the axis sizes or the "
                                 "number of processes")
        elif fixed != world_size:
            raise ValueError(f"ParallelDims: {sizes} has product {fixed} but the world size is "
                             f"{world_size}; make the product of pp, dp_replicate, dp_shard, "
                             "cp, tp and ep equal the number of processes")

    def resolve(self, world_size: int) -> "ParallelDims":
        """A copy with -1 replaced by the remaining ranks and the product checked."""
        auto = [n for n in AXES if getattr(self, n) == -1]
        self._check_product(world_size, auto)
        sizes = {n: getattr(self, n) for n in AXES}
        for name in auto:
            sizes[name] = world_size // self._fixed_product()
        return dataclasses.replace(self, world_size=world_size, **sizes)

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that see different data."""
        return max(self.dp_replicate, 1) * max(self.dp_shard, 1)

    def enabled(self) -> tuple[str, ...]:
        """Names of the axes larger than one, outermost first."""
        return tuple(n for n in AXES if getattr(self, n) > 1)

    def build_mesh(self, device_type: str):
        """The `DeviceMesh` of this layout, built once per device type.

        Axes of size 1 are dropped, except the data-parallel ones: with ``tp`` or ``pp``
        > 1 both ``dp_replicate`` and ``dp_shard`` are kept (the data-parallel wrapper of a
        tensor-parallel model is FSDP2 over the 2-D ``(dp_replicate, dp_shard)`` sub-mesh,
        replicate-only when dp_shard is 1); otherwise ``dp_replicate`` is kept when no
        data-parallel axis is larger, so a one-process job still has a mesh to pass around.
        """
        if self.world_size is None or any(getattr(self, n) == -1 for n in AXES):
            raise ValueError("ParallelDims.build_mesh needs resolved sizes; call "
                             "dims.resolve(world_size) first")
        if device_type not in self._mesh:
            from torch.distributed.device_mesh import init_device_mesh

            keep = {"dp_replicate", "dp_shard"} if self.tp > 1 or self.pp > 1 else set()
            if not any(n in ("dp_replicate", "dp_shard") for n in self.enabled()):
                keep.add("dp_replicate")
            names = tuple(n for n in AXES if getattr(self, n) > 1 or n in keep)
            shape = tuple(getattr(self, n) for n in names)
            self._mesh[device_type] = init_device_mesh(device_type, shape,
                                                       mesh_dim_names=names)
        return self._mesh[device_type]
