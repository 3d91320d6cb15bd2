"""TRL's `SFTTrainer` and `SFTConfig` on meshfit: TRL's own classes with the bridge of
`meshfit.transformers.trainer` (`OnMeshfit` first among the trainer's bases) and the
``parallel`` argument of `meshfit.transformers.TrainingArguments` (TRL's config is a
transformers ``TrainingArguments`` too: the two merge as dataclasses, TRL's fields and checks
first). Imported on first use (``from meshfit.transformers import SFTTrainer``): trl is
optional.
"""

from __future__ import annotations

from dataclasses import dataclass

import trl

from meshfit.transformers.arguments import TrainingArguments
from meshfit.transformers.trainer import on_meshfit

__all__ = ["SFTConfig", "SFTTrainer"]


@dataclass
class SFTConfig(trl.SFTConfig, TrainingArguments):
    """TRL's `SFTConfig` with meshfit's ``parallel`` (and ``fsdp=``/``deepspeed=`` read as
    ZeRO stages)."""


SFTTrainer = on_meshfit(trl.SFTTrainer)
