"""Optimizer and LR scheduler wrappers that act only on gradient-accumulation boundaries.

With ``gradient_accumulation_steps=k`` a user's loop calls ``optimizer.step()`` and
``optimizer.zero_grad()`` on every micro-batch (as the seed's loop does); the wrappers make
those calls no-ops except on the k-th micro-batch, where gradients have been synchronised.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GradientState:
    """Gradient-accumulation bookkeeping shared by the accelerator and its wrappers."""

    num_steps: int = 1
    """Micro-batches per optimizer step (gradient_accumulation_steps)."""
    step: int = 0
    """Micro-batches seen since the last synchronising one."""
    sync_gradients: bool = True
    """Whether the current micro-batch ends an accumulation window."""


class PreparedOptimizer(torch.optim.Optimizer):
    """Delegates to the user's optimizer; `step` and `zero_grad` only act when gradients are
    synchronised. With fp16 the step goes through the GradScaler (skipped on inf/NaN)."""

    def __init__(self, optimizer: torch.optim.Optimizer, grad_state: GradientState,
                 scaler: torch.amp.GradScaler | None = None, on_step=None):
        # Deliberately no super().__init__: this object owns no parameters of its own, the
        # wrapped optimizer does; the subclassing keeps isinstance checks (LR schedulers) true.
        self.optimizer = optimizer
        self.grad_state = grad_state
        self.scaler = scaler
        self.on_step = on_step  # called after each real (boundary) step
        self.step_was_skipped = False
        self.unscaled = False  # set by Accelerator.unscale_gradients, cleared by step

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.grad_state.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        self.step_was_skipped = False
        if not self.grad_state.sync_gradients:
            return None
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
                    "on_step"):
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"PreparedOptimizer({self.optimizer!r})"


class PreparedScheduler:
    """Steps the user's LR scheduler once per *optimizer* step (not per micro-batch), and not
    at all when an fp16 step was skipped for overflow."""

    def __init__(self, scheduler, optimizers: list[PreparedOptimizer],
                 grad_state: GradientState):
        self.scheduler = scheduler
        self.optimizers = optimizers
        self.grad_state = grad_state

    def step(self, *args, **kwargs) -> None:
        if not self.grad_state.sync_gradients:
            return
        if any(opt.step_was_skipped for opt in self.optimizers):
            return
        self.scheduler.step(*args, **kwargs)

    def get_last_lr(self):
        return self.scheduler.get_last_lr()

    def state_dict(self):
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name):
        if name in ("scheduler", "optimizers", "grad_state"):
            raise AttributeError(name)
        return getattr(self.scheduler, name)
