"""What a `meshfit train` run shows of itself per logged step beyond loss and throughput
(gradient norm, tokens/s per device, MFU, peak memory per rank, the share of the step spent
waiting for data), and where it goes (OUT/metrics.jsonl always; the trackers of ``[log]
with``; a progress bar on a terminal, plain lines otherwise: ``nohup``, a batch log file).

MFU (model FLOPs utilisation, PaLM's definition): achieved model FLOP/s over the devices'
peak; model FLOPs per token from the model's shape (``6 N + 12 L d T``,
`meshfit.memory.ModelShape.flops_per_token`: recomputation not counted); the peak from
``[log] calibration`` (a `meshfit calibrate` file: measured matmul FLOP/s of the training
dtype) or the data sheet of a known GPU (`meshfit.plan.DEVICES`); none on a CPU without a
calibration (reported as null / "n/a").
"""

from __future__ import annotations

import math
import resource
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshfit.memory import ModelShape
from meshfit.plan.calibrate import load_calibration
from meshfit.plan.devices import device_for_name
from meshfit.tracking import build_trackers, finish_all, flatten_config

__all__ = ["RunReporter", "device_peak_flops", "model_flops_per_token", "peak_memory_bytes",
           "timed_batches"]


def model_flops_per_token(model: torch.nn.Module, seq_len: int) -> float | None:
    """Training FLOPs per token of `model` (None when its shape cannot be read)."""
    try:
        return ModelShape.from_module(model).flops_per_token(seq_len)
    except (ValueError, AttributeError, TypeError):
        return None


def device_peak_flops(device: torch.device, mixed_precision: str, calibration: str = "",
                      *, tf32: bool = False) -> tuple[float | None, str]:
    """(peak FLOP/s of one device for the training dtype, where the figure comes from): a
    calibration file's measured matmul figure, else a known GPU's data sheet, whose fp32
    figure counts TF32 tensor cores only when `tf32` is on."""
    dtype = mixed_precision if mixed_precision in ("bf16", "fp16") else "fp32"
    if calibration:
        flops = load_calibration(calibration).matmul_flops.get(dtype)
        return (flops, f"measured {dtype} matmul in {calibration}") if flops else (None, "")
    if device.type == "cuda":
        found = device_for_name(torch.cuda.get_device_name(device))
        if found is not None:
            key, spec = found
            kind = "tf32" if dtype == "fp32" and tf32 else dtype
            return spec.matmul_peak(dtype, tf32=tf32), f"{key} data sheet, {kind} dense"
    return None, ""


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory: on CUDA the allocator's peak of allocated bytes since the
    last call (`torch.cuda.max_memory_allocated`, reset here); on the CPU the peak resident
    set size since the process started (`resource.getrusage`: the kernel keeps no resettable
    peak), so it only grows."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return int(peak)
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(kib * (1 if sys.platform == "darwin" else 1024))


def timed_batches(batches: Iterator, clock: list[float]) -> Iterator:
    """`batches`, adding the seconds each `next` waits to ``clock[0]``."""
    while True:
        began = time.perf_counter()
        try:
            item = next(batches)
        except StopIteration:
            return
        clock[0] += time.perf_counter() - began
        yield item


class RunReporter:
    """The main process's outputs of a run (every rank calls `step_figures`: it gathers)."""

    def __init__(self, acc, cfg, out_dir: Path | None, model: torch.nn.Module,
                 total_steps: int) -> None:
        self.acc, self.total = acc, total_steps
        self.world = acc.num_processes
        self.fpt = model_flops_per_token(model, cfg.train.seq_len)
        self.peak, self.peak_source = device_peak_flops(
            acc.device, cfg.train.mixed_precision, cfg.log.calibration, tf32=cfg.train.tf32)
        self.main = acc.is_main_process
        self.trackers = []
        if self.main and cfg.log.with_ and out_dir is not None:
            self.trackers = build_trackers(cfg.log.with_, logging_dir=out_dir / "tracking",
                                           project_name=cfg.log.project)
            config = flatten_config(cfg.to_dict())
            for tracker in self.trackers:
                tracker.store_init_configuration(config)
        self.terminal = self.main and sys.stdout.isatty()
        self.bar = None
        if self.terminal:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeRemainingColumn)
            self.bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[info]}"), TimeRemainingColumn())
            self.task = self.bar.add_task("train", total=total_steps, info="")
            self.bar.start()

    # ------------------------------------------------------------------ figures
    def step_figures(self, record: dict[str, Any], *, grad_norm: float | None,
                     wait_s: float, window_s: float) -> dict[str, Any]:
        """Adds to a logged step's `record` (which has tokens_per_s): grad_norm,
        tokens_per_s_per_device, mfu, peak_memory_bytes (the largest rank's) and
        peak_memory_bytes_per_rank, data_wait_share. A collective."""
        out = dict(record)
        if grad_norm is not None and math.isfinite(grad_norm):
            out["grad_norm"] = round(grad_norm, 5)
        tps = record.get("tokens_per_s", 0.0)
        out["tokens_per_s_per_device"] = round(tps / self.world, 1)
        out["mfu"] = round(tps * self.fpt / (self.peak * self.world), 5) \
            if self.fpt and self.peak else None
        mine = torch.tensor([float(peak_memory_bytes(self.acc.device))],
                            dtype=torch.float64, device=self.acc.device)
        share = torch.tensor([wait_s / max(window_s, 1e-9)], dtype=torch.float64,
                             device=self.acc.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(every, mine)
            dist.all_reduce(share, op=dist.ReduceOp.MAX)  # the most data-starved rank
            per_rank = [int(x.item()) for x in every]
        else:
            per_rank = [int(mine.item())]
        out["peak_memory_bytes"] = max(per_rank)
        out["peak_memory_bytes_per_rank"] = per_rank
        out["data_wait_share"] = round(min(1.0, float(share.item())), 4)
        return out

    # ------------------------------------------------------------------ outputs
    def report(self, record: dict[str, Any], step: int) -> None:
        """A logged step (or an evaluation) to the trackers and the terminal."""
        if not self.main:
            return
        for tracker in self.trackers:
            tracker.log({k: v for k, v in record.items()
                         if k not in ("step", "peak_memory_bytes_per_rank")}, step=step)
        if "loss" in record:
            line = self._line(record)
            if self.bar is not None:
                self.bar.update(self.task, completed=step, info=line)
            else:
                print(f"step {step}/{self.total}  {line}", flush=True)
        elif "val_loss" in record and self.bar is None:
            print(f"step {step}/{self.total}  val_loss {record['val_loss']:.4f}", flush=True)

    def _line(self, r: dict[str, Any]) -> str:
        parts = [f"loss {r['loss']:.3f}", f"{r['tokens_per_s']:.0f} tok/s"]
        if not self.terminal:  # a log file has room for every figure
            parts.insert(1, f"lr {r['lr']:.2e}")
            if "grad_norm" in r:
                parts.insert(2, f"grad_norm {r['grad_norm']:.3f}")
            parts.append(f"({r['tokens_per_s_per_device']:.0f}/device)")
            parts.append("mfu " + ("n/a" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%"))
            parts.append(f"mem {r['peak_memory_bytes'] / 2**30:.2f} GiB")
            parts.append(f"data {100 * r['data_wait_share']:.0f}%")
            parts.append(f"{r['step_time_s']:.3f} s/step")
        if "moe_tokens_per_expert_cv" in r:
            parts.append(f"experts cv {r['moe_tokens_per_expert_cv']:.2f} "
                         f"aux {r['moe_aux_loss']:.3f}")
            if r["moe_dropped_fraction"]:
                parts.append(f"dropped {100 * r['moe_dropped_fraction']:.1f}%")
            if "moe_a2a_share" in r:
                parts.append(f"a2a {100 * r['moe_a2a_share']:.0f}%")
        return "  ".join(parts)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None

    def finish(self) -> None:
        self.close()
        finish_all(self.trackers)
        self.trackers = []
