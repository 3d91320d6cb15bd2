"""Reference models: a decoder-only transformer covering GPT-2 and Llama shapes.

    from meshfit.models import GPT, GPTConfig
    model = GPT(GPTConfig.preset("tiny"))

`GPTConfig` (config.py) needs no torch; the other names load on first use.
"""

from __future__ import annotations

from meshfit._lazy import lazy_exports
from meshfit.models.config import GPTConfig

_LAZY = {"GPT": "gpt", "Block": "gpt", "count_params": "gpt", "MoE": "moe"}
__all__ = ["GPT", "GPTConfig", "Block", "MoE", "count_params"]
__getattr__, __dir__ = lazy_exports(
    __name__, {name: f"{__name__}.{module}" for name, module in _LAZY.items()}, globals())
