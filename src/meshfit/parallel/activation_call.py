"""Contexts held around the whole call of a module: ``module(...)`` runs inside them, module
hooks and checkpointing included.

Activation offloading (`meshfit.parallel.activation_offload`) must see the tensors a block
saves, and the memory budget (`meshfit.parallel.activation_budget`) must hold while a
compiled module compiles, on its first call. A forward pre-hook is not enough for either: a
hook runs inside Hugging Face's per-layer checkpoint (``GradientCheckpointingLayer``
overrides ``__call__``) and again during its recomputation, and a context entered in a hook
is not left when the forward raises. So the module's class is swapped for a subclass whose
``__call__`` enters the contexts and calls the original one, as `activation`'s
checkpointing swaps ``forward`` (parameter names and state_dict keys stay as they are).
``__call__`` and ``forward`` are different methods, so the two swaps compose in either
order: the contexts always hold around the checkpoint.
"""

from __future__ import annotations

import contextlib
import copyreg
import functools
from collections.abc import Callable
from contextlib import AbstractContextManager

from torch import nn

__all__ = ["add_around_call", "arounds", "remove_around_call"]


class _AroundCallMixin:
    """The first base of a per-class subclass: ``__call__`` enters the instance's contexts
    (``_meshfit_around``: name -> factory) around the original call."""

    _meshfit_made = True  # a class meshfit made (`meshfit.parallel.activation._plain_class`)
    _meshfit_around: dict[str, Callable[[], AbstractContextManager]] = {}

    def __call__(self, *args, **kwargs):
        around = self._meshfit_around
        if not around:
            return super().__call__(*args, **kwargs)
        with contextlib.ExitStack() as stack:
            for factory in around.values():
                stack.enter_context(factory())
            return super().__call__(*args, **kwargs)

    def __reduce_ex__(self, protocol):
        # The subclass is made at run time: rebuild the class below it (the plain one, or
        # checkpointing's, which rebuilds itself the same way) and put the swap back on top.
        fn, args, *rest = super().__reduce_ex__(max(protocol, 2))
        if fn is copyreg.__newobj__ and args[0] is type(self):
            args = (type(self).__bases__[1], *args[1:])
        return (_rebuild, (fn, args), *rest)


def _rebuild(fn, args):
    module = fn(*args)
    if not isinstance(module, _AroundCallMixin):
        module.__class__ = _around_class(type(module))
    return module


@functools.cache
def _around_class(cls: type) -> type:
    return type(cls.__name__, (_AroundCallMixin, cls),
                {"__module__": cls.__module__, "__qualname__": cls.__qualname__})


def add_around_call(module: nn.Module, name: str,
                    factory: Callable[[], AbstractContextManager]) -> None:
    """Run every later ``module(...)`` inside ``factory()`` (replacing an earlier one of the
    same `name`); contexts are entered in the order they were added."""
    if not isinstance(module, _AroundCallMixin):
        module.__class__ = _around_class(type(module))
    module._meshfit_around = {**arounds(module), name: factory}


def remove_around_call(module: nn.Module, name: str) -> None:
    """Undo `add_around_call` of `name` (nothing if it is not there); the module gets its
    own class back when no context is left and no later swap (FSDP2's) sits above ours."""
    left = {k: v for k, v in arounds(module).items() if k != name}
    if left:
        module._meshfit_around = left
        return
    module.__dict__.pop("_meshfit_around", None)
    cls = type(module)
    if cls.__bases__[0] is _AroundCallMixin:
        module.__class__ = cls.__bases__[1]


def arounds(module: nn.Module) -> dict[str, Callable[[], AbstractContextManager]]:
    """The contexts `add_around_call` put around `module`'s call, by name."""
    return dict(module.__dict__.get("_meshfit_around", {}))
