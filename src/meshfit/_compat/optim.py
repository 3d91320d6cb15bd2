"""torch.optim's internals: the LR scheduler's step bookkeeping and the fused kernels'
devices.

An LR scheduler (``torch.optim.lr_scheduler.LRScheduler``) keeps three private things that
meshfit has to keep consistent when it steps, re-points or resumes a schedule on its own:
``_step_count`` (its own steps, which the check "optimizer.step() before
lr_scheduler.step()" and OneCycleLR's end read), ``_last_lr`` (what ``get_last_lr()``
returns) and the marker it puts on its optimizer's ``step`` (``_wrapped_by_lr_sched``, and
``_opt_called`` set by that wrapper). ``last_epoch`` and ``get_last_lr()`` are the public
views of the first two, and are read-only as far as the scheduler is concerned.

Public replacement: a scheduler method that sets the current rate (or re-counts a step)
without stepping, and one that attaches the scheduler to another optimizer.
"""

from __future__ import annotations

import functools

from meshfit._compat import _probe

_SCHEDULER = "torch.optim.lr_scheduler.LRScheduler"


def step_count(scheduler) -> int:
    """The scheduler's own step count (``_step_count``: 1 after construction, one more per
    ``step()``); unlike ``last_epoch``, `count_step` advances it without a step."""
    return scheduler._step_count


def count_step(scheduler) -> None:
    """Count a step the scheduler did not take (Accelerate's AcceleratedScheduler does the
    same while gradients accumulate with ``adjust_scheduler``), so that its step count
    follows the optimizer's calls."""
    scheduler._step_count += 1


def set_last_lr(scheduler, rates: list) -> None:
    """Make ``get_last_lr()`` return `rates` (``_last_lr``): after the caller wrote the
    optimizer's rates itself, so that the two agree without a ``step()`` (which would move
    ``last_epoch`` and the step count)."""
    scheduler._last_lr = rates


def mark_stepping(optimizer) -> None:
    """Wrap ``optimizer.step`` as an LR scheduler does at construction (the
    ``_wrapped_by_lr_sched`` marker; the wrapper sets ``_opt_called``), for a scheduler
    moved onto `optimizer` after it was built: without it, the scheduler's first step warns
    that ``optimizer.step()`` was never called. Nothing where the step is already wrapped."""
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return

    @functools.wraps(step)
    def wrapper(*args, **kwargs):
        optimizer._opt_called = True
        return step(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True
    optimizer.step = wrapper


def fused_devices() -> list[str]:
    """The device types torch's fused optimizer kernels support: the list ``AdamW(fused=True)``
    itself checks against (``torch.utils._foreach_utils._get_fused_kernels_supported_devices``;
    ``["cuda", "cpu"]`` where it is not found)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:
        return ["cuda", "cpu"]
    return _get_fused_kernels_supported_devices()


def missing() -> list[str]:
    import torch

    lines = _probe.absent(
        "torch", ("torch.utils._foreach_utils._get_fused_kernels_supported_devices",),
        ((_SCHEDULER, "_step_count"), (_SCHEDULER, "_last_lr")))
    # The marker is read on a real optimizer: a scheduler wraps its step when built.
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    if not hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        lines.append(f"{_probe.version('torch')}: optimizer.step._wrapped_by_lr_sched "
                     f"(set by {_SCHEDULER})")
    optimizer.step()
    if not getattr(optimizer, "_opt_called", False):
        lines.append(f"{_probe.version('torch')}: optimizer._opt_called (set by {_SCHEDULER})")
    return lines
