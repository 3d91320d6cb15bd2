"""Hugging Face Transformers' `Trainer` and `TrainingArguments` on meshfit's `Accelerator`.

``from meshfit.transformers import Trainer, TrainingArguments`` in place of ``from
transformers import ...``: transformers' own classes (subclasses, their training loop
unchanged), whose accelerator is `meshfit.Accelerator` instead of Accelerate's (trainer.py),
with one more argument, ``TrainingArguments(parallel=...)``, for meshfit's layouts; Trainer's
own ``fsdp=``/``fsdp_config``/``deepspeed=`` translated to them (arguments.py, translate.py;
``parallel="auto"``: planned.py). TRL's ``SFTTrainer`` and ``SFTConfig`` the same way (trl.py),
and any other Trainer subclass with ``on_meshfit(cls)``.
"""

from meshfit.transformers.arguments import TrainingArguments
from meshfit.transformers.trainer import OnMeshfit, Trainer, on_meshfit

__all__ = ["OnMeshfit", "SFTConfig", "SFTTrainer", "Trainer", "TrainingArguments",
           "on_meshfit"]


def __getattr__(name: str):
    """TRL's trainers on meshfit (`meshfit.transformers.trl`), imported when first asked for:
    trl is an optional dependency."""
    if name in ("SFTTrainer", "SFTConfig"):
        from meshfit.transformers import trl as on_trl

        return getattr(on_trl, name)
    raise AttributeError(f"module 'meshfit.transformers' has no attribute {name!r}")
