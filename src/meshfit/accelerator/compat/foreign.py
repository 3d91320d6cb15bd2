"""Accelerate's own configuration objects, where a script passes them to meshfit (a script
keeping ``from accelerate.utils import DistributedDataParallelKwargs`` beside ``from meshfit
import Accelerator``): each becomes meshfit's class of the same name, field by field (the
classes keep Accelerate 1.15's fields and defaults), Accelerate's enums by value."""

from __future__ import annotations

import copy
import dataclasses
import enum
from typing import Any

import meshfit.accelerator.compat as compat
from meshfit.accelerator.compat import parallelism

__all__ = ["from_accelerate", "from_accelerate_arguments"]

# The Accelerator arguments that take configuration objects (kwargs_handlers: a list of them).
_OBJECT_ARGUMENTS = ("dataloader_config", "fsdp_plugin", "project_config",
                     "gradient_accumulation_plugin", "parallelism_config")


def _is_accelerate(obj: Any) -> bool:
    return type(obj).__module__.split(".")[0] == "accelerate"


def _ours(cls: type):
    ours = getattr(compat, cls.__name__, None) or getattr(parallelism, cls.__name__, None)
    if ours is None:
        raise ValueError(f"{cls.__name__} (from {cls.__module__}) has no meshfit counterpart; "
                         "use the classes of meshfit.utils (see docs/accelerator.md)")
    return ours


def _value(value: Any) -> Any:
    if isinstance(value, enum.Enum) and _is_accelerate(value):
        return _ours(type(value))(value.value)
    return value


def from_accelerate(obj: Any) -> Any:
    """`obj` itself, or meshfit's object of its class's name with its fields (an object from
    the ``accelerate`` package)."""
    if not _is_accelerate(obj) or isinstance(obj, enum.Enum):
        return _value(obj)
    ours = _ours(type(obj))
    if not dataclasses.is_dataclass(ours):
        raise ValueError(f"{type(obj).__name__} from accelerate cannot be passed to meshfit; "
                         f"use meshfit's ({ours.__module__}.{ours.__name__})")
    values = {f.name: _value(getattr(obj, f.name)) for f in dataclasses.fields(ours)
              if f.init and hasattr(obj, f.name)}
    try:
        return ours(**values)
    except (TypeError, ValueError) as err:
        raise ValueError(f"accelerate's {type(obj).__name__} could not be read as meshfit's "
                         f"({err}); build it from meshfit.utils instead") from None


def from_accelerate_arguments(given: dict) -> dict:
    """`Accelerator`'s arguments by name, Accelerate's objects among them made meshfit's."""
    out = copy.copy(given)  # (the same kind of mapping: the caller's may watch its reads)
    for name in _OBJECT_ARGUMENTS:
        if out.get(name) is not None:
            out[name] = from_accelerate(out[name])
    if out.get("kwargs_handlers"):
        out["kwargs_handlers"] = [from_accelerate(h) for h in out["kwargs_handlers"]]
    return out
