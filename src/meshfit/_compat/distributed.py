"""torch.distributed's core internals: the process groups of this process, a device mesh's
flattened axes, and what DDP leaves out.

- `process_groups`: every group this process belongs to, in creation order
  (``distributed_c10d._world.pg_map``), which `meshfit.distributed.settle` ends one by one.
  Public replacement: a function listing the groups. (The default group alone is public:
  ``torch.distributed.group.WORLD``.)
- `flatten`: a device mesh's axes merged into one named axis (``DeviceMesh._flatten``), the
  1-D mesh over the data-parallel (and context-parallel) ranks that FSDP2 and the loss
  average use (`meshfit.parallel.mesh`; torchtitan does the same). Public replacement:
  a public ``DeviceMesh.flatten``.
- `ddp_ignore`: parameters DDP leaves out of its start-up broadcast and gradient all-reduce
  (``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``), for frozen
  weights of a tensor subclass it cannot broadcast. Public replacement: an ``ignore``
  argument of DDP's.
"""

from __future__ import annotations

from meshfit._compat import _probe

_DDP = "torch.nn.parallel.DistributedDataParallel"


def process_groups() -> list:
    """Every process group this process created (the default first), in creation order;
    empty when the group registry is not where this reads it (``_world.pg_map``)."""
    from torch.distributed import distributed_c10d as c10d

    world = getattr(c10d, "_world", None)
    return list(getattr(world, "pg_map", {}) or {})


def flatten(mesh, name: str):
    """The axes of `mesh` (a sliced ``DeviceMesh``) as one axis `name`, registered on the
    root mesh so that ``root[name]`` finds it afterwards."""
    return mesh._flatten(name)


def ddp_ignore(model, names: list[str]) -> None:
    """Make a DDP built on `model` afterwards leave out the parameters and buffers `names`
    (names in `model`)."""
    from torch.nn.parallel import DistributedDataParallel

    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)


def missing() -> list[str]:
    return _probe.absent("torch", ("torch.distributed.distributed_c10d._world.pg_map",
                                   "torch.distributed.device_mesh.DeviceMesh._flatten",
                                   f"{_DDP}._set_params_and_buffers_to_ignore_for_model"))
