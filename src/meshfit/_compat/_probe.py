"""How each module's `missing()` looks a private name up in the installed library: a dotted
name that resolves (a module, then attributes), or an attribute that only instances have
(assigned in the class's ``__init__``, so it is read in the class's source), and the line
that names what moved, with the library's version."""

from __future__ import annotations

import importlib
import inspect


def version(library: str) -> str:
    """``"torch 2.13.0"``: the library and its installed version."""
    module = importlib.import_module(library)
    return f"{library} {getattr(module, '__version__', '(no version)')}"


def resolves(dotted: str) -> bool:
    """Whether `dotted` names something: its longest importable module prefix, then the rest
    as attributes (``torch.utils._foreach_utils._get_fused_kernels_supported_devices``)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            if not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
        return True
    return False


def assigns(dotted_class: str, attribute: str) -> bool:
    """Whether the class `dotted_class` (or one of its bases) assigns ``self.<attribute>``
    in its source: an attribute its instances get in ``__init__``, which the class itself
    does not have."""
    if not resolves(dotted_class):
        return False
    module, _, name = dotted_class.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    for klass in inspect.getmro(cls):
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if f"self.{attribute} =" in source or f"self.{attribute}:" in source:
            return True
    return False


def absent(library: str, names: tuple[str, ...] = (),
           instance: tuple[tuple[str, str], ...] = ()) -> list[str]:
    """The lines `missing()` returns: each of `names` (dotted) that does not resolve and each
    (class, attribute) of `instance` that the class does not assign, as
    ``"torch 2.13.0: torch.x._y"``."""
    lines = [name for name in names if not resolves(name)]
    lines += [f"{cls}().{attr}" for cls, attr in instance if not assigns(cls, attr)]
    if not lines:
        return []
    where = version(library)
    return [f"{where}: {line}" for line in lines]
