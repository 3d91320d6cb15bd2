"""Reference models: a decoder-only transformer covering GPT-2 and Llama shapes.

    from meshfit.models import GPT, GPTConfig
    model = GPT(GPTConfig.preset("tiny"))
"""

from meshfit.models.config import GPTConfig
from meshfit.models.gpt import GPT, Block, count_params
from meshfit.models.moe import MoE

__all__ = ["GPT", "GPTConfig", "Block", "MoE", "count_params"]
