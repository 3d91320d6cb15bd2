"""Optimizer and LR scheduler wrappers that act only on gradient-accumulation boundaries: a
loop calls ``optimizer.step()`` and ``zero_grad()`` on every micro-batch, and they are no-ops
but on the k-th, where gradients have been synchronised. An optimizer built before
`prepare(model)` under zero_stage 2/3 holds the parameters ``fully_shard`` replaced: a new one
of its class is built over the sharded parameters of the same names (`rebuild_optimizer`; the
old one keeps the old parameters alive until dropped), and its LR schedulers are moved to it.
Under zero_stage 1 it becomes a ZeroRedundancyOptimizer (`meshfit.accelerator.runtime`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch.utils.data import DataLoader

from meshfit._compat import optim as lr_internals
from meshfit.accelerator.loader import PreparedDataLoader
from meshfit.optim import sharded_class
from meshfit.parallel.zero1 import constructor_kwargs

__all__ = ["GradientState", "ParameterMap", "PreparedOptimizer", "PreparedScheduler",
           "kind_of", "rebuild_optimizer", "repoint_scheduler", "unscale_gradients"]


def kind_of(obj) -> str:
    """"model", "optimizer", "dataloader", "scheduler" (also an object with ``step``,
    ``get_last_lr`` and ``optimizer``) or "other": what `Accelerator.prepare` does with `obj`."""
    if isinstance(obj, torch.nn.Module):
        return "model"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(obj, (DataLoader, PreparedDataLoader)):
        return "dataloader"
    if isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or (
            hasattr(obj, "step") and hasattr(obj, "get_last_lr") and hasattr(obj, "optimizer")):
        return "scheduler"
    return "other"


@dataclass
class GradientState:
    """Accumulation bookkeeping shared by the accelerator and its wrappers (Accelerate's names)."""

    num_steps: int = 1  # micro-batches per optimizer step (gradient_accumulation_steps)
    step: int = 0  # micro-batches seen since the last synchronising one
    sync_gradients: bool = True  # whether the current micro-batch ends an accumulation window
    sync_with_dataloader: bool = True  # whether a data loader's last batch ends the window
    adjust_scheduler: bool = False  # Accelerate's (effectively False): no effect on the lr
    loaders: list = field(default_factory=list)  # loaders being iterated, innermost last

    active_dataloader = property(lambda self: self.loaders[-1] if self.loaders else None)
    in_dataloader = property(lambda self: bool(self.loaders))
    plugin_kwargs = property(lambda self: {"num_steps": self.num_steps,
                                           "sync_with_dataloader": self.sync_with_dataloader})

    @property
    def end_of_dataloader(self) -> bool:
        """Whether the innermost loader being iterated has handed out its last batch."""
        loader = self.active_dataloader
        return loader is not None and loader.state.end_of_dataloader

    @property
    def remainder(self) -> int:
        """Real samples in the innermost loader's last round (0: full; -1: none, or no loader)."""
        loader = self.active_dataloader
        return -1 if loader is None else loader.state.remainder

    @classmethod
    def _reset_state(cls) -> None:
        """Accelerate's test helper (its GradientState is one per process); meshfit's belongs
        to its Accelerator, so there is nothing process-wide to forget."""

    def _set_sync_gradients(self, sync_gradients: bool) -> None:
        """Accelerate's setter, called by transformers' Trainer, which decides the
        accumulation boundaries itself (it prefetches each window's batches, so a loader's
        end cannot tell it): whether the coming micro-batch ends a window."""
        self.sync_gradients = bool(sync_gradients)

    def advance(self) -> None:
        """A micro-batch begins (`accumulate`). As Accelerate's: the innermost loader's last
        batch ends the window and restarts the count; otherwise every num_steps-th does."""
        if self.sync_with_dataloader and self.end_of_dataloader:
            self.step = 0
            self.sync_gradients = True
        else:
            self.step += 1
            self.sync_gradients = self.step % self.num_steps == 0

    def leave(self, loader) -> None:
        """`loader`'s iteration stopped: the loader iterated around it (if any) decides the
        boundary again (an evaluation loader read out inside a training epoch, left active,
        made every following micro-batch an optimizer step)."""
        for i in range(len(self.loaders) - 1, -1, -1):
            if self.loaders[i] is loader:
                del self.loaders[i]
                break


class PreparedOptimizer(torch.optim.Optimizer):
    """Delegates to the user's optimizer; `step` and `zero_grad` only act when gradients are
    synchronised. With fp16 the step goes through the GradScaler (skipped on inf/NaN)."""

    def __init__(self, optimizer: torch.optim.Optimizer, grad_state: GradientState,
                 scaler: torch.amp.GradScaler | None = None, on_step=None, before_step=None):
        # Deliberately no super().__init__: this object owns no parameters of its own, the
        # wrapped optimizer does; the subclassing keeps isinstance checks (LR schedulers) true.
        self.optimizer = optimizer
        self.grad_state = grad_state
        self.scaler = scaler
        self.on_step = on_step  # called after each real (boundary) step
        self.before_step = before_step  # ... and before it
        self.step_was_skipped = False
        self.unscaled = False  # set by Accelerator.unscale_gradients, cleared by step

    param_groups = property(lambda self: self.optimizer.param_groups,
                            lambda self, value: setattr(self.optimizer, "param_groups", value))
    state = property(lambda self: self.optimizer.state)
    defaults = property(lambda self: self.optimizer.defaults)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.grad_state.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        self.step_was_skipped = False
        if not self.grad_state.sync_gradients:
            return None
        if self.before_step is not None:
            self.before_step(self)
        if self.scaler is None:
            out = self.optimizer.step(closure)
        else:
            scale_before = self.scaler.get_scale()
            out = self.scaler.step(self.optimizer, closure) if closure else \
                self.scaler.step(self.optimizer)
            self.scaler.update()
            self.unscaled = False
            # GradScaler lowers the scale exactly when it found inf/NaN and skipped the step.
            self.step_was_skipped = self.scaler.get_scale() < scale_before
        if self.on_step is not None:
            self.on_step(self)
        return out

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group) -> None:
        self.optimizer.add_param_group(param_group)

    def __getattr__(self, name):
        # Only reached for attributes not found normally (e.g. an optimizer's own extras).
        if name in ("optimizer", "grad_state", "scaler", "unscaled", "step_was_skipped",
                    "on_step", "before_step"):
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"PreparedOptimizer({self.optimizer!r})"


class PreparedScheduler:
    """Steps the user's LR scheduler on optimizer steps only, as Accelerate's
    AcceleratedScheduler does, and not at all when an fp16 step was skipped for overflow;
    `steps_per_optimizer_step` times each (the Accelerator's ``step_scheduler_per_process``:
    `meshfit.accelerator.arguments`). `with_optimizer=False` steps on every call."""

    def __init__(self, scheduler, optimizers: list[PreparedOptimizer],
                 grad_state: GradientState, *, with_optimizer: bool = True,
                 steps_per_optimizer_step: int = 1):
        self.scheduler = scheduler
        self.optimizers = optimizers
        self.grad_state = grad_state
        self.step_with_optimizer = with_optimizer
        self.steps_per_optimizer_step = steps_per_optimizer_step

    def step(self, *args, **kwargs) -> None:
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self.grad_state.sync_gradients:
            if self.grad_state.adjust_scheduler:
                lr_internals.count_step(self.scheduler)
            return
        if any(opt.step_was_skipped for opt in self.optimizers):
            return
        for _ in range(self.steps_per_optimizer_step):
            # OneCycleLR refuses to step past its total_steps (an epoch not dividing evenly)
            total = getattr(self.scheduler, "total_steps", None)
            if total is not None and lr_internals.step_count(self.scheduler) > total:
                break
            self.scheduler.step(*args, **kwargs)

    def __getattr__(self, name):
        # The rest is the scheduler's: get_lr, get_last_lr, state_dict, load_state_dict, ...
        if name in ("scheduler", "optimizers", "grad_state", "step_with_optimizer",
                    "steps_per_optimizer_step"):
            raise AttributeError(name)
        return getattr(self.scheduler, name)


def unscale_gradients(scaler: torch.amp.GradScaler, prepared: list[PreparedOptimizer],
                      optimizer=None) -> None:
    """Divide `scaler`'s loss scale out of `optimizer`'s gradients once per step (a prepared
    one or the one it wraps, or a list; None: all `prepared`)."""
    chosen = prepared if optimizer is None else (
        list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer])
    for opt in chosen:
        if not isinstance(opt, PreparedOptimizer):
            opt = next((o for o in prepared if o.optimizer is opt), None)
            if opt is None:
                continue
        if not opt.unscaled:
            scaler.unscale_(opt.optimizer)
            opt.unscaled = True


class ParameterMap:
    """Which Parameters `prepare` replaced (``fully_shard`` swaps each for a DTensor Parameter
    of the same name): old parameter -> its name -> the new one. Weak references only, so a
    model's old (full-size) parameters are freed as soon as nothing else holds them."""

    def __init__(self) -> None:
        self._replaced: dict[int, tuple[weakref.ref, weakref.ref, str]] = {}

    def record(self, before: dict[str, torch.nn.Parameter],
               after: dict[str, torch.nn.Parameter]) -> None:
        """`before`/`after`: named_parameters() of the model before and after wrapping."""
        for name, old in before.items():
            new = after.get(name)
            if new is None:
                raise ValueError(f"prepare(model): parameter {name!r} disappeared when the model "
                                 "was wrapped; parameter names must be kept")
            if new is not old:
                self._replaced[id(old)] = (weakref.ref(old), weakref.ref(new), name)

    def replacement(self, param: torch.Tensor) -> torch.Tensor | None:
        """The parameter that replaced `param`, or None if it was not replaced."""
        entry = self._replaced.get(id(param))
        if entry is None or entry[0]() is not param:  # an id reused by another object
            return None
        new = entry[1]()
        if new is None:
            raise ValueError(f"prepare(optimizer): parameter {entry[2]!r} belongs to a "
                             "prepared model that no longer exists")
        return new


def rebuild_optimizer(optimizer: torch.optim.Optimizer, params: ParameterMap
                      ) -> torch.optim.Optimizer:
    """`optimizer` itself if none of its parameters was replaced by `prepare`; otherwise a
    new optimizer of the same class over the replacements (the others kept), with the same
    constructor defaults and per-group keys (hyper-parameters, a scheduler's
    ``initial_lr``). It must not have stepped yet: its state belongs to the old parameters."""
    groups = []
    replaced = False
    for group in optimizer.param_groups:
        new_params = []
        for p in group["params"]:
            new = params.replacement(p)
            replaced |= new is not None
            new_params.append(p if new is None else new)
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": new_params})
    if not replaced:
        return optimizer
    if optimizer.state:
        raise ValueError(f"prepare(optimizer): the {type(optimizer).__name__} already holds "
                         f"state for {len(optimizer.state)} parameter(s) of the unsharded "
                         "model; prepare it before its first step, or build it after "
                         "prepare(model)")
    cls = sharded_class(type(optimizer))  # torch.optim.Muon -> meshfit's, which takes DTensors
    return cls(groups, **constructor_kwargs(cls, optimizer.defaults))


def repoint_scheduler(scheduler, optimizer: torch.optim.Optimizer) -> None:
    """Make an LR scheduler built on a replaced optimizer drive `optimizer` instead (the param
    groups were copied with ``lr`` and ``initial_lr``: the schedule goes on unchanged). The
    scheduler's check that ``optimizer.step()`` runs first wraps the optimizer's step at
    construction; the same marker is put on the new optimizer's step."""
    scheduler.optimizer = optimizer
    lr_internals.mark_stepping(optimizer)
