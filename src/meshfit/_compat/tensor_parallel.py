"""torch's tensor parallel styles (`torch.distributed.tensor.parallel`): the methods a custom
style overrides or borrows.

A ``ParallelStyle`` is applied by ``parallelize_module``, which calls the style's
``_apply(module, device_mesh)``: the abstract method every custom style implements, under a
private name. meshfit's styles (`meshfit.parallel.tp.styles`) derive from `Hooks` and
implement `Hooks.apply_to` instead; `SequenceParallelHooks` does the same for the one step
of torch's ``SequenceParallel`` that meshfit replaces (``_replicate_module_fn``: how the
norm's replicated parameters are made DTensors); `input_hook` and `output_hook` are the
forward hooks of torch's ``ColwiseParallel`` and ``RowwiseParallel`` (their private static
``_prepare_input_fn`` and ``_prepare_output_fn``), which meshfit's styles for transformers'
``Conv1D`` reuse.

Public replacement: public names for the style contract (``apply``) and for these hooks.
"""

from __future__ import annotations

import functools

from torch.distributed.tensor.parallel import SequenceParallel

from meshfit._compat import _probe

_PARALLEL = "torch.distributed.tensor.parallel"


class Hooks:
    """A mixin for a ``ParallelStyle`` subclass (before torch's class in the bases):
    ``parallelize_module`` calls `apply_to`."""

    def _apply(self, module, device_mesh):
        return self.apply_to(module, device_mesh)

    def apply_to(self, module, device_mesh):
        """Parallelize `module` on `device_mesh`; returns the module."""
        raise NotImplementedError


class SequenceParallelHooks(SequenceParallel):
    """torch's ``SequenceParallel``, whose replicated parameters are made DTensors by
    `replicate_module` (default: torch's own way)."""

    def _replicate_module_fn(self, name, module, device_mesh):
        return self.replicate_module(name, module, device_mesh)

    def replicate_module(self, name, module, device_mesh):
        return super()._replicate_module_fn(name, module, device_mesh)


def input_hook(style):
    """The forward-pre hook ``distribute_module`` gets from `style` (a ``ColwiseParallel``
    or ``RowwiseParallel``): its inputs laid out as the style's ``input_layouts``, then
    redistributed to ``desired_input_layouts``."""
    return functools.partial(style._prepare_input_fn, style.input_layouts,
                             style.desired_input_layouts)


def output_hook(style):
    """The forward hook ``distribute_module`` gets from `style`: its outputs redistributed
    to ``output_layouts``, local tensors where ``use_local_output``."""
    return functools.partial(style._prepare_output_fn, style.output_layouts,
                             style.use_local_output)


def missing() -> list[str]:
    return _probe.absent("torch", (f"{_PARALLEL}.ParallelStyle._apply",
                                   f"{_PARALLEL}.SequenceParallel._replicate_module_fn",
                                   f"{_PARALLEL}.ColwiseParallel._prepare_input_fn",
                                   f"{_PARALLEL}.ColwiseParallel._prepare_output_fn",
                                   f"{_PARALLEL}.RowwiseParallel._prepare_input_fn",
                                   f"{_PARALLEL}.RowwiseParallel._prepare_output_fn"))
