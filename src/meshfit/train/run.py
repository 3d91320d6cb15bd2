"""The run folder's parts of `meshfit train`: metrics (`MetricsWriter`, `Window`),
checkpoints and resume (`Checkpoints`), preemption (`StopOnSignal`), and the two ways a run
ends early (`Preempted`, `Diverged`)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import torch

from meshfit.accelerator import Accelerator
from meshfit.checkpoint import latest, prune
from meshfit.train.config import RunConfig
from meshfit.train.runfolder import append_line, atomic_write_text

__all__ = ["Checkpoints", "Diverged", "MetricsWriter", "Preempted", "Stalled", "StopOnSignal",
           "Window", "collective_deadline", "find_checkpoint"]


class Window:
    """Loss and throughput over the steps since the last logged one. One small all-reduce
    per logged step, not per step: metrics stay off the hot path."""

    def __init__(self, acc: Accelerator, tokens_per_step: int):
        self.acc, self.tokens_per_step = acc, tokens_per_step
        self.loss_sum = torch.zeros((), device=acc.device)
        self.restart()

    def restart(self) -> None:
        self.start, self.steps = time.perf_counter(), 0
        self.loss_sum.zero_()

    def add(self, loss: torch.Tensor) -> None:
        self.loss_sum += loss.detach().float()

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
        mean_loss = self.acc.reduce(self.loss_sum, "mean").item() / (self.steps * accum)
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
    """Training stopped on a signal after a whole optimizer step, with a checkpoint."""

    def __init__(self, signum: int, step: int, folder: Path, out_dir: Path):
        name = signal.Signals(signum).name
        super().__init__(f"stopped by {name} after step {step}; checkpoint {folder}; continue "
                         f"with: meshfit train --out {out_dir} --resume")
        self.signum, self.step, self.folder = signum, step, folder


class StopOnSignal:
    """SIGTERM or SIGINT (a cluster preempting the job, Ctrl-C): the ranks finish the current
    optimizer step, write a checkpoint and stop; a second signal ends the process at once.
    Ranks may get the signal at different moments, so after each step they agree on it (one
    tiny all-reduce of the signal number, MAX). On GPUs that all-reduce runs on the host,
    over a gloo group of the same ranks, so reading its result never waits for the device's
    queued work (a per-step host synchronisation would stall the GPU pipeline)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum = 0
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
        flag = torch.tensor([self.signum], device="cpu" if self.group else acc.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return int(flag.item())

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}


def find_checkpoint(root: Path) -> Path:
    """The newest complete checkpoint under `root`, for --resume (one line if none)."""
    folder = latest(root)
    if folder is None:
        raise ValueError(f"--resume: {root} holds no complete checkpoint; train with "
                         "--checkpoint.every=N to write some")
    return folder


class Checkpoints:
    """The run's checkpoints, ``OUT/checkpoints/step-<N>/`` ([checkpoint] every, keep)."""

    def __init__(self, acc: Accelerator, cfg: RunConfig, root: Path):
        self.acc, self.cfg, self.root = acc, cfg.checkpoint, root
        self.steps = cfg.train.steps

    def due(self, step: int) -> bool:
        return bool(self.cfg.every) and (step % self.cfg.every == 0 or step == self.steps)

    def folder(self, step: int) -> Path:
        return self.root / f"step-{step}"

    def save(self, step: int, *, wait: bool = False) -> Path:
        """Save (in the background with [checkpoint] async, unless `wait`), then prune."""
        background = self.cfg.async_save and not wait
        self.acc.save_state(self.folder(step), step=step, async_save=background)
        if not background:
            self.acc.wait_for_checkpoint()
        self._prune()
        return self.folder(step)

    def _prune(self) -> None:
        if self.acc.is_main_process:
            prune(self.root, self.cfg.keep, writing=self.acc.checkpoint_in_flight)

    def finish(self) -> None:
        """Commit a checkpoint still being written."""
        if self.acc.wait_for_checkpoint() is not None:
            self._prune()

    def resume(self) -> int:
        """Load the newest complete checkpoint; returns its step."""
        folder = find_checkpoint(self.root)
        manifest = self.acc.load_state(folder)
        self.acc.print(f"meshfit train: resuming from {folder} (step {manifest.step} of "
                       f"{self.steps}, saved by {manifest.world_size} process(es))")
        return manifest.step


class MetricsWriter:
    """metrics.jsonl and config.toml in the run folder (main process only). Resuming after
    step N keeps the lines of steps up to N and appends after them. config.toml and the
    resumed metrics.jsonl are replaced atomically; each metrics line is appended whole or not
    at all (a failed append is cut back off), and a failed write is one line
    (`WriteFailed`) naming the file and the reason."""

    def __init__(self, out_dir: Path | None, cfg: RunConfig, *, after_step: int = 0):
        self.path = None
        if out_dir is None:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out_dir / "config.toml", cfg.to_toml())
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

