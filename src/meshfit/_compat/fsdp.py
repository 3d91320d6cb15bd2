"""FSDP2's internals (`torch.distributed.fsdp.fully_shard`): the parameters it manages, their
local shards and the gradients it holds for them.

FSDP2's public surface (`FSDPModule`: ``unshard``, ``reshard``,
``set_requires_gradient_sync``, ...) does not expose the parameters it manages. meshfit
needs them twice: `meshfit.parallel.fsdp.held_gradient_bytes` counts the gradients FSDP2
accumulates on its internal unsharded parameters (which ``model.parameters()`` does not
show), and `meshfit.parallel.disk.ParameterFiles` (``offload_params``) moves each local
shard into a memory-mapped file. Each parameter here is an ``FSDPParam``
(``torch.distributed.fsdp._fully_shard._fsdp_param``, a private class: every attribute read
here, underscored or not, is FSDP2's internals).

Public replacement: an `FSDPModule` method listing its managed parameters with their local
shards and accumulated gradients would replace all of this module.
"""

from __future__ import annotations

from typing import Any

import torch

from meshfit._compat import _probe

_STATE = "torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState"
_PARAM = "torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam"
_GROUP = "torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup"


def fsdp_params(model: torch.nn.Module) -> list[Any]:
    """The ``FSDPParam`` of every `fully_shard`-ed module of `model`, module by module.

    ``fully_shard.state(module)`` (the composable API's accessor) gives the module's
    ``FSDPState``, whose parameter groups are ``_fsdp_param_groups`` (a list since torch's
    per-parameter meshes) or, in earlier releases, ``_fsdp_param_group`` (one group or
    None); each group lists its ``fsdp_params``."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    out = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in _groups(fully_shard.state(module)):
                out.extend(group.fsdp_params)
    return out


def _groups(state) -> list[Any]:
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # (torch releases with one group per module)
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return groups


def sharded_parameter(fsdp_param) -> torch.nn.Parameter:
    """The sharded parameter (a DTensor) that the module exposes in place of the original."""
    return fsdp_param.sharded_param


def held_gradients(fsdp_param) -> list[torch.Tensor | None]:
    """The gradients FSDP2 holds for one parameter: the sharded one (``sharded_param.grad``)
    and, under ``set_requires_gradient_sync(False)``, the accumulated *unsharded* one, on
    its internal unsharded parameter (``_unsharded_param.grad``; that parameter exists
    once the module was first unsharded) or, where FSDP2 upcasts, in
    ``unsharded_accumulated_grad``. None where there is none."""
    unsharded = getattr(fsdp_param, "_unsharded_param", None)
    return [fsdp_param.sharded_param.grad, None if unsharded is None else unsharded.grad,
            getattr(fsdp_param, "unsharded_accumulated_grad", None)]


def padded_shard(fsdp_param) -> torch.Tensor:
    """The rank's local shard with its padding, flat (``_sharded_param_data``): what FSDP2
    all-gathers from, and what the sharded parameter's local tensor is a view of."""
    return fsdp_param._sharded_param_data


def map_shard(fsdp_param, storage: torch.UntypedStorage) -> None:
    """Point both views of the rank's padded shard (`padded_shard` and the sharded
    parameter's local tensor) at `storage`, which must hold the same values (a memory map of
    a file written from the shard); and tell FSDP2 not to pin it (``pin_memory``: it would
    copy an unpinned shard into pinned memory, anonymous memory again).

    The DTensor's own local tensor (``_local_tensor``) is re-pointed, not the view that the
    public ``to_local()`` returns for a parameter: ``set_`` on that view would leave the
    parameter's storage where it was."""
    data = fsdp_param._sharded_param_data
    local = fsdp_param.sharded_param._local_tensor
    with torch.no_grad():
        data.set_(storage, 0, data.shape, data.stride())
        local.set_(storage, 0, local.shape, local.stride())
    fsdp_param.pin_memory = False


def missing() -> list[str]:
    lines = _probe.absent("torch", ("torch.distributed.fsdp.fully_shard.state",
                                    "torch.distributed.tensor.DTensor._local_tensor"),
                          ((_PARAM, "sharded_param"), (_PARAM, "_sharded_param_data"),
                           (_PARAM, "_unsharded_param"), (_PARAM, "unsharded_accumulated_grad"),
                           (_PARAM, "pin_memory"), (_GROUP, "fsdp_params")))
    if not (_probe.assigns(_STATE, "_fsdp_param_groups")
            or _probe.resolves(f"{_STATE}._fsdp_param_group")
            or _probe.assigns(_STATE, "_fsdp_param_group")):
        lines.append(f"{_probe.version('torch')}: {_STATE}()._fsdp_param_groups "
                     "(or ._fsdp_param_group)")
    return lines
