"""Strategies: how a model is wrapped, how its gradients are kept from syncing, over which
group data-parallel results are gathered. The accelerator picks one by the layout's type and
delegates to it; it never branches on a strategy name.
"""

from __future__ import annotations

import contextlib

import torch

from meshfit.distributed import DistEnv, ParallelDims
from meshfit.parallel import apply_ddp

# Axes whose strategies exist today; the others are planned (see the README's feature table).
AVAILABLE_AXES = ("dp_replicate",)


class Strategy:
    """A single process: models are moved to the device and otherwise left alone."""

    mesh = None

    def __init__(self, env: DistEnv):
        self.env = env

    @property
    def dp_group(self):
        """Process group over which data-parallel ranks see different data (None: one rank)."""
        return None

    @property
    def dp_rank(self) -> int:
        return 0

    @property
    def dp_size(self) -> int:
        return 1

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def no_sync(self, model: torch.nn.Module):
        return contextlib.nullcontext()

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model


class DDPStrategy(Strategy):
    """Replicated data parallel over the mesh's ``dp_replicate`` axis."""

    def __init__(self, env: DistEnv, dims: ParallelDims, *, ddp_kwargs: dict | None = None):
        super().__init__(env)
        self.dims = dims
        self.mesh = dims.build_mesh(env.device.type)
        self.dp_mesh = self.mesh["dp_replicate"]
        self.ddp_kwargs = dict(ddp_kwargs or {})

    @property
    def dp_group(self):
        return self.dp_mesh.get_group()

    @property
    def dp_rank(self) -> int:
        return self.dp_mesh.get_local_rank()

    @property
    def dp_size(self) -> int:
        return self.dp_mesh.size()

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        if not any(p.requires_grad for p in model.parameters()):
            return model  # nothing to synchronise (e.g. an evaluation-only model)
        return apply_ddp(model, self.dp_mesh, device=self.env.device, **self.ddp_kwargs)

    def no_sync(self, model: torch.nn.Module):
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return model.no_sync()
        return contextlib.nullcontext()

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return model.module
        return model


def choose_strategy(env: DistEnv, dims: ParallelDims, *, ddp_kwargs: dict | None = None
                    ) -> Strategy:
    """The strategy for a resolved layout; errors name the axes that are not available yet."""
    planned = [n for n in dims.enabled() if n not in AVAILABLE_AXES]
    if planned:
        sizes = ", ".join(f"{n}={getattr(dims, n)}" for n in planned)
        raise ValueError(f"ParallelDims({sizes}): this axis is not yet available in meshfit; "
                         "use the default data-parallel layout (dp_replicate) for now")
    if not env.is_distributed:
        return Strategy(env)
    return DDPStrategy(env, dims, ddp_kwargs=ddp_kwargs)
