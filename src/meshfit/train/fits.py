"""Will the run fit in memory? `meshfit train`'s check before any process starts.

The per-rank estimate of `meshfit.memory.estimate` (model states under the run's layout,
activations of one micro-batch, buffers; the host memory CPU offload takes) is compared with
what this machine has:

- on CUDA, the free memory of each local GPU (every rank has its own), and the host memory
  the offloaded states and the offloaded activations (``activation_offload``) of the local
  ranks take together;
- on a CPU, the host's available memory (``MemAvailable``) shared by the local ranks, which
  hold both their device and their offloaded bytes there.

A run that cannot fit is refused in one line with the estimate, what is available and the
layouts of the same world size that fit (`meshfit.plan.search` with this machine's memory),
unless ``--no-memory-check``. The estimate is of the model's training state and
activations; a run that fits it can still need more (allocator caching, a framework's own
process memory), so only a run that cannot fit by the estimate alone is refused.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from meshfit.memory import Adapters, LayoutSpec, ModelShape
from meshfit.memory.estimate import estimate
from meshfit.plan.devices import DEVICES
from meshfit.plan.search import Cluster, search
from meshfit.train.models import build_model

__all__ = ["adapters_of", "check_fits", "host_available_bytes"]

GiB = 2**30
_OPTIMIZERS = {"adamw": "adamw", "adamw_fused": "adamw_fused", "adamw_8bit": "adamw_8bit",
               "sgd": "sgd", "adafactor": "adafactor",
               "adamw_bf16_states": "adamw_bf16_states", "adamw_4bit": "adamw_4bit"}


def host_available_bytes() -> int | None:
    """``MemAvailable`` of /proc/meminfo (None where it cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _spec(cfg, layout):
    """The estimator's spec of the run: its layout's request whole (every size and option, as
    resolved for the launch: cp, ep and disk offload included), with [train]'s micro-batch
    and activation checkpointing."""
    pipeline = {"microbatches": cfg.microbatches(layout.dims.world_size)} \
        if layout.dims.pp > 1 else {}  # (unset: the whole accumulation, as the run takes it)
    train = cfg.train
    return LayoutSpec.from_request(
        layout.request, **pipeline, activation_checkpointing=train.activation_checkpointing,
        activation_checkpointing_budget=train.activation_checkpointing_budget,
        activation_offload=train.activation_offload, micro_batch_size=train.micro_batch_size)


def check_fits(cfg, model, layout, *, world_size: int, local_world_size: int,
               device: torch.device, available: int | None = None,
               host: int | None = None) -> str | None:
    """One-line ValueError when the run of `cfg` (its `model` built on the meta device,
    laid out as `layout`) cannot fit this machine's memory by the estimate; returns a note
    when the check could not be made (a model without a block structure the estimate reads),
    None otherwise. `available` (bytes per rank on the device) and `host` (MemAvailable)
    default to this machine's."""
    adapters = None
    if cfg.peft.method != "none":  # the shape of the frozen base, then what LoRA adds
        adapters = adapters_of(model)
        model = build_model(dataclasses.replace(cfg, peft=type(cfg.peft)()),
                            _vocab_size(model), meta=True)
    try:
        shape = ModelShape.from_module(model)
    except (ValueError, TypeError, AttributeError, KeyError, NotImplementedError) as err:
        return f"memory not checked before launch: the estimate cannot read this model ({err})"
    spec = _spec(cfg, layout)
    dtype = {"no": "fp32"}.get(cfg.train.mixed_precision, cfg.train.mixed_precision)
    optimizer = _OPTIMIZERS.get(cfg.optim.optimizer, "adamw")
    est = estimate(shape, spec, seq_len=cfg.train.seq_len, dtype=dtype, optimizer=optimizer,
                   adapters=adapters)
    host = host if host is not None else host_available_bytes()
    cuda = device.type == "cuda"
    if cuda:
        if available is None:
            available = min(torch.cuda.mem_get_info(i)[0]
                            for i in range(min(local_world_size, torch.cuda.device_count())))
        need, where = est.total, "free on each GPU"
        host_need = est.host * local_world_size
    else:
        if available is None:
            if host is None:
                return "memory not checked before launch: MemAvailable cannot be read"
            available = host // local_world_size
        need = est.total + est.host
        where = (f"available per rank ({local_world_size} local rank(s) share "
                 f"{(host or available * local_world_size) / GiB:.1f} GiB of host memory)")
        host_need = 0.0
    problems = []
    if need > available:
        problems.append(f"the estimate is {need / GiB:.1f} GiB per rank ({_parts(est)}) and "
                        f"{available / GiB:.1f} GiB is {where}")
    if host_need and host is not None and host_need > host:
        problems.append(_host_problem(est, host_need, host, local_world_size))
    if not problems:
        return None
    source = cfg.model.source
    fitting = _fitting(shape, cfg, world_size, local_world_size, available, dtype, optimizer,
                       cuda=cuda, host=host, adapters=adapters)
    raise ValueError(f"model.{source}={getattr(cfg.model, source)!r} does not fit with "
                     f"{spec.describe()} on {world_size} process(es): {'; '.join(problems)}. "
                     f"{fitting}; or pass --no-memory-check to start anyway")


def adapters_of(model: torch.nn.Module):
    """The `meshfit.memory.Adapters` of a model from `meshfit.peft.lora` / `qlora` (on the
    meta device is enough): its trainable parameters, and the weights `qlora` keeps in 4
    bits."""
    from meshfit import peft  # (it imports peft and transformers, optional: for LoRA only)

    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    quantized = 0
    if peft.quantize_after_load(model) or any(peft.is_quantized(p) for p in model.parameters()):
        quantized = sum(m.weight.numel() for m in peft.quantized_linears(model).values())
    return Adapters(trainable=trainable, quantized=quantized)


def _vocab_size(model: torch.nn.Module) -> int:
    """The vocabulary the model was built for (its input embedding's rows)."""
    embedding = next(m for m in model.modules() if isinstance(m, torch.nn.Embedding))
    return embedding.num_embeddings


def _host_problem(est, need: float, host: int, local_world_size: int) -> str:
    """What the host memory is short of: the offloaded states and/or activations."""
    acts = est.detail.get("activations_on_host", 0.0)
    states = est.host - acts
    what = " and ".join(w for w, b in (("CPU offload", states), ("activation offload", acts))
                        if b)
    parts = ", ".join(f"{name} {b / GiB:.1f}" for name, b in
                      (("optimizer/parameter states", states), ("saved activations", acts)) if b)
    return (f"{what} needs {need / GiB:.1f} GiB of host memory for the {local_world_size} "
            f"local rank(s) and {host / GiB:.1f} GiB is available (per rank: {parts} GiB)")


def _parts(est) -> str:
    parts = [("model states", est.params + est.grads + est.optimizer),
             ("activations", est.activations), ("buffers", est.buffers)]
    if est.host:
        parts.append(("offloaded to host", est.host))
    return ", ".join(f"{name} {value / GiB:.1f}" for name, value in parts)


def _fitting(shape, cfg, world_size: int, local_world_size: int, available: int, dtype: str,
             optimizer: str, *, cuda: bool, host: int | None, adapters=None) -> str:
    """The layouts of `world_size` ranks that fit `available` bytes per rank, best first; the
    host memory that offload takes counted too (on a CPU it is the same memory)."""
    device = dataclasses.replace(DEVICES["h100"], memory=available)
    cluster = Cluster(gpus_per_node=local_world_size,
                      nodes=max(1, world_size // local_world_size), device=device)
    try:
        found = search(shape, cluster, seq_len=cfg.train.seq_len,
                       global_batch_size=cfg.train.global_batch_size, dtype=dtype,
                       optimizer=optimizer, margin=0.0, adapters=adapters)
        plans = [p for p in found.plans
                 if (p.estimate.host * local_world_size <= (host or 0) if cuda
                     else p.estimate.total + p.estimate.host <= available)
                 or not p.estimate.host][:3]
        if not plans:
            raise ValueError("none fits with its offloaded bytes")
    except ValueError:
        return (f"No layout of {world_size} process(es) fits {available / GiB:.1f} GiB per "
                "rank by the estimate: use more processes or machines, or a smaller model "
                "(`meshfit plan` shows what each layout needs)")
    listed = "; ".join(p.layout.describe() for p in plans)
    return f"Layouts of {world_size} process(es) that fit (`meshfit plan`): {listed}"
