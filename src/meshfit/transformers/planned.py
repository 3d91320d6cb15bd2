"""``TrainingArguments(parallel="auto")``: the planner's first choice for this Trainer's job.

`meshfit.plan.search` ranks every legal layout of the job's processes by predicted step time
among those that fit in memory by the estimate (`meshfit.memory`); the job is read from the
Trainer: the model (its shape), the global batch (per-device batch x processes x
accumulation), the sequence length (the first training row's, else the model's context),
the precision, optimizer and activation checkpointing named in the arguments, and this
machine's device: a CUDA device's total memory (with an H100's data sheet for its speed: the
ranking's times are relative), or the host's memory shared by the local processes on a CPU.
Every process decides from the same facts (total memory, not free memory, which differs
between processes), so they decide the same.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from meshfit.memory import ModelShape
from meshfit.parallel.request import LayoutRequest
from meshfit.plan.devices import DEVICES
from meshfit.plan.search import Cluster, search

__all__ = ["planned_layout"]

log = logging.getLogger("meshfit")


def _optimizer(name) -> str:
    name = str(getattr(name, "value", name))
    if "8bit" in name:
        return "adamw_8bit"
    if name.startswith("adafactor"):
        return "adafactor"
    if name.startswith("sgd"):
        return "sgd"
    return "adamw"


def _seq_len(model, dataset) -> int:
    try:
        return len(dataset[0]["input_ids"])
    except (TypeError, KeyError, IndexError, AttributeError):
        return int(getattr(model.config, "max_position_embeddings", 2048))


def _cluster(local: int, world: int) -> Cluster:
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        device = dataclasses.replace(DEVICES["h100"], memory=total)
    else:
        device = DEVICES["cpu"]
    return Cluster(gpus_per_node=local, nodes=max(1, world // local), device=device)


def planned_layout(model, args, dataset) -> LayoutRequest:
    """The layout `meshfit.plan.search` ranks first for this job (see the module's
    docstring); one-line ValueError when none fits."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    batch = args.per_device_train_batch_size * world * args.gradient_accumulation_steps
    try:
        shape = ModelShape.from_module(model)
    except (ValueError, TypeError, AttributeError, KeyError, NotImplementedError) as err:
        raise ValueError(f"TrainingArguments(parallel='auto'): the planner cannot read this "
                         f"model ({err}); name a layout, e.g. parallel='dp_shard="
                         f"{world},zero_stage=3'") from None
    found = search(shape, _cluster(local, world), seq_len=_seq_len(model, dataset),
                   global_batch_size=batch, dtype=dtype, optimizer=_optimizer(args.optim),
                   checkpointing=("full",) if args.gradient_checkpointing else ("none",))
    # Pipeline parallel is not available under Trainer (`meshfit.transformers.arguments`).
    plans = [p for p in found.plans if p.layout.pp == 1]
    if not plans:
        raise ValueError(f"TrainingArguments(parallel='auto'): no layout of {world} "
                         "process(es) without pipeline parallel fits this model by the "
                         "estimate (`meshfit plan` shows what each needs)")
    plan = plans[0]
    request = LayoutRequest(**{k: getattr(plan.layout, k) for k in LayoutRequest.field_names()})
    log.warning("meshfit: parallel='auto' chose %s (%s)", request.describe(), plan.why)
    return request
