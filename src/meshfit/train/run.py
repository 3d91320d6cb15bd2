"""What a `meshfit train` run records, and how it ends early: `Window` (loss and throughput since
the last logged step), `MetricsWriter` (OUT/metrics.jsonl and config.toml), `RunReporter` (the
figures beyond loss and throughput: gradient norm, tokens/s per device, MFU, peak memory per rank,
the share of the step spent waiting for data; to the trackers of ``[log] with`` and the terminal: a
progress bar on a terminal, plain lines otherwise, ``nohup``, a batch log file), checkpoints and
resume (`Checkpoints`), preemption (`StopOnSignal`), `Preempted`, `Diverged`, `Stalled`.

MFU (model FLOPs utilisation, PaLM's definition): achieved model FLOP/s over the devices' peak;
model FLOPs per token from the model's shape (``6 N + 12 L d T``,
`meshfit.memory.ModelShape.flops_per_token`: recomputation not counted); the peak from ``[log]
calibration`` (a `meshfit calibrate` file: measured matmul FLOP/s of the training dtype) or the data
sheet of a known GPU (`meshfit.plan.DEVICES`); none on a CPU without a calibration (reported as null
/ "n/a").
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import shlex
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from meshfit.accelerator import Accelerator
from meshfit.checkpoint import CheckpointError, Manifest, latest, prune, skipped
from meshfit.checkpoint.load import saved_keys
from meshfit.distributed import is_initialized
from meshfit.memory import ModelShape
from meshfit.plan.calibrate import load_calibration
from meshfit.plan.devices import device_for_name
from meshfit.tracking import build_trackers, finish_all, flatten_config
from meshfit.train.config import RunConfig
from meshfit.train.configfile import to_toml
from meshfit.train.runfolder import append_line, atomic_write_text


class Window:
    """One small all-reduce per logged step, not per step: metrics stay off the hot path.

    A checkpoint holds the window's losses so far (`hold`, then `state_dict`: the `Accelerator`
    saves it), so that the first line after a resume averages the same steps as the run that
    was never stopped (the steps before the checkpoint come back as `carried`); its
    throughput counts the steps timed since the resume."""

    def __init__(self, acc: Accelerator, tokens_per_step: int):
        self.acc, self.tokens_per_step = acc, tokens_per_step
        # float64: a window's sum comes out the same whether or not a resume split it
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=acc.device)
        self.carried = torch.zeros(2, dtype=torch.float64)
        """[sum of the per-step mean losses, steps] of this window before a resume."""
        self.held = torch.zeros(2, dtype=torch.float64)
        self.restart()

    def restart(self) -> None:
        self.start, self.steps = time.perf_counter(), 0
        self.loss_sum.zero_()
        self.carried.zero_()

    def add(self, loss: torch.Tensor) -> None:
        self.loss_sum += loss.detach().double()

    def _summed(self, accum: int) -> float:
        """The window's per-step mean losses summed (a collective: the mean over ranks)."""
        return self.acc.reduce(self.loss_sum.clone(), "mean").item() / accum + \
            float(self.carried[0])

    def hold(self, accum: int) -> None:
        """Before a checkpoint, on every rank (a collective): what `state_dict` saves."""
        self.held = torch.tensor([self._summed(accum), self.steps + float(self.carried[1])],
                                 dtype=torch.float64)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"carried": self.held.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.carried.copy_(state["carried"])

    def close(self, step: int, accum: int, lr: float) -> dict:
        """The window's metrics line; a new window begins. A loss that is not finite on some
        rank stops the run here, naming the rank."""
        everyone = self.acc.gather(self.loss_sum.detach().reshape(1))  # one per dp rank
        bad = (~torch.isfinite(everyone)).nonzero()
        if len(bad):
            rank = int(bad[0])
            raise Diverged(f"the loss is not finite ({everyone[rank].item()}) by step {step} on "
                           f"data-parallel rank {rank}; lower optim.lr, keep train.grad_clip "
                           "> 0, or train in bf16 rather than fp16")
        mean_loss = self._summed(accum) / (self.steps + int(self.carried[1]))
        elapsed = time.perf_counter() - self.start
        out = {"step": step, "loss": round(mean_loss, 5), "lr": lr,  # (torchao: lr a tensor)
               "tokens_per_s": round(self.steps * self.tokens_per_step / elapsed, 1),
               "step_time_s": round(elapsed / self.steps, 4)}
        self.restart()
        return out


class Diverged(ValueError):
    """The training loss became infinite or NaN (a one-line error for the command)."""


class Stalled(ValueError):
    """A collective waited longer than [train] timeout_s for the other ranks."""


@contextlib.contextmanager
def collective_deadline(rank: int, timeout_s: float, what: str):
    """Turn the process group's timeout inside the block into one line naming this rank,
    what it was doing and torch's own account of the operation (gloo: "Timed out waiting
    300000ms for recv operation to complete"; NCCL's watchdog ends the process itself)."""
    try:
        yield
    except RuntimeError as err:
        text = str(err).strip()
        if "timed out" not in text.lower():
            raise
        detail = text.splitlines()[0].split("] ", 1)[-1][:160]
        doing = what() if callable(what) else what
        raise Stalled(f"rank {rank} waited more than {timeout_s:g} s for the other ranks during "
                      f"{doing} ({detail}); another rank has hung or died (see its log), or the "
                      "work really takes that long: raise train.timeout_s") from None


class Preempted(Exception):
    """Training stopped on a signal after a whole optimizer step, with a checkpoint. The
    line names the signal that came (SIGINT for Ctrl-C) and the command that continues the
    run as if it had not stopped: on the same processes (`resume_command`)."""

    def __init__(self, signum: int, step: int, folder: Path, out_dir: Path,
                 ranks: list[int] | None = None, *, nproc: int = 1, nnodes: int = 1):
        name = signal.Signals(signum).name
        got = "" if not ranks else f" (sent to rank{'s' * (len(ranks) > 1)} " \
            f"{', '.join(map(str, ranks[:8]))}{' ...' if len(ranks) > 8 else ''} only)"
        super().__init__(f"stopped by {name}{got} after step {step}; checkpoint {folder}; "
                         f"continue with: {resume_command(out_dir, nproc, nnodes)}")
        self.signum, self.step, self.folder, self.ranks = signum, step, folder, ranks


def resume_command(out_dir: Path, nproc: int, nnodes: int = 1) -> str:
    """The command that resumes the run in `out_dir` on `nnodes` x `nproc` processes, as it
    ran (a resume on another number of processes accumulates and draws differently)."""
    command = f"meshfit train --out {shlex.quote(str(out_dir))} --resume --nproc {nproc}"
    if nnodes > 1:
        command += (f" --nnodes {nnodes} (on every node, with its --node-rank, --master-addr "
                    "and --master-port)")
    return command


class StopOnSignal:
    """SIGTERM or SIGINT (a cluster preempting the job, Ctrl-C): the ranks finish the current
    optimizer step, write a checkpoint and stop; a second signal ends the process at once.
    Ranks may get the signal at different moments, or one rank alone may get it, so after
    each step they agree on it: one tiny all-reduce (MAX) of each rank's signal number in its
    own slot, so that every rank also knows which ranks got one. On GPUs that all-reduce runs on the host,
    over a gloo group of the same ranks, so reading its result never waits for the device's
    queued work (a per-step host synchronisation would stall the GPU pipeline)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum = 0
        self.ranks: list[int] | None = None
        """After `requested` returned a signal: the ranks that got one, when not all did."""
        self.previous = {}
        self.group = None  # the host-side group on GPUs, made at the first (collective) check
        if threading.current_thread() is threading.main_thread():  # handlers live there
            for sig in self.SIGNALS:
                self.previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.signum:  # the second one: the default action, now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.signum = signum

    def requested(self, acc: Accelerator) -> int:
        if not acc.env.is_distributed:
            return self.signum
        dist = torch.distributed
        if acc.device.type != "cpu" and self.group is None:
            self.group = dist.new_group(backend="gloo")  # every rank checks at the same step
        flags = torch.zeros(acc.env.world_size, dtype=torch.int32,
                            device="cpu" if self.group else acc.device)
        flags[acc.env.rank] = self.signum
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        flags = flags.tolist()
        got = [rank for rank, signum in enumerate(flags) if signum]
        self.ranks = got if len(got) < len(flags) else None
        return max(flags)

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}


def find_checkpoint(root: Path) -> Path:
    """The newest complete checkpoint under `root`, for --resume (one line if none)."""
    folder = latest(root)
    if folder is None:
        passed = "; ".join(f"{path.name}: {why}" for path, why in skipped(root))
        raise ValueError(f"--resume: {root} holds no complete checkpoint"
                         + (f" (skipped {passed})" if passed else "")
                         + "; train with --checkpoint.every=N to write some")
    return folder


def saved_world(out: Path) -> int | None:
    """The number of processes that saved the newest complete checkpoint of the run in `out`
    (None: it has none)."""
    folder = latest(out / "checkpoints")
    return None if folder is None else Manifest.read(folder).world_size


def resume_point(out: Path, steps: int) -> tuple[int, str]:
    """(step of the newest complete checkpoint, what to say) for ``--resume`` of the run in
    `out` with ``train.steps`` = `steps`: continuing; finished (step == steps: the run's last
    logged figures); refused in one line when the checkpoint is past `steps`."""
    folder = find_checkpoint(out / "checkpoints")
    step = int(folder.name.removeprefix("step-"))
    passed = [f"{path.name} ({why})" for path, why in skipped(out / "checkpoints")
              if int(path.name.removeprefix("step-")) > step]
    note = f"; skipped the newer {', '.join(passed)}" if passed else ""
    if step > steps:
        raise ValueError(f"--train.steps={steps} is behind the run's newest checkpoint "
                         f"({folder.name}); give train.steps > {step} to train further")
    if step < steps:
        return step, f"resuming from {folder.name} to step {steps}{note}"
    last: dict = {}
    metrics = out / "metrics.jsonl"
    for line in metrics.read_text().splitlines() if metrics.is_file() else ():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        for key in ("loss", "val_loss"):
            if isinstance(record, dict) and record.get(key) is not None:
                last[key] = (record.get("step"), record[key])
    figures = ", ".join(f"{k} {v} (step {s})" for k, (s, v) in last.items()) or "none logged"
    return step, (f"{out} is finished: {folder.name} is its last step (train.steps={steps}); "
                  f"last figures: {figures}. To train further: --resume --train.steps=N "
                  f"with N > {steps}{note}")


WINDOW_KEY = "custom_0.carried"
"""The loss window in a checkpoint (the first object registered for checkpointing)."""


class Checkpoints:
    """The run's checkpoints, ``OUT/checkpoints/step-<N>/`` ([checkpoint] every, keep)."""

    def __init__(self, acc: Accelerator, cfg: RunConfig, root: Path, window: Window, accum: int):
        self.acc, self.cfg, self.root = acc, cfg.checkpoint, root
        self.steps = cfg.train.steps
        self.window, self.accum = window, accum
        self.holds_window = False

    def _hold_window(self) -> None:
        """Checkpoints hold the loss window from now on (`Window`)."""
        if not self.holds_window:
            self.acc.register_for_checkpointing(self.window)
            self.holds_window = True

    def due(self, step: int) -> bool:
        return bool(self.cfg.every) and (step % self.cfg.every == 0 or step == self.steps)

    def folder(self, step: int) -> Path:
        return self.root / f"step-{step}"

    def save(self, step: int, *, wait: bool = False) -> Path:
        """Save (in the background with [checkpoint] async, unless `wait`), then prune."""
        background = self.cfg.async_mode if self.cfg.async_save and not wait else False
        self._settle()
        self._hold_window()
        self.window.hold(self.accum)
        self.acc.save_state(self.folder(step), step=step, async_save=background)
        if not background:
            self.acc.wait_for_checkpoint()
        self._prune()
        return self.folder(step)

    def _prune(self) -> None:
        if self.acc.is_main_process:
            prune(self.root, self.cfg.keep, writing=self.acc.checkpoint_in_flight)

    def _settle(self, *, close: bool = False) -> bool:
        """Commit the checkpoint being written in the background (`close`: then end a writer
        process); one whose writing failed is reported in one line and dropped (the state is
        still in memory: the next save writes it). False: it failed."""
        try:
            if self.acc.wait_for_checkpoint(close=close) is not None:
                self._prune()
        except CheckpointError as err:
            self.acc.print(f"meshfit train: {err}; the next checkpoint is written from memory")
            return False
        return True

    def finish(self) -> bool:
        """Commit a checkpoint still being written (and end a writer process); False: its
        writing failed (reported)."""
        return self._settle(close=True)

    def resume(self) -> int:
        """Load the newest complete checkpoint; returns its step."""
        folder = find_checkpoint(self.root)
        if WINDOW_KEY in saved_keys(folder):
            self._hold_window()
        else:  # saved before checkpoints held it
            self.acc.print(f"meshfit train: {folder.name} holds no loss window (saved by an "
                           "older meshfit): the first logged loss averages the steps since "
                           "the resume only")
        manifest = self.acc.load_state(folder)
        self._hold_window()
        self.acc.print(f"meshfit train: resuming from {folder} (step {manifest.step} of "
                       f"{self.steps}, saved by {manifest.world_size} process(es))")
        return manifest.step


class MetricsWriter:
    """Main process only. Resuming after step N keeps the lines of steps up to N and appends
    after them. config.toml and the resumed metrics.jsonl are replaced atomically; each
    metrics line is appended whole or not at all (a failed append is cut back off), and a
    failed write is one line (`WriteFailed`) naming the file and the reason."""

    def __init__(self, out_dir: Path | None, cfg: RunConfig, *, after_step: int = 0):
        self.path = None
        if out_dir is None:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out_dir / "config.toml", to_toml(cfg))
        self.path = out_dir / "metrics.jsonl"
        kept = []
        if after_step and self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    if json.loads(line).get("step", 0) <= after_step:
                        kept.append(line + "\n")
                except json.JSONDecodeError:
                    continue  # a line cut short by the interruption
        atomic_write_text(self.path, "".join(kept))

    def write(self, record: dict) -> None:
        if self.path is not None:
            line = json.dumps({**record, "time": round(time.time(), 3)}) + "\n"
            append_line(self.path, line.encode("utf-8"))


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
    figure counts TF32 tensor cores only when `tf32` is on. A calibration figure flagged as
    noise (`meshfit.plan.trust`: the file's machine too noisy, or the figure itself) gives
    no peak: an MFU against it would be a guess."""
    dtype = mixed_precision if mixed_precision in ("bf16", "fp16") else "fp32"
    if calibration:
        found = load_calibration(calibration)
        flops = found.matmul_flops.get(dtype) if found.trusted(f"matmul_flops.{dtype}") else None
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


class RunReporter:
    """The main process's outputs of a run (every rank calls `step_figures`: it gathers)."""

    def __init__(self, acc, cfg, out_dir: Path | None, model: torch.nn.Module,
                 total_steps: int) -> None:
        self.acc, self.total, self.world = acc, total_steps, acc.num_processes
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
            self.bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[info]}"), TimeRemainingColumn())
            self.task = self.bar.add_task("train", total=total_steps, info="")
            self.bar.start()

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
        if is_initialized() and dist.get_world_size() > 1:
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
