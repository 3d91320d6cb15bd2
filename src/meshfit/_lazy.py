"""Names a package exports but imports only when first asked for.

`import meshfit.models` must not pull in torch, and `from meshfit.parallel import apply_tp`
must not load the pipeline code: a package's `__init__` maps each public name to the module
that defines it and lets Python's module-level ``__getattr__`` (PEP 562) import that module on
first use. Standard library only (layer 0).

    __getattr__, __dir__ = lazy_exports(__name__, {"GPT": "meshfit.models.gpt"}, globals())
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Mapping[str, str], namespace: dict[str, Any]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of `package`: each name of `exports` (name ->
    the module defining it) is looked up in its module when asked for; `namespace` is the
    package's ``globals()``, whose names ``dir()`` lists beside the exported ones."""

    def __getattr__(name: str) -> Any:
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__
