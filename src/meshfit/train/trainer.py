"""`meshfit train`'s training loop, read top to bottom, on `Accelerator` (the same
prepare/accumulate/backward calls a user's own loop makes): `TrainingRun` sets a run up and
takes its optimizer steps; `train` builds one, then `_steps` runs it, and after each step
logs, evaluates, checkpoints and answers a stop signal when due. What a step trains (the
model, or this rank's pipeline stages) is behind one interface: `meshfit.train.steps`.
"""
from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from meshfit import optim
from meshfit._compat import optim as lr_internals
from meshfit.accelerator import Accelerator
from meshfit.accelerator.compat import DataLoaderConfiguration
from meshfit.checkpoint import latest
from meshfit.distributed import DistEnv, init
from meshfit.distributed.settle import barrier
from meshfit.models.loss import IGNORE_INDEX
from meshfit.parallel.ep import moe_modules, routing_metrics
from meshfit.train import tokens
from meshfit.train.batch_size import find_executable_batch_size, is_out_of_memory
from meshfit.train.config import RunConfig
from meshfit.train.models import build_model, plans, resolve_plan, write_final_model
from meshfit.train.run import (Checkpoints, MetricsWriter, Preempted, RunReporter, StopOnSignal,
                               Window, collective_deadline, find_checkpoint)
from meshfit.train.steps import PIPELINE_TIMED_STEPS, ModelSteps, prepare_steps
from meshfit.train.validation import ValidationBatches, evaluate


def train(cfg: RunConfig, out_dir: Path, env: DistEnv | None = None, *,
          resume: bool = False) -> dict:
    """Train the model of [model] as `cfg` says, then write its weights to ``out_dir/model``
    (or the LoRA adapter to ``out_dir/adapter``); returns the last metrics. Call on every rank.
    `resume`: continue from the newest complete checkpoint in ``out_dir/checkpoints``."""
    t = cfg.train
    env = env or init(timeout_s=t.timeout_s)
    resume = _resumes(env, out_dir / "checkpoints", resume)  # fails fast, before any build
    run = TrainingRun(cfg, env)
    acc, splits = run.accelerator, run.splits
    rows = run.micro_batch_size * run.chunks  # sequences per data-parallel rank and batch
    # (the set: cfg.eval_windows() windows whatever the micro-batch; `rows` batches them)
    val_loader = ValidationBatches(
        splits.windows("val", t.seq_len, documents_apart=cfg.data.document_mask),
        cfg.eval_windows(), rows, acc.runtime.dp_size, acc.runtime.dp_rank)
    acc.print(_banner(acc, run.model, run.trained, run.micro_batch_size, splits.train_tokens,
                      out_dir))
    if hasattr(splits, "describe"):  # examples with loss masks
        acc.print(f"meshfit train: {splits.describe()}")
    window = Window(acc, t.global_batch_size * t.seq_len)
    checkpoints = Checkpoints(acc, cfg, out_dir / "checkpoints", window, run.accum)
    start = checkpoints.resume() if resume else 0
    if start:
        _follow_schedule(run.schedule, lr_lambda(cfg))
    main_out = out_dir if acc.is_main_process else None
    loop = _Loop(run=run, val_loader=val_loader, out_dir=out_dir, checkpoints=checkpoints,
                 writer=MetricsWriter(main_out, cfg, after_step=start),
                 progress=RunReporter(acc, cfg, main_out, run.model, t.steps), window=window)
    last = _steps(loop, start)
    _finish(run, out_dir, last)
    return last


def _finish(run: TrainingRun, out_dir: Path, last: dict) -> None:
    """The trained weights written (`write_final_model`) and the run's resources freed."""
    acc, cfg, splits = run.accelerator, run.cfg, run.splits
    with collective_deadline(acc.process_index, cfg.train.timeout_s, "writing the final model"):
        written = write_final_model(acc, run.trained.exported, run.model, cfg, splits.tokenizer,
                                    out_dir, splits.vocab_size)
    for folder in written:
        acc.print(f"meshfit train: wrote {folder}")
    acc.print(f"done: loss {last.get('loss')}, val_loss {last.get('val_loss')}")
    acc.wait_for_everyone()
    # The files the run made (offload="disk": the state's folder) removed. Not
    # `free_memory`: its garbage collection cannot free the run, which its caller still
    # holds, and took 0.3 s of every rank's end in a process that imported transformers.
    acc.wait_for_checkpoint()
    acc.runtime.release()


# ------------------------------------------------------------------------------ the run
@dataclass(frozen=True)
class StepResult:
    """One optimizer step on this rank, as `TrainingRun.step` took it."""

    losses: list[torch.Tensor]
    """Each micro-batch's loss (detached, on the device), in the order they ran."""
    grad_norm: float | None
    """The gradient norm before clipping, where asked for (measured even without clipping)."""

    @property
    def loss(self) -> torch.Tensor:
        """This rank's mean over the step's micro-batches, in float64 (a 0-d tensor on the
        device; ``accelerator.reduce(loss, "mean")`` averages it over the ranks, tensor- and
        pipeline-parallel ranks holding the same value)."""
        return torch.stack([loss.double() for loss in self.losses]).mean()


class TrainingRun:
    """A `meshfit train` run set up and ready to take optimizer steps, as `train` trains it:
    the token splits of [data] (rank 0 builds the cache first); the model of [model] (with
    [peft]'s adapters) from ``train.seed``; the `Accelerator` of [train] and [parallel]; the
    model prepared, or this rank's pipeline stages (`meshfit.train.steps`); under
    ``train.find_batch_size`` the largest micro-batch that fits; the optimizer of [optim]
    with its warm-up and cosine schedule; the training batches, shuffled from the seed.
    `step()` takes one optimizer step. Call on every rank.

        run = TrainingRun(cfg, meshfit.distributed.init())
        for _ in range(3):
            loss = run.accelerator.reduce(run.step().loss, "mean")

    `model_hook(model) -> model` changes the built model before it is laid out (`meshfit
    verify`: dropout off, the weights in float64). Attributes: `cfg`, `env`, `splits`, `model`
    (as built; a layout trains it through `trained`), `accelerator`, `trained` (what a step
    trains), `optimizer` and `scheduler` (prepared; `schedule` is the LambdaLR they step),
    `micro_batch_size`, `chunks` (micro-batches per pipeline batch), `accum` (micro-batches
    per optimizer step on each rank), `exchanges` (expert-parallel exchanges, timed for the
    routing metrics) and `data_wait_s` (seconds spent waiting for batches, which `train`
    resets at each logged step)."""

    def __init__(self, cfg: RunConfig, env: DistEnv, *,
                 model_hook: Callable[[torch.nn.Module], torch.nn.Module] | None = None):
        t = cfg.train
        self.cfg, self.env = cfg, env
        with _rank_zero_first(env):  # rank 0 builds the token cache, the others reuse it
            self.splits = tokens.load_tokens(cfg)
        torch.manual_seed(t.seed)
        model = build_model(cfg, self.splits.vocab_size)
        self.model = model = model_hook(model) if model_hook is not None else model
        acc = self.accelerator = build_accelerator(
            cfg, env, tp_plan=resolve_plan(plans(cfg)[0], model))
        # Parallelise first, then build the optimizer over the prepared parameters (torchtitan's
        # order: a fused optimizer checks the parameters' device when it is built; under ZeRO-2/3
        # they are then the sharded DTensors, and under ZeRO-1 prepare(optimizer) partitions it).
        self.chunks = cfg.microbatches(env.world_size)
        self.trained = trained = prepare_steps(acc, cfg, model, self.chunks)
        # Expert-parallel exchanges, timed from now: always on the CPU (gloo waits anyway), on
        # CUDA for the first steps (see `_steps`).
        self.exchanges = [m.ep for m in moe_modules(trained.modules) if m.ep is not None]
        for ep in self.exchanges:
            ep.timing = True
        micro = t.micro_batch_size
        if t.find_batch_size:  # (the layout refused it where forward communicates: not with pp)
            micro, _ = _find_micro_batch(acc, trained, t.seq_len, self.splits.vocab_size, micro,
                                         acc.gradient_accumulation_steps)
        self.micro_batch_size = micro
        optimizer = build_optimizer(trained.params, cfg)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
        rows = micro * self.chunks
        loader = _train_loader(cfg, self.splits, rows, acc.device)
        self.optimizer, loader, self.scheduler = acc.prepare(optimizer, loader, self.schedule)
        self.accum = acc.gradient_accumulation_steps
        self.masked = cfg.data.masked  # targets may be ignored: each token weighs the same
        self.data_wait_s = 0.0
        self._batches = _batches(loader, _loader_name(loader, t.seq_len, rows,
                                                      acc.runtime.dp_size))

    def step(self, *, grad_norm: bool = False) -> StepResult:
        """One optimizer step: forward and backward over its micro-batches, the gradients
        clipped (``train.grad_clip``), the optimizer and the schedule stepped. `grad_norm`:
        measure the gradient norm (also without clipping)."""
        t, acc, trained = self.cfg.train, self.accelerator, self.trained
        norm_seen = None
        batches = self._next_batches()
        weights = _token_weights(acc, batches, self.accum) if self.masked else \
            [None] * self.accum
        losses = []
        for (x, y, *packed), weight in zip(batches, weights):
            with trained.accumulate():
                loss = trained.forward_backward(x, y, self.accum, weight=weight,
                                                positions=packed[0] if packed else None)
                if acc.sync_gradients and (t.grad_clip > 0 or grad_norm):
                    norm = trained.clip(t.grad_clip if t.grad_clip > 0 else math.inf)
                    norm_seen = float(norm) if grad_norm else None
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad()
            losses.append(loss.detach())
        return StepResult(losses=losses, grad_norm=norm_seen)

    def _next_batches(self) -> list:
        """The step's micro-batches, the time spent waiting for them added to `data_wait_s`."""
        began = time.perf_counter()
        batches = [next(self._batches) for _ in range(self.accum)]
        self.data_wait_s += time.perf_counter() - began
        return batches

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict under the model's own names on the main process ({}
        elsewhere): `Accelerator.get_state_dict` of what the run trains (FSDP and
        tensor-parallel shards gathered, pipeline stages joined). A collective."""
        return self.accelerator.get_state_dict(self.trained.exported)


# ------------------------------------------------------------------------------ the loop
@dataclass(frozen=True, kw_only=True)
class _Loop:
    """What the loop's steps share, built once by `train`."""

    run: TrainingRun
    val_loader: object
    out_dir: Path
    checkpoints: Checkpoints
    writer: MetricsWriter
    progress: RunReporter
    window: Window

    acc = property(lambda self: self.run.accelerator)
    cfg = property(lambda self: self.run.cfg)
    trained = property(lambda self: self.run.trained)


def _steps(loop: _Loop, start: int) -> dict:
    """Optimizer steps start + 1 .. train.steps (an evaluation first on a new run); returns
    the last metrics. A stop signal ends the run with a checkpoint (`Preempted`)."""
    t, acc = loop.cfg.train, loop.acc
    last = {"step": start}
    if start == 0:
        last = _validation(loop, start)
    loop.window.start = time.perf_counter()  # the first window's time begins after that
    stop = StopOnSignal()
    step = start + 1  # the step in progress, for a timeout's message
    with collective_deadline(acc.process_index, t.timeout_s, lambda: f"step {step}"):
        for step in range(start + 1, t.steps + 1):
            logged = step % t.log_every == 0 or step == t.steps
            taken = loop.run.step(grad_norm=logged)
            for loss in taken.losses:
                loop.window.add(loss)
            loop.window.steps += 1
            loop.trained.after_step(step, loop.out_dir)
            if step == PIPELINE_TIMED_STEPS and acc.device.type == "cuda":
                for ep in loop.run.exchanges:  # timing synchronises the device around each one
                    ep.timing = False
            if logged:
                last = _log(loop, step, taken.grad_norm)
            if (t.eval_every and step % t.eval_every == 0) or step == t.steps:
                last.update(_untimed(loop, lambda: _validation(loop, step)))
            if loop.checkpoints.due(step):
                _untimed(loop, lambda: loop.checkpoints.save(step))
            _stop_if_asked(loop, stop, step)
    stop.restore()
    loop.checkpoints.finish()
    loop.progress.finish()
    return last


def _token_weights(acc: Accelerator, batches: list, accum: int) -> list[float]:
    """With ignored targets (prompts, padding), the step's loss is the mean over every
    trained token of the global batch, not the mean of micro-batch means (which would weigh
    a token by how full its micro-batch is, and so depend on the layout): micro-batch i of
    n_i tokens gets weight n_i x micro-batches / N, N the trained tokens of the global batch
    (summed over the data-parallel ranks), since backward averages over micro-batches and
    ranks. A micro-batch with no trained token weighs 0."""
    counts = torch.tensor([float((b[1] != IGNORE_INDEX).sum()) for b in batches],
                          dtype=torch.float64, device=acc.device)
    total = float(acc.reduce(counts.sum(), "sum"))
    if total == 0:
        raise ValueError("a global batch holds no trained token (every target is a prompt "
                         "or padding); check data.format and the masks, or raise "
                         "train.seq_len")
    return [float(n) * accum * acc.runtime.dp_size / total for n in counts.tolist()]


def _log(loop: _Loop, step: int, grad_norm: float | None) -> dict:
    """The window's metrics line (loss, throughput, per-step figures, MoE routing), written
    and shown; a new window begins."""
    run = loop.run
    window_s = time.perf_counter() - loop.window.start
    last = loop.window.close(step, run.accum, float(run.scheduler.get_last_lr()[0]))
    last = loop.progress.step_figures(last, grad_norm=grad_norm, wait_s=run.data_wait_s,
                                      window_s=window_s)
    run.data_wait_s = 0.0
    last.update(_routing(loop.acc, loop.trained, window_s))
    loop.writer.write(last)
    loop.progress.report(last, step)
    return last


def _validation(loop: _Loop, step: int) -> dict:
    """The validation loss after `step`, written and shown."""
    with _exchanges_untimed(loop.run.exchanges):
        val = {"step": step, "val_loss": round(evaluate(loop.acc, loop.trained,
                                                        loop.val_loader), 5)}
    loop.writer.write(val)
    loop.progress.report(val, step)
    return val


def _untimed(loop: _Loop, work):
    """`work()`, its time left out of the window's training throughput."""
    began = time.perf_counter()
    out = work()
    loop.window.start += time.perf_counter() - began
    return out


def _stop_if_asked(loop: _Loop, stop: StopOnSignal, step: int) -> None:
    """A stop signal on any rank (every rank got here after the same step): the run ends
    with a checkpoint of this step."""
    signum = stop.requested(loop.acc)
    if not signum:
        return
    loop.progress.finish()
    checkpoints = loop.checkpoints
    written = checkpoints.finish()
    folder = checkpoints.folder(step) if checkpoints.due(step) and written else \
        checkpoints.save(step, wait=True)
    if stop.ranks is not None:  # (the same on every rank) A signal the launcher sent to all
        stop.requested(loop.acc)  # reaches them a moment apart: who got one, counted again
    stop.restore()
    env = loop.run.env
    raise Preempted(signum, step, folder, loop.out_dir, stop.ranks, nproc=env.local_world_size,
                    nnodes=max(1, env.world_size // env.local_world_size))


# ------------------------------------------------------------------------------ the set-up
def _resumes(env: DistEnv, root: Path, resume: bool) -> bool:
    """Whether the run goes on from its newest complete checkpoint under `root`: asked
    (--resume; a missing one fails here, before anything is built), or restarted by the
    launcher after a worker failed (--max-restarts) with one to go on from."""
    if resume:
        find_checkpoint(root)
        return True
    if env.restart and latest(root) is not None:
        if env.rank == 0:
            print(f"meshfit train: restart {env.restart} of the workers")
        return True
    return False


@contextlib.contextmanager
def _rank_zero_first(env: DistEnv):
    """Rank 0 runs the block first (it builds the token cache), then the others, as
    `Accelerator.main_process_first` does: the Accelerator is built later, once the model
    exists, with the model's tensor-parallel plan."""
    if env.is_distributed and env.rank != 0:
        barrier()
    yield
    if env.is_distributed and env.rank == 0:
        barrier()


def build_accelerator(cfg: RunConfig, env: DistEnv, tp_plan=None) -> Accelerator:
    """The `Accelerator` of a run: [train]'s single-device options, [parallel]'s layout,
    the model's tensor-parallel plan (None: the model's built-in one)."""
    t, p = cfg.train, cfg.parallel
    return Accelerator(
        # meshfit's own semantics where Accelerate's defaults differ: the schedule counts
        # optimizer steps; each epoch shuffles from train.seed + epoch; --resume puts the
        # loaders back where they stood.
        step_scheduler_per_process=False,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=t.seed,
                                                  use_stateful_dataloader=True),
        gradient_accumulation_steps=cfg.grad_accumulation(env.world_size),
        mixed_precision=t.mixed_precision, tf32=t.tf32, empty_cache_steps=t.empty_cache_steps,
        # [train]'s ModelOptions, the model's plan, [parallel]'s context-parallel split
        **{**t.keywords(), "tp_plan": tp_plan, "cp_load_balance": p.cp_load_balance},
        parallel=p, offload_dir=p.offload_dir or None, env=env)  # [parallel]: the request


def build_optimizer(model: torch.nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    """The [optim] section through `meshfit.optim.build`: weight decay on matrices only (not
    on biases and normalisation weights), only trainable parameters (LoRA: the adapters)."""
    o = cfg.optim
    return optim.build(o.optimizer, model, lr=o.lr, weight_decay=o.weight_decay, betas=o.betas,
                       eps=o.eps, momentum=o.momentum, **o.muon_kwargs())


def _follow_schedule(schedule, factor) -> None:
    """After a resume: the learning rate of this config's schedule at the resumed step (the
    checkpoint holds the rate its own schedule set; with a larger ``train.steps`` the cosine
    is redrawn over the new total, and training follows the new curve from here). The same
    product LambdaLR computes, so an unchanged schedule resumes bit for bit."""
    step = schedule.last_epoch
    for group, base in zip(schedule.optimizer.param_groups, schedule.base_lrs):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(base * factor(step))
        else:
            group["lr"] = base * factor(step)
    lr_internals.set_last_lr(schedule, [g["lr"] for g in schedule.optimizer.param_groups])


def lr_lambda(cfg: RunConfig):
    """Linear warm-up, then cosine decay to lr * min_lr_ratio over train.steps."""
    t = cfg.train

    def factor(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        progress = min(1.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def _find_micro_batch(acc: Accelerator, trained: ModelSteps, seq_len: int, vocab: int,
                      micro: int, accum: int) -> tuple[int, int]:
    """The largest micro-batch (halving from `micro`) whose forward and backward fit on every
    rank, with the accumulation that keeps the global batch. Ranks agree through one MIN
    all-reduce per attempt, so an out-of-memory error on one rank cannot strand the others in
    a collective; gradients are not synchronised while probing (no_sync)."""
    model = trained.model

    @find_executable_batch_size(starting_batch_size=micro, effective_batch_size=micro * accum)
    def probe(micro_batch_size: int, gradient_accumulation_steps: int):
        fits = torch.ones((), device=acc.device)
        try:
            x = torch.randint(0, vocab, (micro_batch_size, seq_len), device=acc.device)
            with acc.no_sync(model):
                acc.backward(trained.loss(model, x, x))
        except Exception as err:  # noqa: BLE001 - only out-of-memory is tolerated
            if not is_out_of_memory(err):
                raise
            fits.zero_()
        finally:
            model.zero_grad(set_to_none=True)
        if acc.reduce(fits, "min").item() < 1:
            raise torch.OutOfMemoryError(f"micro-batch {micro_batch_size} does not fit")
        return micro_batch_size, gradient_accumulation_steps

    micro, accum = probe()
    acc.gradient_accumulation_steps = accum
    return micro, accum


def _train_loader(cfg: RunConfig, splits, rows: int, device: torch.device) -> DataLoader:
    """Training batches of `rows` sequences per data-parallel rank, shuffled from the run's
    seed (`Accelerator.prepare` shards them)."""
    t, d = cfg.train, cfg.data
    workers = dict(num_workers=d.num_workers, pin_memory=d.pin_memory and device.type == "cuda")
    if d.num_workers:
        workers.update(prefetch_factor=d.prefetch_factor, persistent_workers=d.persistent_workers)
    return DataLoader(splits.windows("train", t.seq_len, documents_apart=d.document_mask),
                      batch_size=rows, shuffle=True,
                      generator=torch.Generator().manual_seed(t.seed), drop_last=True, **workers)


def _loader_name(loader, seq_len: int, rows: int, dp: int) -> str:
    """The training loader as an error names it."""
    return (f"the training loader ({len(loader.dataset)} windows of train.seq_len="
            f"{seq_len} tokens, batches of {rows} per rank on {dp} data-parallel rank(s))")


def _batches(loader, what: str = "the training loader"):
    """An endless stream of batches, epoch after epoch (each with its own shuffling). Raises a
    one-line ValueError naming `what` when two passes in a row yield no batch (the first pass after
    resuming at an epoch's end may be empty; two cannot be), instead of looping forever."""
    empty = 0
    while True:
        got = False
        for batch in loader:
            got, empty = True, 0
            yield batch
        empty = 0 if got else empty + 1
        if empty >= 2:
            raise ValueError(f"{what} yields no batch: an epoch holds fewer windows than one "
                             "batch per data-parallel rank; lower train.micro_batch_size or "
                             "train.seq_len, or give more data")


def _banner(acc: Accelerator, model: torch.nn.Module, trained, micro: int, tokens: int,
            out_dir: Path) -> str:
    n_params = sum(p.numel() for p in model.parameters())
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    trainable = "" if n_trainable == n_params else f" ({n_trainable / 1e6:.3f}M trainable)"
    peft = sys.modules.get("meshfit.peft")
    if peft is not None and (peft.quantize_after_load(model) or any(
            peft.is_quantized(p) for p in model.parameters())):
        n_4bit = sum(m.weight.numel() for m in peft.quantized_linears(model).values())
        trainable = f"{trainable[:-1]}, {n_4bit / 1e6:.2f}M in 4 bits)"
    layout = f", zero_stage {acc.zero_stage}" if acc.zero_stage else ""
    dims = acc.parallel
    mesh = " x ".join(f"{n} {getattr(dims, n)}" for n in dims.enabled())
    layout += f", mesh {mesh}" if mesh and mesh != f"dp_replicate {dims.dp_replicate}" else ""
    if acc.offload_dir is not None:
        what = "parameters and optimizer state" if acc.layout.request.offload_params \
            else "optimizer state"
        layout += f", {what} on disk in {acc.offload_dir}"
    return (f"meshfit train: {n_params / 1e6:.2f}M parameters{trainable}, {acc.num_processes} "
            f"process(es) on {acc.device}{layout}{trained.description}, micro-batch {micro}, "
            f"accumulation {acc.gradient_accumulation_steps}, {_token_count(tokens)} training "
            f"tokens -> {out_dir}")


def _token_count(n: int) -> str:
    """A count as the banner shows it: exact below a million (a chat data set's few thousand
    tokens are not "0.0M"), in millions above."""
    return f"{n:,}" if n < 10**6 else f"{n / 1e6:.1f}M"


# ------------------------------------------------------------------------------ the figures
@contextlib.contextmanager
def _exchanges_untimed(exchanges):
    """Expert-parallel exchanges of an evaluation are not the training window's."""
    saved = [ep.timing for ep in exchanges]
    for ep in exchanges:
        ep.timing = False
    try:
        yield
    finally:
        for ep, timing in zip(exchanges, saved):
            ep.timing = timing


def _routing(acc: Accelerator, trained, elapsed_s: float) -> dict:
    """The MoE metrics of the logged step (`meshfit.parallel.ep.routing_metrics`: the last
    micro-batch's routing) and the share of the window spent in expert-parallel
    all-to-alls; {} for a dense model. A collective: every rank calls it."""
    if not trained.has_moe:
        return {}
    pp = acc.layout.axis_mesh(acc.mesh, "pp")
    # the ranks holding distinct tokens: data parallel, and under cp each sequence's parts
    group = acc.runtime.reduce_group
    out = routing_metrics(moe_modules(trained.modules), dp_group=group,
                          dp_size=1 if group is None else dist.get_world_size(group),
                          pp_group=None if pp is None else pp.get_group())
    if out and any(m.ep is not None and m.ep.timing for m in moe_modules(trained.modules)):
        out["moe_a2a_share"] = round(min(1.0, out["moe_a2a_s"] / max(elapsed_s, 1e-9)), 4)
    return out
