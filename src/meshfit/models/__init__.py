"""Reference models: a decoder-only transformer covering GPT-2 and Llama shapes.

    from meshfit.models import GPT, GPTConfig
    model = GPT(GPTConfig.preset("tiny"))

config.py (`GPTConfig`, no torch; the other names load on first use), gpt.py (`GPT`), mlp.py
and moe.py (its dense and mixture-of-experts MLPs), loss.py (the head's loss a chunk of tokens
at a time), factory.py (``module:attribute`` specs), plans/ (parallel plans as data).
"""

from __future__ import annotations

from meshfit._lazy import lazy_exports
from meshfit.models.config import GPTConfig

_LAZY = {"GPT": "gpt", "Block": "gpt", "count_params": "gpt", "MoE": "moe"}
__all__ = ["GPT", "GPTConfig", "Block", "MoE", "count_params"]
__getattr__, __dir__ = lazy_exports(
    __name__, {name: f"{__name__}.{module}" for name, module in _LAZY.items()}, globals())
