"""`meshfit train`: the config-driven training loop, read top to bottom.

Built on `Accelerator`: the same prepare/accumulate/backward calls a user's own loop makes.
Rank 0 writes ``metrics.jsonl`` (one JSON object per logged step, evaluation lines carry
``val_loss``) and the resolved ``config.toml`` in the run folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Subset

from meshfit.accelerator import Accelerator
from meshfit.train.config import RunConfig
from meshfit.train.run import (Checkpoints, MetricsWriter, Preempted, StopOnSignal, Window,
                               collective_deadline)
from meshfit.data import TokenDataset
from meshfit.distributed import DistEnv, init
from meshfit.parallel.ep import moe_modules
from meshfit.train.observe import RunReporter, timed_batches
from meshfit.train.models import (build_model, loss_function, plans, resolve_plan,
                                  write_final_model)


def build_optimizer(model: torch.nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    """The [optim] section through `meshfit.optim.build`: weight decay on matrices only (not
    on biases and normalisation weights), only trainable parameters (LoRA: the adapters)."""
    from meshfit import optim

    o = cfg.optim
    return optim.build(o.optimizer, model, lr=o.lr, weight_decay=o.weight_decay, betas=o.betas,
                       eps=o.eps, momentum=o.momentum)


def preflight(cfg: RunConfig, world_size: int | None = None,
              local_world_size: int | None = None) -> list[str]:
    """Checks that need this machine (the device the workers will use, installed libraries),
    run before any process is launched; raises a one-line ValueError, returns warnings
    (with `world_size`, also the layout's: `meshfit.parallel.layout.Layout.warnings`)."""
    from meshfit import distributed as mdist
    from meshfit.accelerator.precision import Precision
    from meshfit.models.gpt import check_attention_backend
    from meshfit.train.batch_size import shape_advice
    from meshfit.train.models import check_model_source

    cuda = torch.cuda.is_available() and not mdist.cpu_requested(None)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    precision = Precision(cfg.train.mixed_precision, device)
    # The model's vocabulary is the tokenizer's for the reference GPT (the gpt2 preset's
    # 50257 becomes 256 on bytes); other models must hold the tokenizer's ids.
    vocab_size = cfg.vocab_size()
    model = _checked_model(cfg, vocab_size, check_model_source)
    shape = None
    if cfg.model.source == "preset":
        model_cfg = cfg.model_config()
        try:
            check_attention_backend(cfg.model.attention_backend, device,
                                    precision.dtype or torch.float32, head_dim=model_cfg.head_dim)
        except ValueError as err:
            raise ValueError(f"model.{err}") from None
        shape = (model_cfg.d_model, model_cfg.d_ff, model_cfg.vocab_size)
    else:
        c = getattr(model, "config", None)
        width = getattr(c, "hidden_size", None) or getattr(c, "n_embd", None)
        ff = getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None)
        if width and ff:
            shape = (width, ff, getattr(c, "vocab_size", vocab_size))
    if cfg.optim.optimizer == "adamw_8bit":
        from meshfit import optim

        optim.build("adamw_8bit", [torch.nn.Parameter(torch.zeros(1, device=device))], lr=1e-3)
    warnings = list(cfg.layout(world_size, local_world_size).warnings) if world_size else []
    if world_size:
        check_data(cfg, world_size)
    if (precision.dtype is None and not cfg.train.tf32) or shape is None:
        return warnings
    return warnings + shape_advice(device=device, micro_batch_size=cfg.train.micro_batch_size,
                                   d_model=shape[0], d_ff=shape[1], vocab_size=shape[2])


def _checked_model(cfg: RunConfig, vocab_size: int, check):
    """`check(cfg, vocab_size)` (the model built on the meta device), with what a user's
    model source raises while being read or built (an unreadable or malformed config.json,
    a factory that is not a function, a library's multi-line message) as one line naming the
    [model] key."""
    source = cfg.model.source
    if source == "preset":
        return check(cfg, vocab_size)
    field = f"model.{source}={getattr(cfg.model, source)!r}"
    try:
        return check(cfg, vocab_size)
    except ValueError as err:
        text = " ".join(str(err).split())
        if text == str(err):
            raise
        raise ValueError(text if text.startswith("model.") else f"{field}: {text}") from None
    except (OSError, TypeError, KeyError, AttributeError) as err:
        text = " ".join(str(err).split()) or type(err).__name__
        raise ValueError(f"{field}: the model cannot be built ({type(err).__name__}: {text}); "
                         "check that source") from None


def _data_source(cfg: RunConfig) -> str:
    """The [data] key that names the run's text, as an error message spells it."""
    d = cfg.data
    if d.hf_dataset:
        return f"data.hf_dataset={d.hf_dataset!r}"
    if d.path:
        return f"data.path={d.path!r}"
    return "the built-in corpus (data.path unset)"


def check_data(cfg: RunConfig, world_size: int) -> None:
    """Before launch: the run's token splits can be read (the cache is built here if missing,
    and the workers reuse it) and hold one global batch of training windows and the
    validation windows the evaluation needs; one-line ValueError otherwise. A training split
    smaller than one batch per data-parallel rank would give every epoch zero batches."""
    from meshfit.data import DEFAULT_VAL_FRACTION

    t = cfg.train
    source = _data_source(cfg)
    try:
        splits = cfg.load_tokens()
    except OSError as err:
        where = err.filename or source
        cache = cfg.data.cache_dir or "~/.cache/meshfit/tokens"
        field = (f"data.cache_dir={cache!r}" if str(where).startswith(
            str(Path(cache).expanduser())) else source)
        raise ValueError(f"{field}: cannot use {where} ({err.strerror or err}); make it "
                         "readable (and the cache folder writable) or point the setting "
                         "elsewhere") from None
    dims = cfg.parallel.dims().resolve(world_size)
    chunks = cfg.microbatches(world_size)
    rows = t.micro_batch_size * chunks  # sequences per loader batch on one rank
    accum = cfg.grad_accumulation(world_size)
    n_train, n_val = int(splits.train.shape[0]), int(splits.val.shape[0])
    windows = max(0, n_train - 1) // t.seq_len
    if windows < t.global_batch_size:
        raise ValueError(
            f"{source} gives {windows} training windows of train.seq_len={t.seq_len} tokens "
            f"({n_train} tokens), fewer than one global batch needs: "
            f"train.global_batch_size={t.global_batch_size} (train.micro_batch_size="
            f"{t.micro_batch_size} x {chunks} micro-batch(es) x {dims.dp} data-parallel "
            f"rank(s) x {accum} accumulation); lower train.global_batch_size or train.seq_len, "
            "or give more data")
    val_windows = max(0, n_val - 1) // t.seq_len
    need_val = rows * dims.dp if dims.pp > 1 else 1
    if val_windows < need_val:
        unit = (f"one pipeline batch of {rows} per data-parallel rank x {dims.dp}"
                if dims.pp > 1 else "one")
        raise ValueError(
            f"{source} gives {val_windows} validation windows of train.seq_len={t.seq_len} "
            f"tokens ({n_val} tokens), fewer than {unit}; lower train.seq_len"
            f"{' or train.micro_batch_size' if dims.pp > 1 else ''}, or give more data "
            f"(validation takes whole files, or the last {DEFAULT_VAL_FRACTION:.0%} of the "
            "tokens)")


def lr_lambda(cfg: RunConfig):
    """Linear warm-up, then cosine decay to lr * min_lr_ratio."""
    t = cfg.train

    def factor(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        progress = min(1.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


class _Model:
    """What the loop trains when there is no pipeline: a model from `Accelerator.prepare`,
    one forward and backward per micro-batch."""

    whole_batches = False  # any number of evaluation sequences will do

    def __init__(self, acc: Accelerator, model: torch.nn.Module, loss):
        self.acc, self.model, self.loss = acc, model, loss
        self.modules = [model]  # switched between train() and eval()
        self.params = model  # what the optimizer's parameter groups are built from
        self.description = ""
        self.exported = model  # what the final weights are gathered from
        self.moes = _gpt_moes(model)

    def accumulate(self):
        return self.acc.accumulate(self.model)

    def forward_backward(self, x, y, accum: int) -> torch.Tensor:
        loss = self.loss(self.model, x, y)
        self.acc.backward(loss)  # divides by the accumulation steps itself
        # A mixture of experts' loss includes its auxiliary losses (the reference GPT's MoE
        # blocks; a transformers MoE with output_router_logits): the reported loss is the
        # cross-entropy (as under pp), the auxiliary part is reported apart.
        aux = [m.last_aux_loss.detach() for m in self.moes if m.last_aux_loss is not None]
        hf_aux = getattr(self.loss, "last_aux", None)  # a transformers MoE's router loss
        if hf_aux is not None:
            aux.append(hf_aux)
        return loss.detach() - sum(aux) if aux else loss

    def eval_loss(self, x, y) -> torch.Tensor:
        return self.loss(self.model, x, y)

    def clip(self, max_norm: float) -> torch.Tensor:
        return self.acc.clip_grad_norm_(self.model.parameters(), max_norm)

    def after_step(self, step: int, out_dir: Path) -> None:
        pass


class _Pipelined:
    """What the loop trains under pp > 1: this rank's `Pipeline`, whose `step` runs forward
    and backward over all of a batch's micro-batches."""

    whole_batches = True  # evaluation batches are cut into micro-batches too

    def __init__(self, acc: Accelerator, pipeline, cfg: RunConfig, micro: int, chunks: int):
        self.acc, self.pipeline, self.steps = acc, pipeline, cfg.train.steps
        self.modules = pipeline.wrapped_modules
        self.params = torch.nn.ModuleList(pipeline.modules)  # this rank's stages
        self.exported = pipeline
        self.description = (f", {cfg.parallel.schedule} schedule with {chunks} micro-batches "
                            f"of {micro} (stages begin at blocks {pipeline.points})")

    def accumulate(self):
        return self.acc.accumulate()  # the schedule synchronises on its last micro-batch

    def forward_backward(self, x, y, accum: int) -> torch.Tensor:
        return self.pipeline.step(x, y, scale=1.0 / accum)

    def eval_loss(self, x, y) -> torch.Tensor:
        return self.pipeline.eval_loss(x, y)

    def clip(self, max_norm: float) -> torch.Tensor:
        return self.acc.clip_grad_norm_(self.pipeline, max_norm)  # every stage's part

    def after_step(self, step: int, out_dir: Path) -> None:
        if step == min(self.steps, PIPELINE_TIMED_STEPS):
            _save_pipeline_timings(self.pipeline,
                                   out_dir if self.acc.is_main_process else None)


@contextlib.contextmanager
def _untimed(exchanges):
    """Expert-parallel exchanges of an evaluation are not the training window's."""
    saved = [ep.timing for ep in exchanges]
    for ep in exchanges:
        ep.timing = False
    try:
        yield
    finally:
        for ep, timing in zip(exchanges, saved):
            ep.timing = timing


def _gpt_moes(model: torch.nn.Module) -> list:
    """The reference GPT's MoE blocks (their auxiliary losses are inside its loss)."""
    from meshfit.models import GPT
    from meshfit.parallel.ep import moe_modules

    base = getattr(model, "module", model)
    return moe_modules([base]) if isinstance(base, GPT) else []


def _routing(acc: Accelerator, trained, elapsed_s: float) -> dict:
    """The MoE metrics of the logged step (`meshfit.parallel.ep.routing_metrics`: the last
    micro-batch's routing) and the share of the window spent in expert-parallel
    all-to-alls; {} for a dense model. A collective: every rank calls it."""
    from meshfit.parallel.ep import moe_modules, routing_metrics

    if not trained.has_moe:
        return {}
    pp = acc.layout.axis_mesh(acc.mesh, "pp")
    out = routing_metrics(moe_modules(trained.modules), dp_group=acc.runtime.dp_group,
                          dp_size=acc.runtime.dp_size,
                          pp_group=None if pp is None else pp.get_group())
    if out and any(m.ep is not None and m.ep.timing for m in moe_modules(trained.modules)):
        out["moe_a2a_share"] = round(min(1.0, out["moe_a2a_s"] / max(elapsed_s, 1e-9)), 4)
    return out


def _evaluate(acc: Accelerator, trained, loader) -> float:
    for m in trained.modules:
        m.eval()
    total = torch.zeros(2, device=acc.device)
    with torch.no_grad():
        for x, y in loader:
            loss = trained.eval_loss(x, y)
            total += torch.stack([loss.detach().float().to(acc.device) * x.shape[0],
                                  torch.tensor(float(x.shape[0]), device=acc.device)])
    for m in trained.modules:
        m.train()
    total = acc.reduce(total, "sum")
    return (total[0] / total[1]).item()


def _find_micro_batch(acc: Accelerator, trained: _Model, seq_len: int, vocab: int,
                      micro: int, accum: int) -> tuple[int, int]:
    """The largest micro-batch (halving from `micro`) whose forward and backward fit on every
    rank, with the accumulation that keeps the global batch. Ranks agree through one MIN
    all-reduce per attempt, so an out-of-memory error on one rank cannot strand the others in
    a collective; gradients are not synchronised while probing (no_sync)."""
    from meshfit.train.batch_size import find_executable_batch_size, is_out_of_memory

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


def _batches(loader, what: str = "the training loader"):
    """An endless stream of batches, epoch after epoch (each with its own shuffling).
    Raises a one-line ValueError naming `what` when two passes in a row yield no batch
    (the first pass after resuming at an epoch's end may be empty; two cannot be), instead
    of looping forever."""
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


def build_accelerator(cfg: RunConfig, env: DistEnv, tp_plan=None) -> Accelerator:
    """The `Accelerator` of a run: [train]'s single-device options, [parallel]'s layout,
    [model]'s tensor-parallel plan (None: the model's built-in one)."""
    from meshfit.accelerator.compat import DataLoaderConfiguration

    t, p = cfg.train, cfg.parallel
    return Accelerator(
        # meshfit's own semantics where Accelerate's defaults differ: the schedule counts
        # optimizer steps; each epoch shuffles from train.seed + epoch; --resume puts the
        # loaders back where they stood.
        step_scheduler_per_process=False,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=t.seed,
                                                  use_stateful_dataloader=True),
        gradient_accumulation_steps=cfg.grad_accumulation(env.world_size),
        mixed_precision=t.mixed_precision, tf32=t.tf32,
        activation_checkpointing=t.activation_checkpointing,
        activation_checkpointing_every=t.activation_checkpointing_every,
        activation_checkpointing_policy=t.activation_checkpointing_policy,
        compile=t.compile, compile_backend=t.compile_backend, compile_mode=t.compile_mode,
        compile_scope=t.compile_scope, empty_cache_steps=t.empty_cache_steps,
        parallel=p.dims(), zero_stage=p.zero_stage, offload=p.offload,
        sync_each_batch=p.sync_each_batch, sequence_parallel=p.sequence_parallel,
        loss_parallel=p.loss_parallel, tp_plan=tp_plan, env=env)


def _prepare_model(acc: Accelerator, cfg: RunConfig, model: torch.nn.Module, chunks: int):
    """The prepared model, or under pp > 1 this rank's pipeline: each pipeline step takes
    micro x chunks sequences per data-parallel rank and cuts them into `chunks`
    micro-batches (the global batch is micro x chunks x dp x accumulation)."""
    if acc.parallel.pp == 1:
        return _Model(acc, acc.prepare(model), loss_function(model))
    p = cfg.parallel
    pipeline = acc.prepare_pipeline(model, schedule=p.schedule, microbatches=chunks,
                                    virtual_stages=p.virtual_stages,
                                    plan=resolve_plan(plans(cfg)[1], model),
                                    init_seed=cfg.train.seed,
                                    record_timings=True)  # for PIPELINE_TIMED_STEPS steps
    return _Pipelined(acc, pipeline, cfg, cfg.train.micro_batch_size, chunks)


def _loaders(acc: Accelerator, cfg: RunConfig, splits, trained, rows: int, micro: int):
    """Training batches of `rows` sequences per data-parallel rank, shuffled from the run's
    seed, and the validation set: eval_batches micro-batches per rank, in whole pipeline
    batches when the model is pipelined (at least one)."""
    t, d = cfg.train, cfg.data
    workers = dict(num_workers=d.num_workers, pin_memory=d.pin_memory and acc.device.type == "cuda")
    if d.num_workers:
        workers.update(prefetch_factor=d.prefetch_factor, persistent_workers=d.persistent_workers)
    train = DataLoader(TokenDataset(splits.train, t.seq_len), batch_size=rows, shuffle=True,
                       generator=torch.Generator().manual_seed(t.seed), drop_last=True,
                       **workers)
    val_set = TokenDataset(splits.val, t.seq_len)
    dp = acc.runtime.dp_size
    n_val = min(len(val_set), t.eval_batches * micro * dp)
    if trained.whole_batches:
        n_val = max(n_val // (rows * dp), 1) * rows * dp
        if n_val > len(val_set):
            raise ValueError(f"the validation split holds {len(val_set)} sequences of "
                             f"{t.seq_len} tokens, fewer than one pipeline batch of "
                             f"{rows} per data-parallel rank x {dp}; lower "
                             "train.micro_batch_size or parallel.microbatches")
    val = DataLoader(Subset(val_set, range(n_val)), batch_size=rows,
                     drop_last=trained.whole_batches, **workers)
    return train, val


def _banner(acc: Accelerator, model: torch.nn.Module, trained, micro: int, tokens: int,
            out_dir: Path) -> str:
    n_params = sum(p.numel() for p in model.parameters())
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    trainable = "" if n_trainable == n_params else f" ({n_trainable / 1e6:.3f}M trainable)"
    layout = f", zero_stage {acc.zero_stage}" if acc.zero_stage else ""
    dims = acc.parallel
    mesh = " x ".join(f"{n} {getattr(dims, n)}" for n in dims.enabled())
    layout += f", mesh {mesh}" if mesh and mesh != f"dp_replicate {dims.dp_replicate}" else ""
    return (f"meshfit train: {n_params / 1e6:.2f}M parameters{trainable}, {acc.num_processes} "
            f"process(es) on {acc.device}{layout}{trained.description}, micro-batch {micro}, "
            f"accumulation {acc.gradient_accumulation_steps}, {tokens / 1e6:.1f}M training "
            f"tokens -> {out_dir}")


def train(cfg: RunConfig, out_dir: Path, env: DistEnv | None = None, *,
          resume: bool = False) -> dict:
    """Train the model of [model] as `cfg` says, then write its weights to ``out_dir/model``
    (or the LoRA adapter to ``out_dir/adapter``); returns the last metrics. Call on every rank.
    `resume`: continue from the newest complete checkpoint in ``out_dir/checkpoints``."""
    t = cfg.train
    env = env or init(timeout_s=t.timeout_s)
    acc = build_accelerator(cfg, env)
    checkpoints = Checkpoints(acc, cfg, out_dir / "checkpoints")
    if resume:
        checkpoints.find()  # before anything is built: a missing checkpoint fails fast
    elif env.restart and checkpoints.newest() is not None:
        # Restarted by the launcher after a worker failed (--max-restarts): go on from the
        # newest complete checkpoint rather than from the start.
        acc.print(f"meshfit train: restart {env.restart} of the workers")
        resume = True
    with acc.main_process_first():  # rank 0 builds the token cache, the others reuse it
        splits = cfg.load_tokens()
    torch.manual_seed(t.seed)
    model = build_model(cfg, splits.vocab_size)
    tp_plan = resolve_plan(plans(cfg)[0], model)
    if tp_plan is not None:
        acc.model_options = dataclasses.replace(acc.model_options, tp_plan=tp_plan)
    # Parallelise first, then build the optimizer over the prepared parameters (torchtitan's
    # order: a fused optimizer checks the parameters' device when it is built; under ZeRO-2/3
    # they are then the sharded DTensors, and under ZeRO-1 prepare(optimizer) partitions it).
    micro, chunks = t.micro_batch_size, cfg.microbatches(env.world_size)
    trained = _prepare_model(acc, cfg, model, chunks)
    trained.has_moe = bool(moe_modules([model]))  # on any stage: every rank logs routing
    exchanges = [m.ep for m in moe_modules(trained.modules) if m.ep is not None]
    for ep in exchanges:  # timed always on the CPU (gloo waits anyway), on CUDA at first
        ep.timing = True
    if t.find_batch_size:  # (the layout refused it where forward communicates: not with pp)
        micro, _ = _find_micro_batch(acc, trained, t.seq_len, splits.vocab_size, micro,
                                     acc.gradient_accumulation_steps)
    optimizer = build_optimizer(trained.params, cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    train_loader, val_loader = _loaders(acc, cfg, splits, trained, micro * chunks, micro)
    optimizer, train_loader, val_loader, scheduler = acc.prepare(
        optimizer, train_loader, val_loader, scheduler)
    acc.print(_banner(acc, model, trained, micro, splits.train.shape[0], out_dir))
    start = checkpoints.resume() if resume else 0
    writer = MetricsWriter(out_dir if acc.is_main_process else None, cfg, after_step=start)

    accum = acc.gradient_accumulation_steps
    progress = RunReporter(acc, cfg, out_dir if acc.is_main_process else None, model, t.steps)
    last: dict = {"step": start}
    if start == 0:
        with _untimed(exchanges):
            last["val_loss"] = round(_evaluate(acc, trained, val_loader), 5)
        writer.write(last)
        progress.report(last, start)
    wait = [0.0]  # seconds spent waiting for batches in this window
    batches = timed_batches(_batches(train_loader, (
        f"the training loader ({len(train_loader.dataset)} windows of train.seq_len="
        f"{t.seq_len} tokens, batches of {micro * chunks} per rank on "
        f"{acc.runtime.dp_size} data-parallel rank(s))")), wait)
    window = Window(acc, t.global_batch_size * t.seq_len)
    stop = StopOnSignal()
    step = start + 1  # the step in progress, for a timeout's message
    with collective_deadline(acc.process_index, t.timeout_s, lambda: f"step {step}"):
        for step in range(start + 1, t.steps + 1):
            logged = step % t.log_every == 0 or step == t.steps
            grad_norm = None
            for _ in range(accum):
                x, y = next(batches)
                with trained.accumulate():
                    loss = trained.forward_backward(x, y, accum)
                    if acc.sync_gradients and (t.grad_clip > 0 or logged):
                        # the norm of a logged step is measured even without clipping
                        norm = trained.clip(t.grad_clip if t.grad_clip > 0 else math.inf)
                        grad_norm = float(norm) if logged else None
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                window.add(loss)
            window.steps += 1
            trained.after_step(step, out_dir)
            if step == PIPELINE_TIMED_STEPS and acc.device.type == "cuda":
                for ep in exchanges:  # timing synchronises the device around each exchange
                    ep.timing = False
            if logged:
                window_s = time.perf_counter() - window.start
                last = window.close(step, accum, float(scheduler.get_last_lr()[0]))
                last = progress.step_figures(last, grad_norm=grad_norm, wait_s=wait[0],
                                             window_s=window_s)
                wait[0] = 0.0
                last.update(_routing(acc, trained, window_s))
                writer.write(last)
                progress.report(last, step)
            if (t.eval_every and step % t.eval_every == 0) or step == t.steps:
                began = time.perf_counter()
                with _untimed(exchanges):
                    val = {"step": step,
                           "val_loss": round(_evaluate(acc, trained, val_loader), 5)}
                writer.write(val)
                progress.report(val, step)
                last.update(val)
                window.start += time.perf_counter() - began  # not training throughput
            if checkpoints.due(step):
                began = time.perf_counter()
                checkpoints.save(step)
                window.start += time.perf_counter() - began
            signum = stop.requested(acc)
            if signum:  # every rank got here after the same step
                progress.finish()
                checkpoints.finish()
                folder = checkpoints.folder(step) if checkpoints.due(step) else \
                    checkpoints.save(step, wait=True)
                stop.restore()
                raise Preempted(signum, step, folder, out_dir)
    stop.restore()
    checkpoints.finish()
    progress.finish()
    with collective_deadline(acc.process_index, t.timeout_s, "writing the final model"):
        written = write_final_model(acc, trained.exported, model, cfg,
                                    getattr(splits, "tokenizer", None), out_dir,
                                    splits.vocab_size)
    for folder in written:
        acc.print(f"meshfit train: wrote {folder}")
    acc.print(f"done: loss {last.get('loss')}, val_loss {last.get('val_loss')}")
    acc.wait_for_everyone()
    return last


PIPELINE_TIMED_STEPS = 5
"""Optimizer steps whose per-micro-batch timings a pipeline run records (then stops: on
CUDA the recording synchronises the device around every forward and backward)."""


def _save_pipeline_timings(pipeline, out_dir: Path | None) -> None:
    """Every pp rank's timings so far into the run folder (`meshfit pipeline-chart RUN`);
    a collective over the pp group. Recording stops afterwards."""
    from meshfit.parallel.pp import gather_timings
    from meshfit.train.pipeline_chart import write_run

    timings = gather_timings(pipeline)
    pipeline.record_timings(False)
    if out_dir is not None:
        write_run(out_dir, pipeline.meta(), timings)


