"""How `Accelerator.prepare_model` and `prepare_pipeline` lay a user's model out with
`meshfit.parallel.parallelize` (place, tensor parallel, activation checkpointing, compile,
then the data-parallel wrapper). Weights must be initialised before: sharding a meta-device
model and initialising the shards afterwards gives every rank the same random shard on CPU
meshes, so meta parameters are refused unless the model comes from `meta_model` (then each
rank reads what it holds).

A pipeline (`meshfit.parallel.pp.Pipeline`, from `build_pipeline`'s arguments) is driven with
``loss = pipeline.step(inputs, targets, scale=1/k)`` inside ``accumulate()``, then the
optimizer's ``step`` (built afterwards on ``pipeline.parameters()``); evaluated with
``pipeline.eval_loss``. Each stage is prepared as a model (FSDP2 for every data-parallel
layout with pp): DP+PP, DP+PP+TP and ZeRO+PP+TP are one call. The global batch is micro-batch
x `microbatches` x data-parallel degree x k. Every rank passes the same full model (one seed)
or a meta-device one (materialised per stage from `init_seed`); each data-parallel rank feeds
its own batch. `record_timings=True` keeps per-micro-batch timings in ``pipeline.timings``
(synchronising CUDA around each): turn it off with ``pipeline.record_timings(False)``.
"""

from __future__ import annotations

import sys
from typing import Callable

import torch

from meshfit.accelerator.precision import Precision
from meshfit.accelerator.runtime import Runtime
from meshfit.checkpoint.pretrained import load_into, pretrained_folder, stage_filler, to_empty
from meshfit.parallel.ep import moe_modules
from meshfit.parallel.layout import Layout, ModelFacts
from meshfit.parallel.options import ModelOptions
from meshfit.parallel.parallelize import parallelize

__all__ = ["build", "check_model", "lay_out", "load_pretrained"]


def check_model(model: torch.nn.Module, layout: Layout) -> str | None:
    """Refuse a model `prepare(model)` cannot lay out; returns its pretrained folder, or None."""
    pp, ep = layout.dims.pp, layout.dims.ep
    if pp > 1:
        raise ValueError(f"prepare(model) with pp={pp}: a pipeline layout splits the model "
                         "into stages; use "
                         "accelerator.prepare_pipeline(model, schedule=..., microbatches=...)")
    if ep > 1:
        layout.check_model(ModelFacts(n_blocks=1, experts=tuple(
            m.n_experts for m in moe_modules([model]))))
    peft = sys.modules.get("meshfit.peft")  # imported wherever a model went through qlora
    if peft is not None:
        peft.check_quantized_layout(model, shards=layout.dims.dp_shard if layout.is_fsdp
                                    else 1, tp=layout.dims.tp)
    folder = pretrained_folder(model)
    if folder is None and any(p.is_meta for p in model.parameters()):
        raise ValueError("prepare(model): the model has parameters on the meta device; "
                         "materialise it (to_empty + init_weights) before prepare, or "
                         "build it with meshfit.checkpoint.pretrained.meta_model(folder) to "
                         "load a saved model into each rank's shards")
    return folder


def lay_out(module: torch.nn.Module, layout: Layout, options: ModelOptions, *, mesh,
            device: torch.device, precision: Precision) -> torch.nn.Module:
    """`parallelize` one module (a whole model or a pipeline stage), then run its forward
    under autocast unless the engine computes in low precision itself (FSDP's policy)."""
    wrapped = parallelize(module, layout, options, mesh=mesh, device=device)
    if not layout.owns_mixed_precision:
        precision.wrap_forward(wrapped)
    return wrapped


def load_pretrained(model: torch.nn.Module, folder: str, *, layout: Layout, runtime: Runtime,
                    device: torch.device,
                    lay_out: Callable[[torch.nn.Module], torch.nn.Module]) -> torch.nn.Module:
    """A meta-device model marked by `meshfit.checkpoint.pretrained.meta_model`: under FSDP2
    (ZeRO-2/3, and every layout with tensor parallel) laid out on the meta device, then each
    rank reads only its shards; otherwise (whole parameters on every rank) read whole, then
    laid out (`lay_out`)."""
    buffers = {n: b.detach().clone() for n, b in model.named_buffers() if not b.is_meta}
    peft = sys.modules.get("meshfit.peft")  # imported wherever a model went through qlora
    if peft is not None and peft.quantize_after_load(model):
        # QLoRA: the whole base is read on this rank's host, quantized to 4 bits, then laid
        # out (FSDP2 shards the 4-bit tensors; the full-precision copy is dropped)
        to_empty(model, "cpu" if layout.is_fsdp else device)
        load_into(model, folder, buffers=buffers)
        peft.quantize_base(model)
        return lay_out(model)
    if not layout.is_fsdp:
        to_empty(model, device)
        load_into(model, folder, buffers=buffers)
        return lay_out(model)
    wrapped = lay_out(model)
    inner = runtime.unwrap(wrapped)
    to_empty(inner, "cpu" if layout.host_offload else device)
    load_into(inner, folder, buffers=buffers)
    if layout.host_offload:  # sharded parameters stay in host memory; buffers go to the device
        for module in inner.modules():
            for name, buf in module.named_buffers(recurse=False, remove_duplicate=False):
                setattr(module, name, buf.to(device))  # (a registered buffer stays one)
    return wrapped


def build(model: torch.nn.Module, layout: Layout, options: ModelOptions, *, mesh,
          lay_out: Callable[[torch.nn.Module], torch.nn.Module], microbatches: int,
          schedule: str, virtual_stages: int | None, plan, **pipeline_kwargs):
    """The `Pipeline` of `model` over ``mesh["pp"]``, this rank's stages laid out by `lay_out`."""
    # Lazy: the pipeline code loads torch.distributed.pipelining (about a second).
    from meshfit.parallel.pp import build_pipeline

    if layout.dims.pp == 1:
        raise ValueError("prepare_pipeline needs a pipeline axis: Accelerator(parallel="
                         "ParallelDims(pp=P, ...)) with P > 1; use prepare(model) otherwise")
    peft = sys.modules.get("meshfit.peft")
    if peft is not None:
        peft.check_quantized_layout(model, shards=1, pp=layout.dims.pp)
    facts = ModelFacts.of(model, pipeline_plan=plan, tp_plan=options.tp_plan)
    layout.check_model(facts, schedule=schedule,
                       microbatches=microbatches, virtual_stages=virtual_stages)
    return build_pipeline(
        model, layout.axis_mesh(mesh, "pp"), schedule=schedule, microbatches=microbatches,
        virtual_stages=virtual_stages, plan=plan, parallelize=lay_out,
        fill_stage=stage_filler(model), **pipeline_kwargs)
