"""A layout's `DeviceMesh` and the sub-meshes each technique runs on.

The mesh is built once per job (`build_mesh`, a collective over the default group) with the
layout's named axes, outermost first (`Layout.mesh_axes`); every technique then takes its
sub-mesh by name and receives it explicitly. With expert parallelism, ``dp_shard`` is made of
two mesh dimensions, ``(dp_shard_mod_ep, ep)``, flattened back into ``dp_shard``. With
context parallel, the parameters are replicated over the ``cp`` ranks too: the gradients are
averaged over ``dp_cp`` (every data-parallel axis and cp, flattened) and FSDP2 shards over
``dp_shard_cp`` (dp_shard and cp flattened; ``cp`` itself without dp_shard), as torchtitan.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from meshfit._compat.distributed import flatten

if TYPE_CHECKING:  # annotations only: the layout module imports this one
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["axis_mesh", "build_mesh", "dp_mesh", "expert_fsdp_mesh", "fsdp_mesh", "grad_mesh",
           "shard_axis", "shard_mesh"]


def build_mesh(layout, device_type: str) -> DeviceMesh:
    """The `DeviceMesh` of `layout` over the default process group (a collective)."""
    # here: this module is torch-free at import (TORCH_FREE, tests/test_architecture.py)
    from torch.distributed.device_mesh import init_device_mesh

    ep, cp = layout.dims.ep, layout.dims.cp
    names, shape = [], []
    for a in layout.mesh_axes:
        if a == "ep":
            continue
        if a == "dp_shard" and ep > 1:
            # ep is the inner part of dp_shard: each group of ep dp_shard ranks splits the
            # experts; "dp_shard" is the flattened whole. Under cp, ep comes after cp, so
            # that the ranks holding the same experts (dp_shard / ep x cp, FSDP2's mesh for
            # them) precede ep: DTensor needs a 2-D mesh's dimensions in the root's order.
            names.append("dp_shard_mod_ep")
            shape.append(layout.dims.dp_shard // ep)
            if cp == 1:
                names.append("ep")
                shape.append(ep)
        elif a == "cp" and ep > 1:
            names += ["cp", "ep"]
            shape += [cp, ep]
        else:
            names.append(a)
            shape.append(getattr(layout.dims, a))
    mesh = init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))
    if ep > 1:
        flatten(_slice(mesh, ("dp_shard_mod_ep", "ep")), "dp_shard")
    # The ranks a loss is averaged over (Accelerate's and torchtitan's name), and under cp
    # the ranks ZeRO shards over; flattened from the root's own dimensions, in its order.
    data = tuple(n for n in names if n not in ("pp", "tp"))
    if ep == 1 or cp > 1:  # (under ep without cp, dp_shard is itself a flattened pair:
        flatten(_slice(mesh, data), "dp_cp")  # dp_mesh's "dp" then)
    if cp > 1 and "dp_shard" in layout.mesh_axes:
        shard = ("dp_shard_mod_ep", "cp", "ep") if ep > 1 else ("dp_shard", "cp")
        flatten(_slice(mesh, shard), "dp_shard_cp")
    if cp > 1 and ep > 1:  # the ranks holding the same experts: expert_fsdp_mesh
        flatten(_slice(mesh, ("dp_shard_mod_ep", "cp")), "dp_shard_mod_ep_cp")
    return mesh


def shard_axis(layout) -> str:
    """The mesh axis ZeRO shards over: ``dp_shard``, or under cp ``dp_shard_cp`` (``cp``
    where dp_shard is 1)."""
    if layout.dims.cp == 1:
        return "dp_shard"
    return "dp_shard_cp" if "dp_shard" in layout.mesh_axes else "cp"


def shard_mesh(layout, mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh ZeRO shards over (`shard_axis`)."""
    return _slice(mesh, shard_axis(layout))


def grad_mesh(layout, mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh of the ranks whose gradients are averaged: the data-parallel ranks, and
    under cp their context-parallel ranks too (`dp_mesh` otherwise)."""
    dims = layout.dims
    return _slice(mesh, "dp_cp") if dims.ep == 1 or dims.cp > 1 else dp_mesh(layout, mesh)


def dp_mesh(layout, mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh of all data-parallel ranks (dp_replicate x dp_shard flattened)."""
    axes = layout.dp_axes
    return _slice(mesh, axes[0]) if len(axes) == 1 else flatten(_slice(mesh, axes), "dp")


def fsdp_mesh(layout, mesh: DeviceMesh) -> DeviceMesh:
    """FSDP2's mesh (`Layout.fsdp_axes`): 1-D, or 2-D (replicate, shard) for HSDP."""
    axes = tuple(shard_axis(layout) if a == "dp_shard" else a for a in layout.fsdp_axes)
    return _slice(mesh, axes[0]) if len(axes) == 1 else _slice(mesh, axes)


def expert_fsdp_mesh(layout, mesh: DeviceMesh | None) -> DeviceMesh | None:
    """Under ep: the mesh FSDP2 shards the experts over, the ranks that hold the same experts
    ((dp_replicate, dp_shard / ep x cp), sizes of 1 dropped: torchtitan's dp_shard*cp/ep);
    None when no rank but this one holds them (dp_replicate = 1, dp_shard = ep, cp = 1)."""
    dims = layout.dims
    if mesh is None or dims.ep == 1:
        return None
    shard = ("dp_shard_mod_ep_cp", dims.dp_shard // dims.ep * dims.cp) if dims.cp > 1 else \
        ("dp_shard_mod_ep", dims.dp_shard // dims.ep)
    axes = tuple(a for a, size in (("dp_replicate", dims.dp_replicate), shard) if size > 1)
    if not axes:
        return None
    return _slice(mesh, axes[0]) if len(axes) == 1 else _slice(mesh, axes)


def axis_mesh(layout, mesh: DeviceMesh | None, axis: str) -> DeviceMesh | None:
    """The 1-D sub-mesh of `axis` ("tp", "pp", "dp_shard"), or None without that axis."""
    return _slice(mesh, axis) if mesh is not None and axis in layout.mesh_axes else None


def _slice(mesh, axes):
    """``mesh[axes]``. Under ep, ``dp_shard`` is the flattened (dp_shard_mod_ep, ep) pair,
    and torch 2.13 warns on every slice of a flattened dimension that it "will be
    deprecated in PT 2.11" — while still supporting it; the warning is not the user's."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        return mesh[axes]
