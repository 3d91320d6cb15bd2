"""Reference models: a decoder-only transformer covering GPT-2 and Llama shapes.

    from meshfit.models import GPT, GPTConfig
    model = GPT(GPTConfig.preset("tiny"))

`GPTConfig` (config.py) needs no torch; the modules names load on first use.
"""

from __future__ import annotations

import importlib

from meshfit.models.config import GPTConfig

_LAZY = {"GPT": "gpt", "Block": "gpt", "count_params": "gpt", "MoE": "moe"}
__all__ = ["GPT", "GPTConfig", "Block", "MoE", "count_params"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"meshfit.models.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'meshfit.models' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
