"""`ParallelDims`: the size of each parallel axis, validated against the world size (the mesh
itself is built from the resolved `meshfit.parallel.layout.Layout`).

Expert parallelism (``ep``) is carved out of the sharded data-parallel ranks, as in
torchtitan: it is not multiplied into the world size. ``ParallelDims(dp_shard=4, ep=2)`` on
4 processes keeps 4 data-parallel ranks for everything but the experts, and splits each
MoE block's experts over groups of 2 of them (the experts are then sharded over the 2
remaining ``dp_shard / ep`` ranks by ZeRO/FSDP)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["AXES", "DP_AXES", "MESH_AXES", "MeshSizes", "ParallelDims"]

# Mesh axes in the order torchtitan lays them out: pipeline outermost (crosses nodes most
# cheaply: one activation per micro-batch), tensor parallel innermost (needs the fastest
# links, i.e. stays inside a node), see Megatron-LM (Narayanan et al., 2021), section 3.
AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")
# The axes whose sizes multiply to the world size: ep lives inside dp_shard.
MESH_AXES = AXES[:-1]
# The data-parallel axes: their ranks see different data.
DP_AXES = ("dp_replicate", "dp_shard")


@dataclass(frozen=True, kw_only=True)
class MeshSizes:
    """The size of each parallel axis, declared once for every type that carries them
    (`ParallelDims`, `meshfit.parallel.request.LayoutRequest`, the estimator's `LayoutSpec`).

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
    """Expert-parallel ranks for mixture-of-experts layers: a divisor of ``dp_shard`` (the
    experts are split over groups of ``ep`` data-parallel ranks; not part of the product)."""

    def sizes(self) -> dict[str, int]:
        """{axis: size} for every axis of `AXES`."""
        return {name: getattr(self, name) for name in AXES}

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that see different data (an axis left to "the
        remaining ranks", -1, counts 1 until resolved)."""
        out = 1
        for name in DP_AXES:
            out *= max(getattr(self, name), 1)
        return out


@dataclass(frozen=True, kw_only=True)
class ParallelDims(MeshSizes):
    """The size of each parallel axis (`MeshSizes`), validated. Their product is the number
    of processes."""

    world_size: int | None = None
    """Number of processes; None: resolved from the process group by `resolve`."""

    def __post_init__(self) -> None:
        auto = []
        for name in AXES:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"ParallelDims.{name}={value!r} must be an integer >= 1 "
                                 "(or -1 for 'the remaining ranks')")
            if name == "ep" and value < 1:
                raise ValueError(f"ParallelDims.ep={value} must be >= 1 (a divisor of dp_shard; "
                                 "ep has no 'remaining ranks' of its own)")
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
        for name in MESH_AXES:
            product *= max(getattr(self, name), 1)
        return product

    def _check_product(self, world_size: int, auto: list[str]) -> None:
        fixed = self._fixed_product()
        sizes = " x ".join(f"{n}={getattr(self, n)}" for n in MESH_AXES if getattr(self, n) != 1)
        sizes = sizes or "all axes 1"
        if auto:
            if world_size % fixed:
                raise ValueError(f"ParallelDims: {sizes} needs the world size ({world_size}) "
                                 f"to be a multiple of {fixed}; change the axis sizes or the "
                                 "number of processes")
        elif fixed != world_size:
            raise ValueError(f"ParallelDims: {sizes} has product {fixed} but the world size is "
                             f"{world_size}; make the product of pp, dp_replicate, dp_shard, "
                             "cp and tp equal the number of processes (ep is carved out of "
                             "dp_shard, not added to it)")

    def resolve(self, world_size: int) -> "ParallelDims":
        """A copy with -1 replaced by the remaining ranks and the product checked."""
        auto = [n for n in MESH_AXES if getattr(self, n) == -1]
        self._check_product(world_size, auto)
        sizes = self.sizes()
        for name in auto:
            sizes[name] = world_size // self._fixed_product()
        if sizes["dp_shard"] % sizes["ep"]:
            raise ValueError(
                f"ParallelDims: ep={sizes['ep']} must divide dp_shard={sizes['dp_shard']}: "
                "expert parallelism is carved out of the sharded data-parallel ranks, not added "
                f"to the world size; set dp_shard to a multiple of {sizes['ep']} (e.g. "
                f"dp_shard={sizes['ep']} on {sizes['ep']} processes)")
        return dataclasses.replace(self, world_size=world_size, **sizes)

    def enabled(self) -> tuple[str, ...]:
        """Names of the axes larger than one, outermost first."""
        return tuple(n for n in AXES if getattr(self, n) > 1)
