"""`TrainingArguments`: transformers' own, plus one argument, ``parallel``, meshfit's layout.

Why one ``parallel`` argument and not a ``MeshfitArguments`` of its own: a layout is already
one type in meshfit, `LayoutRequest` (the mesh sizes and the options: ZeRO stage, CPU or disk
offload, sequence parallel, ...), the one that ``Accelerator(parallel=...)``, ``meshfit
train``'s ``[parallel]`` and ``meshfit plan`` speak. The Trainer's argument takes exactly what
the Accelerator's does, plus the same text ``meshfit estimate --layout`` parses
(``"dp_shard=2,zero_stage=3"``, so ``--parallel`` works from a command line through
``HfArgumentParser``) and ``"auto"``: the planner's first choice (`meshfit.plan.search`) for
this model, batch and machine, decided when the Trainer is built (the model is known then).

transformers' own ways of asking for sharding are read into the same request, with one line
saying so (`meshfit.transformers.translate`): ``fsdp=``/``fsdp_config`` and ``deepspeed=`` (a
ZeRO JSON file or dict; DeepSpeed itself is not needed). They are taken out before
transformers' own checks run, so Accelerate's FSDP and DeepSpeed code paths in the Trainer
stay off: meshfit's `Accelerator` lays the model out.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import transformers

from meshfit.distributed import ParallelDims
from meshfit.parallel.request import LayoutRequest
from meshfit.transformers.translate import from_deepspeed, from_fsdp

__all__ = ["TrainingArguments", "layout_request"]

log = logging.getLogger("meshfit")

_PIPELINE = ("TrainingArguments(parallel=...): pp={pp} is not available under Trainer: its "
             "loop runs forward and backward one micro-batch at a time (model(**inputs), then "
             "backward), and a pipeline schedule runs every micro-batch of a step through the "
             "stages together; use `meshfit train` or Accelerator.prepare_pipeline in your "
             "own loop, or a layout without pp")


def layout_request(value: Any) -> LayoutRequest | str | None:
    """``parallel``'s value as a `LayoutRequest` (``"auto"`` stays the text: the Trainer
    decides it); one-line ValueError for anything else."""
    if value is None or isinstance(value, LayoutRequest):
        request = value
    elif isinstance(value, ParallelDims):
        request = LayoutRequest.of(value)
    elif isinstance(value, str) and value.strip() == "auto":
        return "auto"
    elif isinstance(value, str):
        request = LayoutRequest.parse(value, flag="TrainingArguments(parallel=...)")
    else:
        raise ValueError(f"TrainingArguments(parallel={value!r}) must be a meshfit "
                         "LayoutRequest, ParallelDims, a text such as "
                         "'dp_shard=2,zero_stage=3', or 'auto' (the planner's choice)")
    if request is not None and request.pp > 1:
        raise ValueError(_PIPELINE.format(pp=request.pp))
    return request


@dataclass
class TrainingArguments(transformers.TrainingArguments):
    """transformers' `TrainingArguments` (every field, default and check) and ``parallel``."""

    parallel: Optional[str] = field(default=None, metadata={"help": (
        "meshfit's layout: a LayoutRequest or ParallelDims (meshfit.parallel), a text such "
        "as 'dp_shard=2,zero_stage=3' or 'tp=2,sequence_parallel=true', or 'auto' (the "
        "planner's choice). fsdp= and deepspeed= are read into it.")})

    def __post_init__(self):
        request = layout_request(self.parallel)
        # transformers' sharding requests, read before its own __post_init__ sees them (it
        # would build Accelerate's FSDP plugin, or need DeepSpeed installed).
        for name, translated in (("fsdp", from_fsdp(self.fsdp, self.fsdp_config)),
                                 ("deepspeed", from_deepspeed(self.deepspeed))):
            if translated is None:
                continue
            if request is not None:
                raise ValueError(f"TrainingArguments({name}=..., parallel=...): give the "
                                 "layout once, as one or the other")
            request, line = translated
            log.warning("meshfit: %s", line)
            if name == "fsdp":
                self.fsdp, self.fsdp_config = None, None
            else:
                self.deepspeed = None
        self.parallel = request
        super().__post_init__()

    def to_dict(self) -> dict[str, Any]:
        """transformers' dict (logged, and written by trackers), the layout as its text."""
        out = super().to_dict()
        if isinstance(out.get("parallel"), LayoutRequest):
            out["parallel"] = out["parallel"].describe()
        return out
