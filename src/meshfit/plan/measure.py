"""`meshfit calibrate`'s measurement, run on every rank at once: the figures of
`meshfit.plan.calibrate` (matmul, memory, collectives, training steps, data-parallel
engines: `meshfit.plan.probes`), then the layouts whose cost is measured against the
planner's own prediction of them (`meshfit.plan.cost.predict`): tensor parallel and each
pipeline schedule. Rank 0 writes the file (schema: `meshfit.plan.calibrate`)."""

from __future__ import annotations

import datetime
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from meshfit._files import atomic_write_text
from meshfit.distributed import init, is_initialized
from meshfit.memory.estimate import LayoutSpec
from meshfit.memory.shape import ModelShape
from meshfit.models import GPT, GPTConfig
from meshfit.plan.calibrate import PP_SCHEDULES, SCHEMA, TP_ENGINES, Calibration
from meshfit.plan.cost import Cluster, predict
from meshfit.plan.devices import DEVICES
from meshfit.plan.fit import KINDS, CollectiveFit, TrainStepFit
from meshfit.plan.probes import (_CPU_SIZES, _GPU_SIZES, _collectives, _data_parallel, _matmul,
                                 _memory, _Ranks, _train_steps)
from meshfit.plan.trust import judge

__all__ = ["measure"]


def _partial_cluster(r: _Ranks, flops, bandwidth, colls, steps, engines):
    """A `Cluster` of this job's ranks with what has been measured so far, to ask the
    planner what it predicts for a layout being timed."""
    partial = Calibration(
        schema=SCHEMA, device=str(r.device.type), backend="", world_size=r.env.world_size,
        torch="", time="", matmul_flops=flops, memory_bandwidth=bandwidth,
        collectives={k: CollectiveFit(**colls[k]) for k in KINDS}, raw={},
        train_step={k: None if v is None else TrainStepFit(**v) for k, v in steps.items()},
        data_parallel=engines)
    return Cluster(gpus_per_node=r.env.world_size, calibration=partial,
                   device=DEVICES["h100" if r.device.type == "cuda" else "cpu"])


_TP_SHAPES = {"cpu": (256, 2, 128, 4), "cuda": (2048, 2, 1024, 8)}
"""(d_model, n_layer, seq_len, batch) of the reference GPT tensor parallel is timed on."""


def _tensor_parallel(r: _Ranks, flops, bandwidth, colls, steps, engines) -> tuple[dict, dict]:
    """Per `TP_ENGINES`, a training step's seconds beyond the planner's prediction of all
    else, over its modelled TP all-reduces (how much more than the bare collectives a real
    step spends on them), and the timings."""
    if steps.get("fp32") is None:
        return {}, {}
    from meshfit.parallel.tp import apply_tp  # (DTensor: ~2 s of imports; one process: unused)

    n = r.env.world_size
    d, layers, seq, batch = _TP_SHAPES["cuda" if r.device.type == "cuda" else "cpu"]
    config = GPTConfig(vocab_size=256, d_model=d, n_layer=layers, n_head=d // 32, d_ff=4 * d,
                       max_seq_len=seq)
    if any(size % n for size in (config.n_head, config.d_ff, config.vocab_size)):
        return {e: None for e in TP_ENGINES}, {}
    gen = torch.Generator().manual_seed(0)  # the same batch on every rank
    x = torch.randint(0, 256, (batch, seq + 1), generator=gen).to(r.device)
    mesh = init_device_mesh(r.device.type, (n,))
    cluster = _partial_cluster(r, flops, bandwidth, colls, steps, engines)
    out, raw = {}, {"tp_shape": {"d_model": d, "n_layer": layers, "seq_len": seq,
                                 "batch": batch}}
    for engine in TP_ENGINES:
        torch.manual_seed(0)
        model = GPT(config).to(r.device)
        shape = ModelShape.from_module(model, name="calibration")
        apply_tp(model, mesh, sequence_parallel=engine == "tp_sp")

        def step(model=model):
            model(x[:, :-1], x[:, 1:]).backward()
            for p in model.parameters():
                p.grad = None

        timed = r.time(step, target=0.3, warmup=1)
        spec = LayoutSpec(tp=n, dp_replicate=1, dp_shard=1, micro_batch_size=batch,
                          sequence_parallel=engine == "tp_sp")
        predicted, terms = predict(shape, spec, cluster, seq_len=seq, global_batch_size=batch,
                                   dtype="fp32")
        rest = predicted - terms["optimizer"] - terms["tp"]
        # (at most the noise, or below 0: flagged by meshfit.plan.trust, not used)
        out[engine] = max(0.0, timed.seconds - rest) / terms["tp"] if terms["tp"] > 0 else None
        raw[engine] = {"seconds": timed.seconds, "spread": timed.spread,
                       "noise_seconds": timed.noise, "predicted_without_tp": rest,
                       "modelled_tp_seconds": terms["tp"]}
    return out, raw


_PP_SHAPES = {"cpu": (128, 2, 128), "cuda": (1024, 2, 1024)}
"""(d_model, blocks per rank, seq_len) of the reference GPT a pipeline is timed on."""


def _pipeline(r: _Ranks, flops: dict, bandwidth: float, colls: dict, steps: dict,
              engines: dict | None) -> tuple[dict | None, dict]:
    """Per schedule, seconds per micro-batch beyond the planner's prediction (module
    docstring) and the timings; (None, {}) on one process or without an fp32 step fit."""
    if not r.group or steps.get("fp32") is None or colls["send_recv"]["latency"] is None:
        return None, {}
    # torch.distributed.pipelining: ~3 s of imports, which one process never uses
    from meshfit.parallel.pp import build_pipeline

    n = r.env.world_size
    d, per_rank, seq = _PP_SHAPES["cuda" if r.device.type == "cuda" else "cpu"]
    m = 4 * n
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, d_model=d, n_layer=per_rank * n,
                          n_head=d // 32, d_ff=4 * d, max_seq_len=seq))
    gen = torch.Generator().manual_seed(0)  # the same batch on every rank
    x = torch.randint(0, 256, (m, seq + 1), generator=gen).to(r.device)
    cluster = _partial_cluster(r, flops, bandwidth, colls, steps, engines)
    shape = ModelShape.from_module(model, name="calibration")
    mesh = init_device_mesh(r.device.type, (n,))
    out, raw = {}, {"shape": {"d_model": d, "n_layer": model.config.n_layer, "seq_len": seq,
                              "microbatches": m}}
    for schedule in PP_SCHEDULES:
        v = 2 if schedule in ("interleaved_1f1b", "zero_bubble") else 1
        pipe = build_pipeline(model, mesh, schedule=schedule, microbatches=m,
                              virtual_stages=v if v > 1 else None, record_timings=False)

        def step(pipe=pipe):
            pipe.step(x[:, :-1], x[:, 1:])
            for module in pipe.modules:
                module.zero_grad(set_to_none=True)

        timed = r.time(step, target=0.3, warmup=1)
        spec = LayoutSpec(pp=n, dp_replicate=1, dp_shard=1, schedule=schedule, microbatches=m,
                          virtual_stages=v, micro_batch_size=1)
        predicted, terms = predict(shape, spec, cluster, seq_len=seq, global_batch_size=m,
                                   dtype="fp32")
        base = predicted - terms["optimizer"]  # (no optimizer step is timed here)
        # (at most the noise, or below 0: flagged by meshfit.plan.trust, not used)
        out[schedule] = max(0.0, timed.seconds - base) / m
        raw[schedule] = {"seconds": timed.seconds, "spread": timed.spread,
                         "noise_seconds": timed.noise, "predicted_seconds": base}
        del pipe
    return out, raw


def measure(out: Path, sizes: tuple[int, ...] | None = None, cpu: bool = False,
            repeats: int = 5) -> dict | None:
    """Measure on every rank of this job (one process, or each of the launched workers,
    calling it at once): rank 0 writes `out` (atomically) and returns what it wrote, the
    other ranks None. `sizes`: the collectives' sizes in bytes (default: 4 KiB .. 64 MiB on
    the CPU, 16 KiB .. 1 GiB on GPUs); `cpu`: the CPU and gloo even beside CUDA; `repeats`:
    the times each timing is repeated (at least 2: their spread is the noise)."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 2:
        raise ValueError(f"repeats={repeats!r} must be an integer >= 2 (a timing's spread "
                         "needs two repeats)")
    env = init(cpu=cpu or None)
    result = None
    try:
        r = _Ranks(env, repeats)
        figures, raw = _probe_all(r, sizes)
        if env.rank == 0:
            result = _file(env, figures, raw, r)
            atomic_write_text(out, json.dumps(result, indent=1) + "\n")
        if r.group:
            dist.barrier()
    finally:
        if env.is_distributed and is_initialized():
            dist.destroy_process_group()
    return result


def _probe_all(r: _Ranks, sizes: tuple[int, ...] | None) -> tuple[dict, dict]:
    """Every probe in order (each uses the figures before it): the file's figures and its
    ``raw`` timings, with the seconds each probe took (``raw.phases``)."""
    cuda = r.device.type == "cuda"
    sizes = sizes or (_GPU_SIZES if cuda else _CPU_SIZES)
    phases, clock = {}, [time.perf_counter()]

    def done(name: str) -> None:
        now = time.perf_counter()
        phases[name] = now - clock[0]
        clock[0] = now

    flops, raw_mm = _matmul(r)
    bandwidth, raw_mem = _memory(r)
    done("matmul_memory")
    colls, raw_coll = _collectives(r, sizes)
    done("collectives")
    steps, raw_steps = _train_steps(r, flops)
    done("train_step")
    engines, raw_engines = _data_parallel(r, colls)
    done("data_parallel")
    schedules, raw_schedules = _pipeline(r, flops, bandwidth, colls, steps, engines)
    done("pipeline")
    if engines is not None:
        tp_scales, raw_tp = _tensor_parallel(r, flops, bandwidth, colls, steps, engines)
        engines.update(tp_scales)
        raw_engines.update(raw_tp)
        done("tensor_parallel")
    figures = {"matmul_flops": flops, "memory_bandwidth": bandwidth, "collectives": colls,
               "train_step": steps, "data_parallel": engines, "pipeline": schedules}
    raw = {"matmul": raw_mm, "memory": raw_mem, "collectives": raw_coll,
           "train_step": raw_steps, "data_parallel": raw_engines, "pipeline": raw_schedules,
           "threads": torch.get_num_threads(), "phases": phases,
           "seconds": sum(phases.values())}
    return figures, raw


def _file(env, figures: dict, raw: dict, r: _Ranks) -> dict:
    """The file's contents (schema: `meshfit.plan.calibrate`): the figures, the raw timings
    with the spread of their repeats (``raw.noise``), and the flags on what they cannot
    tell from noise (`meshfit.plan.trust.judge`)."""
    cuda = env.device.type == "cuda"
    raw["noise"] = {"repeats": r.repeats, "timings": len(r.spreads),
                    "median_spread": statistics.median(r.spreads),
                    "max_spread": max(r.spreads)}
    result = {
        "schema": SCHEMA,
        "device": f"cuda:{torch.cuda.get_device_name(env.device)}" if cuda else "cpu",
        "backend": env.backend or ("nccl" if cuda else "gloo"),
        "world_size": env.world_size, "torch": torch.__version__,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **figures, "raw": raw}
    result["flags"] = judge(result)
    return result
