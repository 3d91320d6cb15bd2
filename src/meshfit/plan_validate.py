"""`meshfit plan --validate K`: the top K plans' layouts run here, what they measure set
beside what the planner predicted: one row per plan (layout, predicted_bytes, measured_bytes,
predicted_step_s, measured_step_s, bytes_error and time_error = (predicted - measured) /
measured; skipped: why a plan of another world size did not run, e.g. 8 GPUs' on 4 processes).

The plans of world size `nproc` run in ONE start of `nproc` local processes (the backend and
device `meshfit.distributed.init` picks: NCCL and one GPU per process where CUDA is, gloo and
the CPU otherwise or with MESHFIT_CPU=1), one after another, each through `Accelerator` as
`meshfit train` runs it (`prepare` or `prepare_pipeline` with the plan's schedule and
micro-batches, micro-batch size, accumulation to the global batch, activation checkpointing,
mixed precision) on random tokens, MODEL built as `meshfit plan` reads it (a preset, a
transformers config.json or folder, or module:function), the same weights on every rank.

- ``measured_step_s``: seconds per optimizer step, every rank waiting for the others at
  both ends (a barrier), the median of the steps after the first (the first builds the
  optimizer state and, under DDP, its buckets);
- ``measured_bytes``: the peak on the worst rank of what the estimate models: on CUDA,
  `torch.cuda.max_memory_allocated` over the last step (the allocator's figure: it also
  counts temporaries and the cached-but-live blocks of one op); on the CPU, the model
  states `meshfit.memory.rank_report` counts (after a step, gradients kept) plus the largest
  net allocation during one more forward and backward, from the profiler's allocation and
  free events in time order (tests/memory/test_estimate_measured.py measures the same way
  and states its tolerances). ``predicted_bytes`` is the plan's per-rank total; on the CPU,
  plus its offloaded bytes (host and device memory are one there).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshfit import Accelerator, optim
from meshfit._quiet import quiet_logs, quiet_stderr
from meshfit.distributed import is_initialized
from meshfit.distributed.spawn import SpawnError, spawn
from meshfit.memory import net_peak_bytes, rank_report
from meshfit.models import GPT, GPTConfig
from meshfit.models.factory import import_object
from meshfit.parallel.request import LayoutRequest


def validate(plans, *, model: str, seq_len: int, global_batch_size: int, dtype: str,
             steps: int = 3, nproc: int, optimizer: str = "adamw",
             timeout_s: float = 1800.0) -> list[dict]:
    """One row per plan of `plans` (e.g. ``search(...).plans[:K]``), in order, each run for
    `steps` optimizer steps; `dtype`: "fp32", "bf16" or "fp16" (autocast over fp32 master
    weights, as the planner assumed)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise ValueError(f"steps={steps!r} must be an integer >= 2 (the first step is not timed)")
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc={nproc!r} must be an integer >= 1")
    if dtype not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"dtype={dtype!r} must be 'fp32', 'bf16' or 'fp16'")
    rows, jobs = [], []
    for i, plan in enumerate(plans):
        lay = plan.layout
        row = {"layout": lay.describe(), "predicted_bytes": float(plan.estimate.total),
               "measured_bytes": None, "predicted_step_s": float(plan.step_time_s),
               "measured_step_s": None, "bytes_error": None, "time_error": None,
               "skipped": None, "_host": float(plan.estimate.host)}
        if lay.world_size != nproc:
            row["skipped"] = (f"world size {lay.world_size} != {nproc} processes here; only "
                              f"layouts of {nproc} can run")
        elif global_batch_size % lay.dp or (global_batch_size // lay.dp) % (
                lay.micro_batch_size * (lay.microbatches if lay.pp > 1 else 1)):
            row["skipped"] = (f"global batch {global_batch_size} does not divide into {lay.dp} "
                              f"data-parallel ranks x micro-batches of {lay.micro_batch_size}")
        else:
            jobs.append((i, lay))  # (a LayoutSpec: the plan's request whole)
        rows.append(row)
    if jobs:
        results = _spawn(nproc, (jobs, model, seq_len, global_batch_size, dtype, steps,
                                 optimizer), timeout_s)
        for i, _ in jobs:
            per_rank = [r[i] for r in results]
            row = rows[i]
            if per_rank[0]["device"] == "cpu":  # host and device memory are one
                row["predicted_bytes"] += row["_host"]
            row["measured_bytes"] = float(max(r["peak_bytes"] for r in per_rank))
            row["measured_step_s"] = float(max(r["step_s"] for r in per_rank))
            for key, guess, seen in (("bytes_error", "predicted_bytes", "measured_bytes"),
                                     ("time_error", "predicted_step_s", "measured_step_s")):
                row[key] = (row[guess] - row[seen]) / row[seen]
    for row in rows:
        del row["_host"]
    return rows


def _spawn(nproc: int, args: tuple, timeout_s: float) -> list:
    """Each rank's `_run_plans(rank, nproc, *args)`, in rank order (one: in this process)."""
    if nproc == 1:
        return [_run_plans(0, 1, *args)]
    try:
        return spawn(_run_plans, nproc, *args, timeout=timeout_s)
    except SpawnError as err:
        raise RuntimeError(f"plan validation failed: {err}") from None


def _build(model: str, seed: int = 0):
    """MODEL as `meshfit plan` reads it, materialised with the same weights on every rank."""
    torch.manual_seed(seed)
    if model in GPTConfig.preset_names():
        return GPT(GPTConfig.preset(model))
    path = Path(model).expanduser()
    if path.suffix == ".json" or path.is_dir():
        import transformers

        config = path / "config.json" if path.is_dir() else path
        return transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(str(config)))
    return import_object(model, "MODEL")()


def _loss(model, x, y):
    if isinstance(getattr(model, "module", model), GPT):
        return model(x, y)
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def _run_plans(rank, world_size, jobs, model_spec, seq_len, global_batch_size, dtype, steps,
               optimizer):
    out = {}
    # A spawned rank is a new interpreter: the command's quieted loggers are not its own.
    # torchao's notes on the extensions it cannot load and torch's pytree notes on its enums
    # (on importing transformers or peft) would print once per rank (errors still show).
    with quiet_logs():
        for i, layout in jobs:
            out[i] = _run_one(rank, layout, model_spec, seq_len, global_batch_size, dtype,
                              steps, optimizer)
    return out


def _run_one(rank, lay, model_spec, seq_len, global_batch_size, dtype, steps, optimizer):
    """One plan's layout on this rank: `steps` optimizer steps on random tokens; its median
    step time after the first and its peak bytes."""
    pp = lay.pp
    m = lay.microbatches if pp > 1 else 1
    accum = global_batch_size // lay.dp // (lay.micro_batch_size * m)
    acc = _accelerator(lay, dtype, accum)
    model = _build(model_spec)
    vocab = model.config.vocab_size  # GPTConfig and transformers configs alike
    if pp > 1:
        prepared = acc.prepare_pipeline(
            model, schedule=lay.schedule, microbatches=m,
            virtual_stages=lay.virtual_stages if lay.virtual_stages > 1 else None)
        measured = nn.ModuleList(prepared.wrapped_modules)
    else:
        prepared = measured = acc.prepare(model)
    opt = acc.prepare(optim.build(optimizer, measured, lr=1e-4))
    g = torch.Generator().manual_seed(1000 + acc.runtime.dp_rank)
    batches = []
    for _ in range(accum):
        tokens = torch.randint(0, vocab, (lay.micro_batch_size * m, seq_len + 1),
                               generator=g).to(acc.device)
        batches.append((tokens[:, :-1], tokens[:, 1:]))

    def forward_backward(x, y):
        if pp > 1:
            prepared.step(x, y, scale=1 / accum)
        else:
            acc.backward(_loss(prepared, x, y))

    # (a pipeline synchronises on its last micro-batch; a whole model skips the gradient
    # sync on the others, as `meshfit train` does: accumulate(model))
    synced = () if pp > 1 else (prepared,)
    times = _timed_steps(acc, opt, batches, forward_backward, steps, synced)
    return {"device": acc.device.type, "step_s": statistics.median(times[1:]),
            "peak_bytes": _peak_bytes(acc, opt, measured, batches[0], forward_backward, synced),
            "rank": rank}


def _accelerator(lay, dtype: str, accum: int):
    """The plan's layout (a `LayoutSpec`: its request whole) as an `Accelerator`."""
    return Accelerator(parallel=LayoutRequest.from_request(lay),
                       mixed_precision="no" if dtype == "fp32" else dtype,
                       activation_checkpointing=lay.activation_checkpointing,
                       gradient_accumulation_steps=accum)


def _timed_steps(acc, opt, batches, forward_backward, steps: int,
                 models: tuple = ()) -> list[float]:
    """Seconds of each of `steps` optimizer steps, every rank waiting for the others at both
    ends; on CUDA the peak memory is counted from the last step's start."""
    cuda = acc.device.type == "cuda"
    times = []
    for step in range(steps):
        if cuda and step == steps - 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(acc.device)
        if is_initialized():
            dist.barrier()
        start = time.perf_counter()
        for x, y in batches:
            with acc.accumulate(*models):
                forward_backward(x, y)
                opt.step()
                opt.zero_grad()
        if cuda:
            torch.cuda.synchronize()
        if is_initialized():
            dist.barrier()
        times.append(time.perf_counter() - start)
    return times


def _peak_bytes(acc, opt, measured, batch, forward_backward, models: tuple = ()) -> int:
    """This rank's ``measured_bytes``; on the CPU the states are counted with the gradients
    of one more forward and backward (not stepped), the net allocation during another."""
    if acc.device.type == "cuda":
        return torch.cuda.max_memory_allocated(acc.device)
    x, y = batch

    def once():
        with acc.accumulate(*models):
            forward_backward(x, y)

    once()
    states = rank_report(measured, opt).total_bytes
    with quiet_stderr():  # the CPU allocator's C++ note, once per rank, on freeing a tensor
        peak = states + net_peak_bytes(once)  # allocated before the profiler started
    opt.zero_grad()
    return peak
