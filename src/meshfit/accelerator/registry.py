"""`Registry`: what an `Accelerator` keeps of the objects it prepares and registers, in the
order it got them: what `save_state` / `load_state` cover (`meshfit.accelerator.state`, which
is handed the registry) and what ``free_memory`` forgets.

It holds the prepared models and pipelines, optimizers, LR schedulers and data loaders; the
objects given to ``register_for_checkpointing``; the count of optimizer steps; the
asynchronous save not yet committed, with the process group and the shared-memory stager its
writer uses; and what ``prepare`` needs to re-point an optimizer or a scheduler built before
its model was sharded (the parameters sharding replaced, the optimizers `prepare` replaced,
the ids of a pipeline's parameters).
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any, NamedTuple

import torch

from meshfit.accelerator.loader import PreparedDataLoader
from meshfit.accelerator.prepared import ParameterMap, PreparedOptimizer, PreparedScheduler

__all__ = ["PendingSave", "Registry"]


class PendingSave(NamedTuple):
    """An asynchronous save being written: committed to `folder` once `future` is done."""

    tmp: Path
    """The temporary folder the writer fills, renamed to `folder` at the commit."""
    folder: Path
    manifest: Any
    """The checkpoint's `meshfit.checkpoint.manifest.Manifest`, written at the commit."""
    future: Any


class Registry:
    """The objects of one `Accelerator` (see this module's docstring)."""

    def __init__(self):
        self.custom: list[Any] = []
        """``register_for_checkpointing``'s objects (``custom_<i>`` in a checkpoint)."""
        self.optimizer_steps = 0
        """Optimizer steps taken (the first prepared optimizer's; a checkpoint's step)."""
        self.pending_save: PendingSave | None = None
        self.save_group = None
        """The gloo process group asynchronous saves write with (made at the first one)."""
        self.save_stager = None
        """``async_save="process"``: the shared-memory staging, kept between saves."""
        self.forget()

    def forget(self) -> None:
        """Drop every prepared object (``free_memory``, between two trainings); the registered
        objects, the step count and the asynchronous saves' machinery stay."""
        self.models: list[Any] = []
        """Prepared models and pipelines (``model``, ``model_1``, ... in a checkpoint)."""
        self.optimizers: list[PreparedOptimizer] = []
        self.schedulers: list[PreparedScheduler] = []
        self.loaders: list[PreparedDataLoader] = []
        self.params = ParameterMap()
        """Parameters replaced by sharding, for optimizers built on the originals."""
        self.pipeline_params: set[int] = set()
        """Ids of the prepared pipelines' parameters."""
        self._replaced: dict[int, tuple[weakref.ref, torch.optim.Optimizer]] = {}

    def replace(self, optimizer: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
        """Record that `prepare` steps `new` in place of the user's `optimizer`."""
        self._replaced[id(optimizer)] = (weakref.ref(optimizer), new)

    def replacement(self, optimizer: Any) -> torch.optim.Optimizer | None:
        """What `prepare` steps in place of `optimizer` (None: `optimizer` itself). Held by id
        and a weak reference: a new optimizer at a freed one's address is not mistaken."""
        entry = self._replaced.get(id(optimizer))
        return entry[1] if entry is not None and entry[0]() is optimizer else None

    def count_step(self, optimizer: PreparedOptimizer) -> bool:
        """Count an optimizer step, once when several optimizers step together (the first
        prepared one's); returns whether it was counted."""
        if optimizer is not self.optimizers[0]:
            return False
        self.optimizer_steps += 1
        return True

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last step of any prepared optimizer was skipped (fp16 overflow)."""
        return any(opt.step_was_skipped for opt in self.optimizers)
