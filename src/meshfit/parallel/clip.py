"""Gradient-norm clipping over every rank that holds a part of the model.

Plain gradients (one process, DDP, ZeRO-1: already all-reduced) and DTensor gradients (FSDP2
shards, tensor parallel) both work. torch's own `clip_grad_norm_` fails when gradients live
on different meshes (a 2-D dp x tp model has some on the 2-D mesh, some on the tp mesh only):
here gradients are grouped by mesh, each group's norm completed across its mesh, and the
norms combined. A pipeline's stages add theirs over the pp group (`across`).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, *, counted=None,
                    across=None, device: torch.device | None = None) -> torch.Tensor:
    """Clip the gradients' total norm over all ranks (see the module docstring); returns the
    norm (a plain tensor).

    `counted`: the parameters whose gradients make up the norm (default: all; a pipeline
    leaves out second copies of tied weights); `across`: a process group holding the other
    parts of the model (pipeline stages), over which the norm is completed — every rank of
    it must call, `device` giving where a rank with no gradients puts its zero.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = [p for p in parameters if p.grad is not None]
    counted = params if counted is None else [p for p in counted if p.grad is not None]
    if not params and across is None:
        return torch.tensor(0.0)
    device = params[0].grad.device if params else (device or torch.device("cpu"))
    total = _local_norm([p.grad for p in counted], norm_type, device)
    if across is not None:  # in float64 on every rank: ranks may hold different dtypes
        dtype, total = total.dtype, total.double()
        if math.isinf(norm_type):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=across)
        else:
            total = total.pow(norm_type)
            dist.all_reduce(total, group=across)
            total = total.pow(1.0 / norm_type)
        total = total.to(dtype)
    partial = [p for p in params if _is_partial(p.grad)]
    for group in _by_mesh([p for p in params if not _is_partial(p.grad)],
                          lambda p: p.grad).values():
        # one call per mesh: the foreach multiply refuses DTensors of different meshes
        # (expert parallelism puts the experts on the ep mesh, the rest on dp_shard)
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    if partial:
        # Gradients still Partial (a norm's weight under sequence parallel: each tp rank's
        # sum over its part of the sequence) are scaled one by one: torch 2.11's foreach
        # multiply leaves a Partial DTensor as it was (measured: x2 stays x2), while the
        # in-place multiply of one tensor scales its local part on every torch.
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # as clip_grads_with_norm_
        for p in partial:
            p.grad.mul_(coef.to(p.grad.device))
    return total


def _is_partial(t: torch.Tensor) -> bool:
    # DTensor loads here, not at the top: torch.distributed.tensor adds ~0.5 s to the trainer's
    # import (-X importtime) and a run on one device never makes a DTensor.
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor) and any(pl.is_partial() for pl in t.placements)


def _by_mesh(items, tensor_of=lambda t: t) -> dict:
    from torch.distributed.tensor import DTensor  # deferred: see _is_partial

    groups: dict = {}
    for item in items:
        t = tensor_of(item)
        key = t.device_mesh if isinstance(t, DTensor) else None
        groups.setdefault(key, []).append(item)
    return groups


def _local_norm(grads, norm_type: float, device: torch.device) -> torch.Tensor:
    from torch.distributed.tensor import DTensor  # deferred: see _is_partial

    norms = []
    for group in _by_mesh(grads).values():
        norm = torch.nn.utils.get_total_norm(group, norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.zeros((), device=device)
    norms = torch.stack([n.to(device) for n in norms])
    if math.isinf(norm_type):
        return norms.max()
    return norms.pow(norm_type).sum().pow(1.0 / norm_type)
