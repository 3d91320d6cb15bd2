"""`Trainer`: transformers' own, on meshfit's `Accelerator`."""

from __future__ import annotations

import contextlib

import transformers
import transformers.trainer as hf_trainer

from meshfit.accelerator import Accelerator
from meshfit.accelerator.standalone import skip_first_batches

__all__ = ["Trainer"]


def _accelerator(**args):
    plugin = args.pop("dynamo_plugin", None)
    backend = getattr(plugin, "backend", None)
    if backend is not None and str(getattr(backend, "value", backend)).upper() != "NO":
        args["dynamo_backend"] = str(getattr(backend, "value", backend)).lower()
    return Accelerator(**args)


@contextlib.contextmanager
def _on_meshfit():
    saved = hf_trainer.Accelerator, hf_trainer.skip_first_batches
    hf_trainer.Accelerator, hf_trainer.skip_first_batches = _accelerator, skip_first_batches
    try:
        yield
    finally:
        hf_trainer.Accelerator, hf_trainer.skip_first_batches = saved


class Trainer(transformers.Trainer):
    def create_accelerator_and_postprocess(self) -> None:
        with _on_meshfit():
            super().create_accelerator_and_postprocess()

    def train(self, *args, **kwargs):
        with _on_meshfit():
            return super().train(*args, **kwargs)
