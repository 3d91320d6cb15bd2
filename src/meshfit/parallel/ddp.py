"""Data parallel with replicated parameters: PyTorch's DistributedDataParallel.

Each rank holds the whole model; gradients are averaged with bucketed all-reduces that
overlap the backward pass (Li et al., 2020, "PyTorch Distributed"). DDP rather than
DataParallel: one process per device, no per-step scatter of the model and no GIL contention
(the multi-GPU guide's DP-vs-DDP table).
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from meshfit._compat import distributed as dist_internals


def apply_ddp(model: torch.nn.Module, mesh, *, device: torch.device,
              bucket_cap_mb: float = 25.0, find_unused_parameters: bool = False,
              gradient_as_bucket_view: bool = True,
              static_graph: bool = False) -> DistributedDataParallel:
    """Wrap `model` in DDP over the 1-D data-parallel `mesh`.

    Parameters are broadcast from the group's first rank at construction, so every replica
    starts from the same weights. `gradient_as_bucket_view` lets gradients alias the
    communication buckets, saving one gradient-sized copy.
    """
    if mesh.ndim != 1:
        raise ValueError("apply_ddp needs a 1-D data-parallel mesh, got axes "
                         f"{mesh.mesh_dim_names}")
    # Frozen parameters of a tensor subclass (QLoRA's 4-bit base) are left out of DDP's
    # start-up broadcast, which reads plain tensors: every rank built them from the same
    # weights, and frozen parameters take no part in the gradient all-reduce anyway.
    ignored = [name for name, p in model.named_parameters()
               if not p.requires_grad and type(p) not in (torch.Tensor, torch.nn.Parameter)]
    if ignored:
        dist_internals.ddp_ignore(model, ignored)
    return DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None,
        process_group=mesh.get_group(), bucket_cap_mb=bucket_cap_mb,
        find_unused_parameters=find_unused_parameters,
        gradient_as_bucket_view=gradient_as_bucket_view, static_graph=static_graph)
