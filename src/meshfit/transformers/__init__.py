"""Hugging Face Transformers' `Trainer` and `TrainingArguments` on meshfit's `Accelerator`.

``from meshfit.transformers import Trainer, TrainingArguments`` in place of ``from
transformers import ...``: transformers' own classes (subclasses, their training loop
unchanged), whose accelerator is `meshfit.Accelerator` instead of Accelerate's (trainer.py),
with one more argument, ``TrainingArguments(parallel=...)``, for meshfit's layouts; Trainer's
own ``fsdp=``/``fsdp_config``/``deepspeed=`` translated to them (arguments.py).
"""

from meshfit.transformers.arguments import TrainingArguments
from meshfit.transformers.trainer import Trainer

__all__ = ["Trainer", "TrainingArguments"]
