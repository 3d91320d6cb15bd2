"""The optimizers `meshfit.optim.build` makes, by name, without torch: a config names one
and is checked before torch loads. `meshfit.optim` re-exports both names."""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["OPTIMIZERS", "OptimizerName"]

OptimizerName = Literal["adamw", "adamw_fused", "adafactor", "adamw_8bit", "sgd",
                        "muon", "adamw_bf16_states", "adamw_4bit"]
OPTIMIZERS = get_args(OptimizerName)
