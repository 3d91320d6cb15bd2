"""`TrainingArguments`: transformers' own, with ``parallel=``, meshfit's layout."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import transformers

__all__ = ["TrainingArguments"]


@dataclass
class TrainingArguments(transformers.TrainingArguments):
    parallel: Any = field(default=None, metadata={"help": "meshfit's layout"})
