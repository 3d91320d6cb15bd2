"""`Accelerator`: a thin facade for users' own training loops.

It speaks Hugging Face Accelerate's calls (``prepare``, ``backward``, ``accumulate``,
``no_sync``, ``gather_for_metrics``, ...), but it is a layer over ``torch.distributed``
itself: the `Layout` (decided once, in the constructor) says how the job is laid out,
`parallelize` applies it to each model or pipeline stage, the engine's `Runtime` answers for
it while the loop runs (groups, ``no_sync``, export), `Precision` handles autocast and loss
scaling, and the prepared optimizer/scheduler/dataloader objects implement accumulation
boundaries and sharding.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import warnings
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from meshfit import distributed as mdist
from meshfit.accelerator.compat import (AutocastKwargs, DataLoaderConfiguration,
                                        DistributedDataParallelKwargs, DistributedType,
                                        FullyShardedDataParallelPlugin, GradientAccumulationPlugin,
                                        GradScalerKwargs, InitProcessGroupKwargs, KwargsHandler,
                                        LoggerType, ProfileKwargs, ProjectConfiguration)
from meshfit.accelerator.compat import gather_object as _gather_object
from meshfit.accelerator.compat import is_all_tensors, pad_across_processes
from meshfit.accelerator.loader import PreparedDataLoader
from meshfit.accelerator.loader import broadcast_state as _broadcast_cpu
from meshfit.accelerator.precision import Precision, empty_device_cache, set_tf32
from meshfit.accelerator.prepared import (GradientState, ParameterMap, PreparedOptimizer,
                                          PreparedScheduler, rebuild_optimizer,
                                          repoint_scheduler)
from meshfit.accelerator.runtime import Runtime, runtime_for
from meshfit.distributed import DistEnv, ParallelDims
from meshfit.checkpoint.export import write_safetensors
from meshfit.distributed import collectives as ops
from meshfit.parallel.clip import clip_grad_norm_
from meshfit.parallel.layout import Layout, check_options
from meshfit.parallel.parallelize import ModelOptions, parallelize

log = logging.getLogger("meshfit")


_UNSET = object()  # an argument not given (Accelerate's split_batches)
_HANDLERS = (DistributedDataParallelKwargs, InitProcessGroupKwargs, GradScalerKwargs,
             AutocastKwargs, ProfileKwargs)


def _sort_handlers(handlers) -> dict[type, KwargsHandler]:
    """``kwargs_handlers`` by class; one of each, of the classes meshfit knows."""
    out: dict[type, KwargsHandler] = {}
    for handler in handlers or ():
        kind = next((k for k in _HANDLERS if isinstance(handler, k)), None)
        if kind is None:
            raise ValueError(f"kwargs_handlers: {handler!r} ({type(handler).__name__}) is not "
                             "available; use "
                             f"{', '.join(k.__name__ for k in _HANDLERS)}")
        if kind in out:
            raise ValueError(f"You can only pass one {kind} in `kwargs_handlers`.")
        out[kind] = handler
    return out


def _init_kwargs(handler: InitProcessGroupKwargs | None) -> dict:
    """`meshfit.distributed.init`'s arguments from an InitProcessGroupKwargs."""
    if handler is None:
        return {}
    given = handler.to_kwargs()
    if given.get("init_method") is not None:
        raise ValueError("InitProcessGroupKwargs(init_method=...) is not available: meshfit "
                         "joins the process group torchrun (meshfit launch) describes")
    out = {}
    if "backend" in given and given["backend"] is not None:
        out["backend"] = given["backend"]
    if "timeout" in given and given["timeout"] is not None:
        out["timeout_s"] = given["timeout"].total_seconds()
    return out


def _tracker_list(log_with) -> list:
    """``log_with`` as a list of names (str, LoggerType) and tracker objects."""
    if log_with is None:
        return []
    items = log_with if isinstance(log_with, (list, tuple)) else [log_with]
    out = []
    for item in items:
        if isinstance(item, LoggerType):
            item = item.value
        elif isinstance(item, str):
            item = item.lower()
        elif not (callable(getattr(item, "log", None)) and hasattr(item, "name")):
            raise ValueError(f"log_with: {item!r} is neither a tracker name nor a tracker "
                             "object (with .name, .log, .store_init_configuration, .finish)")
        out.append(item)
    return out


class _BlankTracker:
    """What `get_tracker` returns where no tracker runs (other processes): does nothing."""

    def __init__(self, name: str):
        self.name = name
        self.tracker = None

    def store_init_configuration(self, config: dict) -> None:
        pass

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        pass

    def finish(self) -> None:
        pass


class AcceleratorState:
    """``accelerator.state``: where this process stands (Accelerate's attribute names)."""

    def __init__(self, accelerator: "Accelerator"):
        self._acc = accelerator

    distributed_type = property(lambda self: self._acc.distributed_type)
    num_processes = property(lambda self: self._acc.num_processes)
    process_index = property(lambda self: self._acc.process_index)
    local_process_index = property(lambda self: self._acc.local_process_index)
    device = property(lambda self: self._acc.device)
    mixed_precision = property(lambda self: self._acc.mixed_precision)
    is_main_process = property(lambda self: self._acc.is_main_process)
    is_local_main_process = property(lambda self: self._acc.is_local_main_process)
    is_last_process = property(lambda self: self._acc.is_last_process)
    use_distributed = property(lambda self: self._acc.use_distributed)
    backend = property(lambda self: self._acc.env.backend)
    fsdp_plugin = property(lambda self: self._acc.fsdp_plugin)
    deepspeed_plugin = None
    initialized = True

    def wait_for_everyone(self) -> None:
        self._acc.wait_for_everyone()

    def print(self, *args, **kwargs) -> None:
        self._acc.print(*args, **kwargs)

    def split_between_processes(self, inputs, apply_padding: bool = False):
        return self._acc.split_between_processes(inputs, apply_padding=apply_padding)

    def main_process_first(self):
        return self._acc.main_process_first()

    def local_main_process_first(self):
        return self._acc.local_main_process_first()

    def __repr__(self) -> str:
        return (f"Distributed environment: {self.distributed_type}\n"
                f"Num processes: {self.num_processes}\nProcess index: {self.process_index}\n"
                f"Local process index: {self.local_process_index}\nDevice: {self.device}\n"
                f"Mixed precision type: {self.mixed_precision}\n")


def _is_scheduler(obj: Any) -> bool:
    return isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or (
        hasattr(obj, "step") and hasattr(obj, "get_last_lr") and hasattr(obj, "optimizer"))


class Accelerator:
    """Runs a user's training loop on one device or data parallel across processes.

    The positional and keyword arguments up to ``parallelism_config`` are Hugging Face
    Accelerate 1.15's, with its defaults and meaning (a script written for Accelerate runs
    with ``accelerate`` replaced by ``meshfit`` in its imports); the keyword-only ones after
    them are meshfit's own.

    Accelerate's arguments:
        device_placement: True (batches and models go to `device`); False is accepted on
            the CPU only (where nothing moves).
        split_batches: ignored, as by Accelerate 1.15 (a warning says so); use
            ``dataloader_config=DataLoaderConfiguration(split_batches=True)``.
        mixed_precision: None (the environment's ``ACCELERATE_MIXED_PRECISION``, else
            ``"no"``), ``"no"``, ``"bf16"`` (autocast) or ``"fp16"`` (autocast + dynamic
            loss scaling). Master weights and optimizer state stay fp32.
        gradient_accumulation_steps: micro-batches per optimizer step (k). Inside
            `accumulate`, `backward` divides the loss by k and gradients are synchronised
            only on every k-th micro-batch (or the dataloader's last one).
        cpu: run on the CPU (gloo) even where CUDA is available; None (meshfit's default):
            the environment's ``MESHFIT_CPU``, else False; ``ACCELERATE_USE_CPU=true`` in
            the environment (``accelerate launch --cpu``) means True, as for Accelerate.
        dataloader_config: a `meshfit.utils.DataLoaderConfiguration` (split_batches,
            even_batches, use_seedable_sampler, data_seed, use_stateful_dataloader; see
            `meshfit.accelerator.loader`).
        fsdp_plugin: a `meshfit.utils.FullyShardedDataParallelPlugin`: every process shards
            the model with FSDP2 (ZeRO-3, or ZeRO-2 for SHARD_GRAD_OP); instead of
            ``parallel``/``zero_stage``.
        deepspeed_plugin, torch_tp_plugin, megatron_lm_plugin, dynamo_plugin,
            deepspeed_plugins, parallelism_config: not available (None only); meshfit's
            ``parallel=ParallelDims(...)``, ``zero_stage`` and ``compile`` do their work.
        rng_types: generators synchronised from process 0 at the start of each pass over a
            prepared loader: ``["generator"]`` (default: the shuffling generator), also
            ``"torch"`` and ``"cuda"`` (the global ones).
        log_with: tracker names (``"tensorboard"``, ``"wandb"``, ``"mlflow"``, ``"csv"``,
            ``"all"``, `LoggerType` values) or tracker objects, started by `init_trackers`
            on the main process (`meshfit.tracking`).
        project_dir, project_config: where trackers and automatically named checkpoints
            go (`meshfit.utils.ProjectConfiguration`).
        gradient_accumulation_plugin: instead of ``gradient_accumulation_steps``
            (`meshfit.utils.GradientAccumulationPlugin`).
        step_scheduler_with_optimizer: True: a prepared LR scheduler steps only with the
            optimizer (see ``step_scheduler_per_process``); False: on every call.
        kwargs_handlers: `DistributedDataParallelKwargs` (DDP's arguments and communication
            hook), `InitProcessGroupKwargs` (backend, timeout), `GradScalerKwargs`,
            `AutocastKwargs`, `ProfileKwargs`.
        dynamo_backend: ``torch.compile`` the whole prepared model with this backend
            (``"no"``: not at all).

    meshfit's arguments:
        step_scheduler_per_process: True (Accelerate's rule): each optimizer step advances a
            prepared scheduler once per data-parallel process (once when batches are split),
            because scripts size their schedules in one process's batches; False: once per
            optimizer step, for schedules that count optimizer steps (`meshfit train`).
        tf32: True/False switch TF32 tensor cores for fp32 matrix products on or off
            (NVIDIA Ampere and newer; no effect elsewhere); None leaves PyTorch's
            process-wide setting as it is.
        activation_checkpointing: ``"none"``, ``"full"`` (every transformer block recomputes
            its activations in backward) or ``"selective"`` (every
            ``activation_checkpointing_every``-th block with policy ``"block"``, or every block
            keeping matrix-product outputs with policy ``"op"``); see
            `meshfit.parallel.activation`.
        compile: ``torch.compile`` prepared models, per transformer block
            (``compile_scope="block"``, the default) or whole (``"model"``), with
            ``compile_backend`` and ``compile_mode``; see `meshfit.parallel.compile`.
        empty_cache_steps: release the device allocator's cached blocks every this many
            optimizer steps (0: never), as Transformers' ``torch_empty_cache_steps``.
        parallel: the layout (`ParallelDims`); default: every process a DDP replica.
            ``ParallelDims(dp_shard=N)`` shards over N ranks (ZeRO); with ``dp_replicate=M``
            too, M groups of N (hybrid sharding, HSDP). All M x N ranks see different data.
            ``tp=T`` splits every block over T ranks (Megatron-style, `apply_tp`), composed
            with any data-parallel axes (see `meshfit.parallel.layout`); ``pp=P`` cuts the
            model into stages: use `prepare_pipeline` instead of ``prepare(model)``. The
            layout is decided once, here (`self.layout`, a `meshfit.Layout`).
        zero_stage: with dp_shard > 1, what is sharded over the dp_shard ranks (ZeRO,
            Rajbhandari et al. 2020); default 3 when dp_shard > 1, else 0.
            0: nothing (DDP). 1: optimizer state (DDP + ZeroRedundancyOptimizer, applied in
            `prepare_optimizer`). 2: gradients and optimizer state (FSDP2 with
            reshard_after_forward=False; FSDP2 also keeps parameters sharded between steps,
            see `meshfit.parallel.fsdp`). 3: parameters too, gathered per block just in time
            (FSDP2). Under 2 and 3, mixed precision is FSDP's MixedPrecisionPolicy
            (parameters gathered and computed in bf16/fp16, gradients reduced in fp32, fp32
            master weights and outputs) instead of autocast. With tp or pp > 1 every
            data-parallel stage runs on FSDP2 (0: replicate-only, 1: whole gradients until the
            boundary, sharded optimizer state), so FSDP's mixed-precision policy applies to
            all of them (see `meshfit.parallel.layout`).
        offload: ``"cpu"`` keeps the sharded parameters, gradients and optimizer state in
            host memory (ZeRO-Offload; zero_stage=3 only); ``"none"``.
        sync_each_batch: under accumulation with zero_stage 2/3, False skips the
            reduce-scatter on non-boundary micro-batches (fewer collectives; FSDP then holds
            full unsharded gradients, Ψ·4 bytes per rank, until the boundary); True
            reduce-scatters every micro-batch (sharded gradients accumulate: Ψ·4/N bytes);
            ``"auto"`` picks True when the unsharded gradients would take more than a quarter
            of the free memory (CUDA free memory, host available memory on CPU) on any rank,
            and logs the choice once (when the first model is prepared; the
            ``sync_each_batch`` attribute then holds it). Under DDP and ZeRO-1 gradients are
            full-size anyway, so "auto" means False there.
        sequence_parallel: with tp > 1, split the residual stream on the sequence dimension
            between the tensor-parallel blocks (norms and dropout run on T/tp positions;
            Korthikanti et al. 2022); the sequence length must divide by tp.
        loss_parallel: with tp > 1, the output head keeps its logits sharded on the
            vocabulary and the reference GPT's ``model(idx, targets)`` loss is computed
            without gathering them (`meshfit.parallel.tp.tp_cross_entropy` for other
            losses). See `meshfit.parallel.tp.apply_tp`.
        tp_plan: with tp > 1, how to split a model that has no built-in plan: a
            `meshfit.models.plans.TPPlan` or ``{module pattern: Style or ParallelStyle}``
            (see `meshfit.parallel.tp.apply_tp`); None: the model type's built-in plan.
        ddp_kwargs: extra keyword arguments for DistributedDataParallel
            (``bucket_cap_mb``, ``find_unused_parameters``, ``static_graph``, ...); they
            take precedence over a DistributedDataParallelKwargs handler's.
        env: an existing `DistEnv`; default: `meshfit.distributed.init()`.
    """

    def __init__(self, device_placement: bool = True, split_batches: Any = _UNSET,
                 mixed_precision: str | None = None, gradient_accumulation_steps: int = 1,
                 cpu: bool | None = None,
                 dataloader_config: DataLoaderConfiguration | None = None,
                 deepspeed_plugin=None,
                 fsdp_plugin: FullyShardedDataParallelPlugin | None = None,
                 torch_tp_plugin=None, megatron_lm_plugin=None,
                 rng_types: list | None = None, log_with=None,
                 project_dir: str | os.PathLike | None = None,
                 project_config: ProjectConfiguration | None = None,
                 gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
                 step_scheduler_with_optimizer: bool = True, kwargs_handlers: list | None = None,
                 dynamo_backend=None, dynamo_plugin=None, deepspeed_plugins=None,
                 parallelism_config=None, *,
                 step_scheduler_per_process: bool = True,
                 tf32: bool | None = None, activation_checkpointing: str = "none",
                 activation_checkpointing_every: int = 2,
                 activation_checkpointing_policy: str = "block", compile: bool = False,
                 compile_backend: str = "inductor", compile_mode: str = "default",
                 compile_scope: str = "block", empty_cache_steps: int = 0,
                 parallel: ParallelDims | None = None, zero_stage: int | None = None,
                 offload: str = "none", sync_each_batch: bool | str = False,
                 sequence_parallel: bool = False, loss_parallel: bool = False,
                 tp_plan=None, ddp_kwargs: dict | None = None,
                 env: DistEnv | None = None):
        for name, value in (("deepspeed_plugin", deepspeed_plugin),
                            ("deepspeed_plugins", deepspeed_plugins),
                            ("torch_tp_plugin", torch_tp_plugin),
                            ("megatron_lm_plugin", megatron_lm_plugin),
                            ("dynamo_plugin", dynamo_plugin),
                            ("parallelism_config", parallelism_config)):
            if value is not None:
                raise ValueError(f"Accelerator({name}=...) is not available in meshfit; lay the "
                                 "job out with parallel=ParallelDims(...) and zero_stage=, or "
                                 "fsdp_plugin=FullyShardedDataParallelPlugin(...); compile with "
                                 "dynamo_backend= or compile=True")
        if not isinstance(device_placement, bool):
            raise ValueError(f"device_placement={device_placement!r} must be True or False")
        if cpu is not None and not isinstance(cpu, bool):
            raise ValueError(f"cpu={cpu!r} must be True, False or None (the environment's "
                             "MESHFIT_CPU)")
        if ddp_kwargs is not None and not isinstance(ddp_kwargs, dict):
            raise ValueError(f"ddp_kwargs={ddp_kwargs!r} must be a dict of DistributedDataParallel "
                             "arguments, e.g. {'find_unused_parameters': True}")
        if project_dir is not None and not isinstance(project_dir, (str, os.PathLike)):
            raise ValueError(f"project_dir={project_dir!r} must be a path (str or os.PathLike) "
                             "or None")
        if split_batches is not _UNSET:
            warnings.warn("meshfit: Accelerator(split_batches=...) is ignored, as by Accelerate "
                          "1.15; pass dataloader_config=DataLoaderConfiguration("
                          "split_batches=...)", UserWarning, stacklevel=2)
        if not isinstance(step_scheduler_with_optimizer, bool) or \
                not isinstance(step_scheduler_per_process, bool):
            raise ValueError("step_scheduler_with_optimizer and step_scheduler_per_process must "
                             "be True or False")
        if gradient_accumulation_plugin is not None:
            if gradient_accumulation_steps != 1:
                raise ValueError("You can only pass one of `gradient_accumulation_steps` and "
                                 "`gradient_accumulation_plugin`. Please only pass in the "
                                 "created `GradientAccumulationPlugin` object.")
            plugin = gradient_accumulation_plugin.to_kwargs()
            gradient_accumulation_steps = plugin.get("num_steps", 1)
            if plugin.get("sync_each_batch", False) and sync_each_batch is False:
                sync_each_batch = True
        else:
            plugin = {}
        if isinstance(gradient_accumulation_steps, bool) or not isinstance(
                gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
            raise ValueError(f"gradient_accumulation_steps={gradient_accumulation_steps!r} must "
                             "be an integer >= 1 (1 means no accumulation)")
        if isinstance(empty_cache_steps, bool) or not isinstance(empty_cache_steps, int) or \
                empty_cache_steps < 0:
            raise ValueError(f"empty_cache_steps={empty_cache_steps!r} must be an integer >= 0 "
                             "(0: never)")
        if tf32 is not None and not isinstance(tf32, bool):
            raise ValueError(f"tf32={tf32!r} must be True, False or None (leave as it is)")
        if mixed_precision is None:
            mixed_precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
        mixed_precision = str(mixed_precision)
        handlers = _sort_handlers(kwargs_handlers)
        self.ddp_handler = handlers.get(DistributedDataParallelKwargs)
        self.init_handler = handlers.get(InitProcessGroupKwargs)
        self.scaler_handler = handlers.get(GradScalerKwargs)
        self.autocast_handler = handlers.get(AutocastKwargs)
        self.profile_handler = handlers.get(ProfileKwargs)
        if self.ddp_handler is not None:
            ddp_kwargs = {**self.ddp_handler.to_kwargs(), **(ddp_kwargs or {})}
        if dynamo_backend is not None and str(dynamo_backend).upper() != "NO":
            compile, compile_backend, compile_scope = True, str(dynamo_backend).lower(), "model"
        self.fsdp_plugin = fsdp_plugin
        if fsdp_plugin is not None:
            if not isinstance(fsdp_plugin, FullyShardedDataParallelPlugin):
                raise TypeError("`fsdp_plugin` must be a FullyShardedDataParallelPlugin object.")
            if parallel is not None or zero_stage is not None:
                raise ValueError("Accelerator(fsdp_plugin=...) lays the job out itself; pass "
                                 "either fsdp_plugin or parallel=/zero_stage=")
            wanted = fsdp_plugin.mixed_precision()
            if wanted is not None and mixed_precision not in ("no", wanted):
                raise ValueError(f"mixed_precision={mixed_precision!r} and the FSDP plugin's "
                                 f"mixed_precision_policy ({wanted}) disagree; give one")
            if wanted is not None:
                mixed_precision = wanted
            if fsdp_plugin.offload() == "cpu":
                offload = "cpu"
            if fsdp_plugin.activation_checkpointing and activation_checkpointing == "none":
                activation_checkpointing = "full"
        self.dataloader_config = dataloader_config or DataLoaderConfiguration()
        if self.dataloader_config.dispatch_batches:
            raise ValueError("DataLoaderConfiguration(dispatch_batches=True) is not available in "
                             "meshfit: every process reads its own batches; leave it None")
        self.rng_types = ["generator"] if rng_types is None else [str(r) for r in rng_types]
        unknown = sorted(set(self.rng_types) - {"generator", "torch", "cuda"})
        if unknown:
            raise ValueError(f"rng_types {unknown} are not available; use 'generator', 'torch' "
                             "or 'cuda'")
        self.project_configuration = project_config if project_config is not None \
            else ProjectConfiguration(project_dir=project_dir)
        if project_dir is not None and self.project_configuration.project_dir is None:
            self.project_configuration.set_directories(project_dir)
        self.log_with = _tracker_list(log_with)
        self.trackers: list = []
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.step_scheduler_per_process = step_scheduler_per_process
        self.flag_tensor = None
        # Checked here, before any process group or model work, with the techniques' own rules.
        check_options(parallel=parallel, zero_stage=zero_stage, offload=offload,
                      sync_each_batch=sync_each_batch, mixed_precision=mixed_precision,
                      sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
        self.model_options = ModelOptions(
            activation_checkpointing=activation_checkpointing,
            activation_checkpointing_every=activation_checkpointing_every,
            activation_checkpointing_policy=activation_checkpointing_policy,
            compile=compile, compile_backend=compile_backend, compile_mode=compile_mode,
            compile_scope=compile_scope, tp_plan=tp_plan, ddp_kwargs=dict(ddp_kwargs or {}))
        if os.environ.get("ACCELERATE_USE_CPU", "").strip().lower() in ("1", "true", "yes"):
            cpu = True  # `accelerate launch --cpu`, as Accelerate reads it
        self.env = env or mdist.init(cpu=cpu, **_init_kwargs(self.init_handler))
        if fsdp_plugin is not None and self.env.world_size > 1:
            zero_stage = fsdp_plugin.zero_stage()
            if zero_stage:
                parallel = ParallelDims(dp_replicate=1, dp_shard=-1)
            else:
                zero_stage = None
        if not device_placement and self.env.device.type != "cpu":
            raise ValueError("Accelerator(device_placement=False) is available on the CPU only; "
                             f"this process runs on {self.env.device}")
        self.device_placement = device_placement
        local = self.env.local_world_size if self.env.is_distributed else None
        # The one decision of how this job is laid out (every rule lives in Layout).
        self.layout = Layout.resolve(
            parallel, self.env.world_size, distributed=self.env.is_distributed,
            zero_stage=zero_stage, offload=offload, mixed_precision=mixed_precision,
            sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
            ddp_kwargs=ddp_kwargs, local_world_size=local)
        self.parallel = self.layout.dims
        for message in self.layout.warnings:
            warnings.warn(f"meshfit: {message}", UserWarning, stacklevel=2)
        self.precision = Precision(
            mixed_precision, self.env.device,
            scaler_kwargs=None if self.scaler_handler is None else self.scaler_handler.to_kwargs(),
            autocast_kwargs=None if self.autocast_handler is None
            else self.autocast_handler.to_kwargs())
        mesh = self.layout.build_mesh(self.env.device.type) if self.env.is_distributed else None
        self.runtime: Runtime = runtime_for(self.layout, self.env, mesh)
        self.empty_cache_steps = empty_cache_steps
        self._optimizer_steps = 0
        # "auto" is decided when the first model is prepared (it needs the model's size).
        self.sync_each_batch: bool | str = sync_each_batch
        self._params = ParameterMap()  # parameters replaced by sharding, for optimizers
        self._pipeline_params: set[int] = set()  # ids of prepared pipeline stages' parameters
        self._replaced: dict[int, tuple[Any, torch.optim.Optimizer]] = {}  # user opt -> new
        self.tf32 = tf32
        if tf32 is not None:
            set_tf32(tf32)
        # Loaders being iterated, innermost last (an evaluation loop inside training): the
        # innermost one's end decides the accumulation boundary, as Accelerate's
        # GradientState does with its active dataloaders.
        self.grad_state = GradientState(
            num_steps=gradient_accumulation_steps,
            sync_with_dataloader=plugin.get("sync_with_dataloader", True),
            adjust_scheduler=plugin.get("adjust_scheduler", False))
        self._optimizers: list[PreparedOptimizer] = []
        self._models: list[torch.nn.Module] = []
        # What save_state / load_state cover, in the order prepared (Accelerate's naming).
        self._checkpointed_models: list[Any] = []  # prepared models and pipelines
        self._schedulers: list[PreparedScheduler] = []
        self._loaders: list[PreparedDataLoader] = []
        self._custom: list[Any] = []  # register_for_checkpointing
        self._pending_save = None  # an asynchronous save not yet committed
        self._save_group = None  # the process group asynchronous saves write with

    # ----------------------------------------------------------------- where we are
    @property
    def device(self) -> torch.device:
        return self.env.device

    @property
    def process_index(self) -> int:
        return self.env.rank

    @property
    def local_process_index(self) -> int:
        return self.env.local_rank

    @property
    def num_processes(self) -> int:
        return self.env.world_size

    @property
    def is_main_process(self) -> bool:
        return self.env.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.env.local_rank == 0

    @property
    def mixed_precision(self) -> str:
        return self.precision.mode

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.grad_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, k: int) -> None:
        """Change k between optimizer steps (e.g. after a batch-size search)."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"gradient_accumulation_steps={k!r} must be an integer >= 1")
        self.grad_state.num_steps = k
        self.grad_state.step = 0

    @property
    def sync_gradients(self) -> bool:
        """True on micro-batches whose backward synchronises gradients (and so on which the
        prepared optimizer steps)."""
        return self.grad_state.sync_gradients

    @property
    def mesh(self):
        """The layout's `DeviceMesh` (None for a single process without a process group)."""
        return self.runtime.mesh

    @property
    def zero_stage(self) -> int:
        """The resolved ZeRO stage (0: DDP or a single process)."""
        return self.layout.zero_stage

    # ----------------------------------------------------------------- Accelerate's state
    @property
    def state(self) -> AcceleratorState:
        return AcceleratorState(self)

    @property
    def gradient_state(self) -> GradientState:
        """Accumulation state: ``sync_gradients``, ``num_steps``, ``end_of_dataloader``,
        ``remainder``, ``active_dataloader``, ``in_dataloader``."""
        return self.grad_state

    @property
    def distributed_type(self) -> DistributedType:
        """NO on one process; FSDP when the layout shards with FSDP2 (ZeRO-2/3, and every
        data-parallel layout with tp or pp); MULTI_GPU, MULTI_CPU, ... (by device) for DDP
        and ZeRO-1."""
        if not self.env.is_distributed or self.env.world_size == 1:
            return DistributedType.NO
        if self.layout.is_fsdp:
            return DistributedType.FSDP
        kind = {"cuda": DistributedType.MULTI_GPU, "cpu": DistributedType.MULTI_CPU,
                "xpu": DistributedType.MULTI_XPU, "npu": DistributedType.MULTI_NPU,
                "mlu": DistributedType.MULTI_MLU, "hpu": DistributedType.MULTI_HPU}
        return kind.get(self.device.type, DistributedType.MULTI_GPU)

    @property
    def use_distributed(self) -> bool:
        return self.distributed_type != DistributedType.NO and self.num_processes > 1

    @property
    def multi_device(self) -> bool:
        """Distributed over several accelerators (not CPUs, not FSDP), as Accelerate's."""
        return self.use_distributed and self.distributed_type not in (
            DistributedType.FSDP, DistributedType.MULTI_CPU)

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    @property
    def step(self) -> int:
        """Micro-batches since the last synchronising one (Accelerate's ``step``)."""
        return self.grad_state.step

    @step.setter
    def step(self, value: int) -> None:
        self.grad_state.step = value

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether the last optimizer step was skipped (fp16 overflow): the learning rate
        should then not change (prepared schedulers do not step)."""
        return any(opt.step_was_skipped for opt in self._optimizers)

    @property
    def split_batches(self) -> bool:
        return self.dataloader_config.split_batches

    @property
    def dispatch_batches(self):
        return self.dataloader_config.dispatch_batches

    @property
    def even_batches(self) -> bool:
        return self.dataloader_config.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        self.dataloader_config.even_batches = value

    @property
    def use_seedable_sampler(self) -> bool:
        return self.dataloader_config.use_seedable_sampler

    @property
    def non_blocking(self) -> bool:
        return self.dataloader_config.non_blocking

    @property
    def use_stateful_dataloader(self) -> bool:
        return self.dataloader_config.use_stateful_dataloader

    @property
    def project_dir(self):
        return self.project_configuration.project_dir

    @property
    def logging_dir(self):
        return self.project_configuration.logging_dir

    @property
    def save_iteration(self) -> int:
        return self.project_configuration.iteration

    # ----------------------------------------------------------------- prepare
    def prepare(self, *objects: Any, device_placement=None) -> Any:
        """Prepare models, optimizers, dataloaders and LR schedulers, in any order; returns
        them in the order given (a single object when one is given); other objects are
        returned as they are. `device_placement`: see the constructor."""
        if device_placement is not None and not device_placement and \
                self.device.type != "cpu":
            raise ValueError("prepare(device_placement=False) is available on the CPU only")
        # Models first so that wrapping happens before optimizers and schedulers are wrapped;
        # results are put back in the caller's order.
        kinds = [self._kind(obj) for obj in objects]
        out: list[Any] = list(objects)
        for kind in ("model", "optimizer", "dataloader", "scheduler"):
            for i, obj in enumerate(objects):
                if kinds[i] == kind:
                    out[i] = getattr(self, f"prepare_{kind}")(obj)
        return out[0] if len(out) == 1 else tuple(out)

    @staticmethod
    def _kind(obj: Any) -> str:
        if isinstance(obj, torch.nn.Module):
            return "model"
        if isinstance(obj, torch.optim.Optimizer):
            return "optimizer"
        if isinstance(obj, (DataLoader, PreparedDataLoader)):
            return "dataloader"
        if _is_scheduler(obj):
            return "scheduler"
        return "other"

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Apply the layout to `model` (`meshfit.parallel.parallelize`: place, tensor
        parallel, checkpoint, compile, then the data-parallel wrapper) and return the module
        to train.

        The weights must be initialised before: sharding a meta-device model and
        initialising the shards afterwards gives every rank the same random shard on CPU
        meshes, so a model with meta parameters is refused."""
        if self.parallel.pp > 1:
            raise ValueError(f"prepare(model) with pp={self.parallel.pp}: a pipeline layout "
                             "splits the model into stages; use "
                             "accelerator.prepare_pipeline(model, schedule=..., microbatches=...)")
        from meshfit.checkpoint.pretrained import pretrained_folder

        if self.parallel.ep > 1:
            from meshfit.parallel.ep import moe_modules
            from meshfit.parallel.layout import ModelFacts

            self.layout.check_model(ModelFacts(n_blocks=1, experts=tuple(
                m.n_experts for m in moe_modules([model]))))
        folder = pretrained_folder(model)
        if folder is None and any(p.is_meta for p in model.parameters()):
            raise ValueError("prepare(model): the model has parameters on the meta device; "
                             "materialise it (to_empty + init_weights) before prepare, or "
                             "build it with meshfit.checkpoint.pretrained.meta_model(folder) to "
                             "load a saved model into each rank's shards")
        before = dict(model.named_parameters())
        wrapped = self._prepare_module(model) if folder is None else \
            self._prepare_pretrained(model, folder)
        self._params.record(before, dict(self.runtime.unwrap(wrapped).named_parameters()))
        if self.ddp_handler is not None and isinstance(
                wrapped, torch.nn.parallel.DistributedDataParallel):
            self.ddp_handler.register_comm_hook(wrapped)
        if self.sync_each_batch == "auto":
            self._decide_sync_each_batch(wrapped)
        self._models.append(wrapped)
        self._checkpointed_models.append(wrapped)
        return wrapped

    def _prepare_pretrained(self, model: torch.nn.Module, folder: str) -> torch.nn.Module:
        """A meta-device model marked by `meshfit.checkpoint.pretrained.meta_model`: under FSDP2
        (ZeRO-2/3, and every layout with tensor parallel) it is laid out on the meta device
        and each rank then reads only its shard of every tensor; under the layouts that keep
        whole parameters on every rank (one process, DDP, ZeRO-1) each rank reads them
        whole, then the model is laid out as usual."""
        from meshfit.checkpoint.pretrained import load_into, to_empty

        buffers = {n: b.detach().clone() for n, b in model.named_buffers() if not b.is_meta}
        if not self.layout.is_fsdp:
            to_empty(model, self.device)
            load_into(model, folder, buffers=buffers)
            return self._prepare_module(model)
        wrapped = self._prepare_module(model)
        inner = self.runtime.unwrap(wrapped)
        to_empty(inner, "cpu" if self.layout.offload else self.device)
        load_into(inner, folder, buffers=buffers)
        if self.layout.offload:  # sharded parameters stay in host memory; buffers go to the device
            for module in inner.modules():
                for name, buf in module._buffers.items():
                    if buf is not None:
                        module._buffers[name] = buf.to(self.device)
        return wrapped

    def _prepare_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """`parallelize` one module (a whole model or a pipeline stage), then run its forward
        under autocast unless the engine computes in low precision itself (FSDP's policy)."""
        wrapped = parallelize(module, self.layout, self.model_options, mesh=self.mesh,
                              device=self.device)
        if not self.layout.owns_mixed_precision:
            self.precision.wrap_forward(wrapped)
        return wrapped

    def prepare_pipeline(self, model: torch.nn.Module, *, microbatches: int,
                         schedule: str = "1f1b", virtual_stages: int | None = None,
                         points=None, balance: str = "params", times=None, loss_fn=None,
                         record_timings: bool = False, init_seed: int = 0, plan=None):
        """Cut `model` into pipeline stages over ``mesh["pp"]`` and prepare this rank's.

        Returns a `meshfit.parallel.pp.Pipeline`: drive it with ``loss =
        pipeline.step(inputs, targets, scale=1/k)`` inside ``accelerator.accumulate()``
        (k = gradient_accumulation_steps), then the prepared optimizer's ``step``; evaluate
        with ``pipeline.eval_loss``. Build the optimizer afterwards on
        ``pipeline.parameters()`` and prepare it. Each stage module goes through what
        `prepare(model)` does to a model (`meshfit.parallel.parallelize`: tensor parallel on
        ``mesh["tp"]``, activation checkpointing and compile, then the data-parallel wrapper,
        which is FSDP2 for every data-parallel layout with pp: see `meshfit.parallel.layout`),
        so that DP+PP, DP+PP+TP and ZeRO+PP+TP are one call. Arguments as
        `meshfit.parallel.pp.build_pipeline` (schedules gpipe, 1f1b, interleaved_1f1b,
        zero_bubble; `microbatches` per pipeline step: the global batch is micro-batch x
        microbatches x data-parallel degree x k; `plan`: where the blocks are, default the
        built-in plan of the model's type, see `meshfit.models.plans.pipeline_plan_for`).
        Every rank passes the same full model (built from one seed) or a meta-device one
        (materialised per stage from `init_seed`); with data parallel, each data-parallel
        rank feeds its own batch. `record_timings=True` keeps every step's per-micro-batch
        timings in ``pipeline.timings`` (and synchronises CUDA around each): turn it off
        with ``pipeline.record_timings(False)`` after the steps you want to chart."""
        from meshfit.checkpoint.pretrained import stage_filler
        from meshfit.parallel.layout import ModelFacts
        from meshfit.parallel.pp import build_pipeline

        if self.parallel.pp == 1:
            raise ValueError("prepare_pipeline needs a pipeline axis: Accelerator(parallel="
                             "ParallelDims(pp=P, ...)) with P > 1; use prepare(model) otherwise")
        facts = ModelFacts.of(model, pipeline_plan=plan, tp_plan=self.model_options.tp_plan)
        self.layout.check_model(facts, schedule=schedule,
                                microbatches=microbatches, virtual_stages=virtual_stages)
        pipeline = build_pipeline(
            model, self.layout.axis_mesh(self.mesh, "pp"), schedule=schedule,
            microbatches=microbatches, virtual_stages=virtual_stages, loss_fn=loss_fn,
            points=points, balance=balance, times=times, record_timings=record_timings,
            init_seed=init_seed, parallelize=self._prepare_module, plan=plan,
            fill_stage=stage_filler(model))
        self._models.extend(pipeline.wrapped_modules)
        self._checkpointed_models.append(pipeline)
        self._pipeline_params.update(id(p) for p in pipeline.parameters())
        return pipeline

    def _decide_sync_each_batch(self, model: torch.nn.Module) -> None:
        choice, reason = self.runtime.auto_sync_each_batch(model)
        self.sync_each_batch = choice
        message = f"meshfit: sync_each_batch='auto' -> {choice}: {reason}"
        log.info(message)
        self.print(message)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> PreparedOptimizer:
        """Wrap `optimizer` so that it steps on accumulation boundaries only.

        Built before `prepare(model)` under zero_stage 2/3, its parameters are the unsharded
        ones that ``fully_shard`` replaced: a new optimizer of the same class is built over
        the sharded parameters of the same names, with the same defaults and per-group
        hyper-parameters (it must not have stepped yet; the old one keeps the old
        parameters alive until you drop it). Built after `prepare(model)`, it already holds
        the sharded parameters and is used as is. Under zero_stage 1 it becomes a
        ZeroRedundancyOptimizer of its class. Pass LR schedulers built on it to `prepare`
        too: they are moved to the new optimizer."""
        if isinstance(optimizer, PreparedOptimizer):
            return optimizer
        if self._pipeline_params and not any(id(p) in self._pipeline_params
                                             for g in optimizer.param_groups for p in g["params"]):
            raise ValueError("prepare(optimizer): none of its parameters belong to the prepared "
                             "pipeline's stages (an optimizer built before prepare_pipeline "
                             "holds the full model's); build it on pipeline.parameters()")
        inner = self.runtime.prepare_optimizer(rebuild_optimizer(optimizer, self._params))
        if inner is not optimizer:
            self._replaced[id(optimizer)] = (weakref.ref(optimizer), inner)
        prepared = PreparedOptimizer(inner, self.grad_state, self.precision.scaler,
                                     on_step=self._after_optimizer_step)
        self._optimizers.append(prepared)
        return prepared

    def _after_optimizer_step(self, optimizer: PreparedOptimizer) -> None:
        if optimizer is not self._optimizers[0]:
            return  # count each optimizer step once when several optimizers are prepared
        self._optimizer_steps += 1
        if self.empty_cache_steps and self._optimizer_steps % self.empty_cache_steps == 0:
            empty_device_cache(self.device)

    def prepare_scheduler(self, scheduler) -> PreparedScheduler:
        if isinstance(scheduler, PreparedScheduler):
            return scheduler
        entry = self._replaced.get(id(getattr(scheduler, "optimizer", None)))
        if entry is not None and entry[0]() is scheduler.optimizer:
            repoint_scheduler(scheduler, entry[1])  # built on an optimizer prepare replaced
        per_step = 1 if self.split_batches or not self.step_scheduler_per_process \
            else self.runtime.dp_size
        prepared = PreparedScheduler(scheduler, self._optimizers, self.grad_state,
                                     with_optimizer=self.step_scheduler_with_optimizer,
                                     steps_per_optimizer_step=per_step)
        self._schedulers.append(prepared)
        return prepared

    def prepare_dataloader(self, loader: DataLoader) -> PreparedDataLoader:
        if isinstance(loader, PreparedDataLoader):
            return loader
        config = self.dataloader_config
        prepared = PreparedDataLoader(loader, device=self.device,
                                      num_replicas=self.runtime.dp_size,
                                      rank=self.runtime.dp_rank, on_iter=self._set_active_loader,
                                      on_end=self._end_active_loader,
                                      even_batches=config.even_batches,
                                      split_batches=config.split_batches,
                                      seedable=config.use_seedable_sampler,
                                      data_seed=config.data_seed,
                                      sync_generator="generator" in self.rng_types)
        self._loaders.append(prepared)
        return prepared

    @property
    def _active_loader(self) -> PreparedDataLoader | None:
        return self.grad_state.active_dataloader

    def _set_active_loader(self, loader: PreparedDataLoader) -> None:
        # Accelerate's loaders synchronise these global generators at each pass's start.
        if self.env.is_distributed and self.env.world_size > 1:
            if "torch" in self.rng_types:
                torch.set_rng_state(_broadcast_cpu(torch.get_rng_state()))
            if "cuda" in self.rng_types and self.device.type == "cuda":
                torch.cuda.set_rng_state(_broadcast_cpu(torch.cuda.get_rng_state()))
        self.grad_state.loaders.append(loader)

    def _end_active_loader(self, loader: PreparedDataLoader) -> None:
        # An evaluation loader read out inside a training epoch hands the boundary back to
        # the training loader (left as it was, its read-out state made every following
        # micro-batch an optimizer step).
        loaders = self.grad_state.loaders
        for i in range(len(loaders) - 1, -1, -1):
            if loaders[i] is loader:
                del loaders[i]
                break

    def unwrap_model(self, model: torch.nn.Module, keep_fp32_wrapper: bool = True,
                     keep_torch_compile: bool = True) -> torch.nn.Module:
        """The user's original module, without the data-parallel wrapper (under FSDP2 the
        module itself: its parameters stay sharded DTensors; use `get_state_dict`).
        `keep_torch_compile=False` also removes a whole-model ``torch.compile`` wrapper;
        `keep_fp32_wrapper` is accepted (meshfit's autocast wrapper is part of the
        module)."""
        module = self.runtime.unwrap(model)
        if not keep_torch_compile and hasattr(module, "_orig_mod"):
            module = module._orig_mod
        return module

    # ----------------------------------------------------------------- checkpoints
    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and load these objects (anything with ``state_dict`` and
        ``load_state_dict``) with `save_state` / `load_state`, in the order registered."""
        for obj in objects:
            if not (callable(getattr(obj, "state_dict", None))
                    and callable(getattr(obj, "load_state_dict", None))):
                raise ValueError(f"register_for_checkpointing: {type(obj).__name__} has no "
                                 "state_dict() and load_state_dict(); register objects that do")
            self._custom.append(obj)

    def save_state(self, output_dir: str | os.PathLike | None = None,
                   safe_serialization: bool = True, *, step: int | None = None,
                   async_save: bool = False, **save_model_func_kwargs) -> Path:
        """Write everything prepared (models or pipelines, optimizers, schedulers, data
        loaders' positions, the fp16 scaler, each rank's random generators, the step
        counters) and everything registered into `output_dir`, as a sharded checkpoint
        (`torch.distributed.checkpoint`: each rank writes its own shards) committed
        atomically with a manifest. With ``ProjectConfiguration(automatic_checkpoint_naming=
        True)`` the folder is ``project_dir/checkpoints/checkpoint_<save_iteration>`` (the
        oldest beyond ``total_limit`` are deleted) and `output_dir` is ignored, as with
        Accelerate. `async_save=True` copies the state to host memory and writes it in the
        background while training goes on; it is committed by `wait_for_checkpoint` (or the
        next save, `load_state`, `end_training`). Call on every rank; see
        `meshfit.accelerator.state`. `safe_serialization` is accepted (the format is
        always DCP's)."""
        from meshfit.accelerator.state import save_state

        config = self.project_configuration
        if config.automatic_checkpoint_naming:
            output_dir = self._automatic_checkpoint_folder()
        elif output_dir is None:
            raise ValueError("save_state() needs an output_dir (or ProjectConfiguration("
                             "automatic_checkpoint_naming=True))")
        folder = save_state(self, output_dir, step=step, async_save=async_save)
        config.iteration += 1
        return folder

    def _automatic_checkpoint_folder(self) -> Path:
        import re
        import shutil

        config = self.project_configuration
        if config.project_dir is None:
            raise ValueError("automatic_checkpoint_naming needs a project_dir")
        root = Path(config.project_dir) / "checkpoints"

        def number(path: Path) -> int:
            found = re.findall(r"(\d+)", path.name)
            return int(found[-1]) if found else -1

        if self.is_main_process:
            root.mkdir(parents=True, exist_ok=True)
            folders = sorted((p for p in root.iterdir() if p.is_dir()), key=number)
            if config.total_limit is not None and len(folders) + 1 > config.total_limit:
                for old in folders[: len(folders) + 1 - config.total_limit]:
                    shutil.rmtree(old)
        folder = root / f"checkpoint_{config.iteration}"
        if folder.exists():
            raise ValueError(f"Checkpoint directory {folder} ({config.iteration}) already "
                             "exists. Please manually override `self.save_iteration` with what "
                             "iteration to start with.")
        self.wait_for_everyone()
        return folder

    @property
    def checkpoint_in_flight(self) -> Path | None:
        """The temporary folder an asynchronous `save_state` is writing (None: none)."""
        return None if self._pending_save is None else self._pending_save[0]

    def wait_for_checkpoint(self) -> Path | None:
        """Commit an asynchronous `save_state` once its files are written (a collective);
        returns its folder (None when no save was in flight)."""
        from meshfit.accelerator.state import finish_save

        return finish_save(self)

    def load_state(self, input_dir: str | os.PathLike | None = None,
                   load_kwargs: dict | None = None, **load_model_func_kwargs):
        """Restore what `save_state` wrote, into the objects prepared (and registered) in the
        same order, whatever the layout and number of processes that saved it; returns the
        checkpoint's manifest. Call on every rank after preparing everything.

        As with Accelerate, prepared data loaders are left as they are (a resuming script
        skips batches itself with `skip_first_batches`), unless the loaders are stateful
        (``DataLoaderConfiguration(use_stateful_dataloader=True)``): then each continues
        where it stood, in the same order. `input_dir` None: the newest
        ``project_dir/checkpoints/checkpoint_<i>`` (automatic_checkpoint_naming)."""
        from meshfit.accelerator.state import load_state

        if input_dir is None:
            if not self.project_configuration.automatic_checkpoint_naming:
                raise ValueError("No input_dir provided and automatic checkpoint naming is "
                                 "disabled.")
            import re

            root = Path(self.project_dir) / "checkpoints"
            folders = [p for p in root.iterdir() if p.is_dir() and re.search(r"\d+", p.name)]
            if not folders:
                raise ValueError(f"load_state(): {root} holds no checkpoint")
            input_dir = max(folders, key=lambda p: int(re.findall(r"(\d+)", p.name)[-1]))
        return load_state(self, Path(input_dir).expanduser(),
                          loaders=self.use_stateful_dataloader)

    def skip_first_batches(self, dataloader: PreparedDataLoader, num_batches: int = 0):
        """The prepared `dataloader`, whose next iteration leaves out its first `num_batches`
        batches (of every rank), its order drawn as for a whole pass; as Accelerate's, for
        a script resuming inside an epoch. (Stateful loaders are already positioned by
        `load_state`; calling this with the same count changes nothing.)"""
        if not isinstance(dataloader, PreparedDataLoader):
            raise ValueError("skip_first_batches takes a dataloader returned by prepare()")
        dataloader.skip_first_batches(num_batches)
        return dataloader

    # ----------------------------------------------------------------- export
    def get_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's state dict, on CPU, on the main process; ``{}`` on the others.

        Call it on every rank: under zero_stage 2/3 it is a collective (each parameter is
        all-gathered, `torch.distributed.checkpoint`'s get_model_state_dict with
        full_state_dict=True, cpu_offload=True, which fills rank 0 only). Names are the
        user's module's (no DDP/FSDP/compile prefixes), values fp32 master weights; it loads
        into a plain single-device model with ``load_state_dict``. A `Pipeline` gives the
        whole model's dict too (every stage's part, gathered to rank 0). Like Accelerate's method
        of that name, except that Accelerate returns the dict on every rank under DDP."""
        from meshfit.parallel.pp import Pipeline

        if isinstance(model, Pipeline):
            return model.full_state_dict()
        return self.runtime.full_state_dict(model)

    def save_model(self, model: torch.nn.Module, save_directory: str | os.PathLike) -> Path:
        """Write `get_state_dict(model)` to ``save_directory/model.safetensors`` from the main
        process (atomically: a temporary file, then os.replace); call on every rank.
        Tensors sharing storage (tied weights) are written as separate copies, which
        safetensors requires; both names load back into the tied model. A
        `save_directory` that is a file (or lies under one) is refused on every rank, before
        anything is gathered or written."""
        folder = Path(save_directory)
        blocked = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()),
                       None) if self.is_main_process else None
        flag = torch.tensor([0 if blocked is None else 1], device=self.device)
        if self.env.is_distributed:  # the main process's file system decides for everyone
            torch.distributed.broadcast(flag, src=0)
        if flag.item():
            where = f"{str(blocked)!r} is a file" if blocked is not None else \
                "it is a file, or lies under one, on the main process"
            raise ValueError(f"save_model: save_directory={str(folder)!r} cannot be a folder: "
                             f"{where}; give a folder path")
        state = self.get_state_dict(model)
        path = folder / "model.safetensors"
        if self.is_main_process:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_safetensors(state, path)
        self.wait_for_everyone()
        return path

    # ----------------------------------------------------------------- training step
    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """``loss.backward()``, divided by the accumulation steps and scaled for fp16."""
        loss = loss / self.grad_state.num_steps
        if self.precision.scaler is not None:
            loss = self.precision.scaler.scale(loss)
        loss.backward(**kwargs)

    @contextlib.contextmanager
    def accumulate(self, *models: torch.nn.Module):
        """One micro-batch of gradient accumulation: gradients sync only on the k-th one
        and on the data loader's last (with sync_each_batch=True, on every one: see the
        constructor)."""
        self._advance_micro_step()
        with contextlib.ExitStack() as stack:
            if not self.grad_state.sync_gradients and self.sync_each_batch is not True:
                for model in models:
                    stack.enter_context(self.runtime.no_sync(model))
            yield

    def _advance_micro_step(self) -> None:
        # Accelerate's rule: the last batch of the innermost loader ends the window and
        # restarts the count; otherwise every num_steps-th micro-batch does.
        state = self.grad_state
        if state.sync_with_dataloader and state.end_of_dataloader:
            state.step = 0
            state.sync_gradients = True
        else:
            state.step += 1
            state.sync_gradients = state.step % state.num_steps == 0

    def no_sync(self, model: torch.nn.Module):
        """Skip gradient synchronisation for the enclosed forward *and* backward."""
        return self.runtime.no_sync(model)

    def autocast(self, autocast_handler: AutocastKwargs | None = None):
        """The mixed-precision context (prepared models already run their forward in it);
        `autocast_handler` overrides the constructor's AutocastKwargs."""
        return self.precision.autocast(**({} if autocast_handler is None
                                          else autocast_handler.to_kwargs()))

    def unscale_gradients(self, optimizer=None) -> None:
        """Divide the fp16 loss scale out of the gradients (once per optimizer step) of
        `optimizer` (one or a list; default: every prepared one)."""
        if self.precision.scaler is None or not self.grad_state.sync_gradients:
            return
        chosen = self._optimizers if optimizer is None else (
            list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer])
        for opt in chosen:
            if not isinstance(opt, PreparedOptimizer):
                opt = next((o for o in self._optimizers if o.optimizer is opt), None)
                if opt is None:
                    continue
            if not opt.unscaled:
                self.precision.scaler.unscale_(opt.optimizer)
                opt.unscaled = True

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2.0
                        ) -> torch.Tensor:
        """Clip the (unscaled, synchronised) gradients' total norm; returns the norm.

        Works on sharded (DTensor) gradients: the norm is completed across the shards, and
        gradients on different meshes are combined per mesh (`meshfit.parallel.clip`).
        Pass a `Pipeline` (from `prepare_pipeline`) to clip the whole pipelined model."""
        self.unscale_gradients()
        from meshfit.parallel.pp import Pipeline

        if isinstance(parameters, Pipeline):  # every stage's part of the norm
            return parameters.clip_grad_norm_(max_norm, norm_type=norm_type)
        return clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters, clip_value: float) -> None:
        """Clamp every (unscaled, synchronised) gradient to [-clip_value, clip_value]."""
        self.unscale_gradients()
        from meshfit.parallel.pp import Pipeline

        if isinstance(parameters, Pipeline):
            parameters = parameters.parameters()
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    # ----------------------------------------------------------------- collectives
    def gather(self, tensor: Any) -> Any:
        """Concatenate tensors (a nest of them) from every data-parallel rank along dim 0,
        in rank order; 0-dim tensors give one row per rank. Tensors may differ in their
        first dimension. Tensors that require grad are gathered as values (the result does
        not require grad), as with Accelerate."""
        if not is_all_tensors(tensor):
            raise TypeError("gather: unsupported types in the data; it takes tensors or nested "
                            "lists/tuples/dicts of tensors (gather_object for the rest)")
        return ops.gather(ops.apply_to_tensors(lambda t: t.detach(), tensor),
                          self.runtime.dp_group)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """`gather` (or, for objects that are not tensors or with `use_gather_object`,
        `meshfit.utils.gather_object`), minus the samples that completed the data loader's
        last round: on its last batch only the first ``gradient_state.remainder`` gathered
        items are kept."""
        use_gather_object = use_gather_object or not is_all_tensors(input_data)
        if use_gather_object:
            data = _gather_object(input_data, group=self.runtime.dp_group) \
                if self.runtime.dp_size > 1 else input_data
        else:
            data = self.gather(input_data)
        state = self.grad_state
        if not state.end_of_dataloader or state.remainder <= 0:
            return data
        keep = state.remainder
        if use_gather_object:
            return data[:keep]
        return ops.apply_to_tensors(lambda t: t[:keep], data)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """All-reduce tensors (a nest of them) over the data-parallel ranks: ``"sum"``,
        ``"mean"``, ``"max"``, ``"min"`` or ``"none"`` (a copy); returns new tensors.
        `scale` is applied by Accelerate on TPUs only, and ignored here likewise."""
        if reduction == "none":
            return ops.apply_to_tensors(lambda t: t.clone(), tensor)
        return ops.reduce(tensor, reduction, self.runtime.dp_group)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0,
                             pad_first: bool = False) -> Any:
        """Pad each tensor along `dim` to the largest size any data-parallel rank holds."""
        return pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first,
                                    group=self.runtime.dp_group)

    @contextlib.contextmanager
    def split_between_processes(self, inputs, apply_padding: bool = False):
        """This data-parallel rank's contiguous share of `inputs` (a list, tuple, tensor or
        a dict of them; the first ranks take one more when it does not divide), padded with
        the last item to equal length if `apply_padding`."""
        n, rank = self.runtime.dp_size, self.runtime.dp_rank
        if n == 1:
            yield inputs
            return
        length = len(inputs)
        if isinstance(inputs, dict):
            length = len(inputs[next(iter(inputs))])
            if not all(len(v) == length for v in inputs.values()):
                raise ValueError("All values in the dictionary must have the same length")
        per, extra = divmod(length, n)
        start = rank * per + min(rank, extra)
        end = start + per + (1 if rank < extra else 0)
        longest = per + (1 if extra > 0 else 0)

        def split(values):
            if isinstance(values, (list, tuple, torch.Tensor)):
                part = values[start:end]
                if apply_padding:
                    if isinstance(part, torch.Tensor):
                        fill = values[-1:].to(self.device).expand(
                            longest - len(part), *values.shape[1:])
                        part = torch.cat([part.to(self.device), fill])
                    else:
                        part = part + type(part)([values[-1]] * (longest - len(part)))
                return part
            if isinstance(values, dict):
                return {k: split(v) for k, v in values.items()}
            return values

        yield split(inputs)

    def set_trigger(self) -> None:
        """Mark this process: the next `check_trigger` on every process returns True."""
        self.flag_tensor = torch.tensor(1, device=self.device)

    def check_trigger(self) -> bool:
        """Whether any process called `set_trigger` since the last check (a collective over
        every process; the mark is cleared)."""
        if self.flag_tensor is None:
            self.flag_tensor = torch.tensor(0, device=self.device)
        flag = self.flag_tensor.clone()
        if self.env.is_distributed and self.env.world_size > 1:
            dist.all_reduce(flag)
        if flag.item() >= 1:
            self.flag_tensor = torch.tensor(0, device=self.device)
            return True
        return False

    def wait_for_everyone(self) -> None:
        if self.env.is_distributed:
            from meshfit.distributed.settle import barrier

            barrier()

    @contextlib.contextmanager
    def main_process_first(self):
        """The main process runs the block first (e.g. to build a cache), then the others."""
        if not self.is_main_process:
            self.wait_for_everyone()
        yield
        if self.is_main_process:
            self.wait_for_everyone()

    @contextlib.contextmanager
    def local_main_process_first(self):
        """Each node's first process runs the block first, then that node's others."""
        if not self.is_local_main_process:
            self.wait_for_everyone()
        yield
        if self.is_local_main_process:
            self.wait_for_everyone()

    @staticmethod
    def _on(run: bool, function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            if run:
                return function(*args, **kwargs)
            return None
        return wrapper

    def on_main_process(self, function=None):
        """Decorator: run `function` on the main process only (None elsewhere)."""
        if function is None:
            return functools.partial(self.on_main_process)
        return self._on(self.is_main_process, function)

    def on_local_main_process(self, function=None):
        if function is None:
            return functools.partial(self.on_local_main_process)
        return self._on(self.is_local_main_process, function)

    def on_last_process(self, function):
        return self._on(self.is_last_process, function)

    def on_process(self, function=None, process_index: int | None = None):
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        return self._on(self.process_index == process_index, function)

    def on_local_process(self, function=None, local_process_index: int | None = None):
        if function is None:
            return functools.partial(self.on_local_process,
                                     local_process_index=local_process_index)
        return self._on(self.local_process_index == local_process_index, function)

    @contextlib.contextmanager
    def profile(self, profile_handler: ProfileKwargs | None = None):
        """``torch.profiler.profile`` around the block (yields the profiler), configured by
        `profile_handler` or the constructor's `ProfileKwargs`; with ``output_trace_dir``
        each process writes ``profile_<rank>.json`` (a Chrome trace) there."""
        handler = profile_handler or self.profile_handler or ProfileKwargs()
        with handler.build() as profiler:
            yield profiler
        if handler.output_trace_dir is None:
            return
        os.makedirs(handler.output_trace_dir, exist_ok=True)
        profiler.export_chrome_trace(os.path.join(handler.output_trace_dir,
                                                  f"profile_{self.process_index}.json"))
        self.wait_for_everyone()

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables, even_batches: bool | None = None):
        """Train or evaluate on data loaders whose ranks hold different numbers of batches
        (``even_batches=False``) with ``torch.distributed.algorithms.Join``; `even_batches`
        overrides the prepared loaders' setting inside the block. Under DDP, on GPUs and (unlike
        Accelerate, where it does nothing there) on CPUs."""
        from torch.distributed.algorithms import Join

        if not self.use_distributed or self.distributed_type == DistributedType.FSDP:
            if self.use_distributed:
                warnings.warn("meshfit: join_uneven_inputs acts under DDP only; no effect here",
                              UserWarning, stacklevel=3)
            yield joinables
            return
        saved = []
        if even_batches is not None:
            for loader in self._loaders:
                if loader.batch_sampler is not None:
                    saved.append((loader, loader.batch_sampler.even_batches))
                    loader.batch_sampler.even_batches = even_batches
        else:
            even_batches = self.even_batches
        try:
            with Join(joinables, enable=not even_batches, throw_on_early_termination=False):
                yield joinables
        finally:
            for loader, value in saved:
                loader.batch_sampler.even_batches = value

    def free_memory(self, *objects):
        """Forget every prepared object (models, optimizers, schedulers, loaders), collect
        garbage and empty the device cache; returns ``[None] * len(objects)`` to assign back.
        Call between two trainings with different models."""
        from meshfit.accelerator.compat import release_memory

        self.wait_for_checkpoint()
        out = release_memory(*objects)
        self._models, self._optimizers, self._schedulers = [], [], []
        self._loaders, self._checkpointed_models = [], []
        self._pipeline_params, self._replaced = set(), {}
        self._params = ParameterMap()
        self.grad_state.step = 0
        return out

    def clear(self, *objects):
        """`free_memory`."""
        return self.free_memory(*objects)

    def save(self, obj: Any, f, safe_serialization: bool = False) -> None:
        """Write `obj` to `f` once (the main process; each node's first with
        ``ProjectConfiguration(save_on_each_node=True)``): ``torch.save``, or safetensors
        for a dict of tensors with `safe_serialization`."""
        writer = self.is_local_main_process if self.project_configuration.save_on_each_node \
            else self.is_main_process
        if not writer:
            return
        if safe_serialization:
            from safetensors.torch import save_file

            save_file(obj, f, metadata={"format": "pt"})
        else:
            torch.save(obj, f)

    # ----------------------------------------------------------------- trackers
    def init_trackers(self, project_name: str, config: dict | None = None,
                      init_kwargs: dict | None = None) -> None:
        """Start the trackers of ``log_with`` on the main process (`meshfit.tracking`), and
        record `config` as the run's hyper-parameters. `init_kwargs`: ``{tracker name:
        {its keyword arguments}}``."""
        if not self.is_main_process:
            return
        from meshfit.tracking import build_trackers

        for item in self.log_with:
            if isinstance(item, str):
                self.trackers.extend(build_trackers(
                    item, project_dir=self.project_dir, logging_dir=self.logging_dir,
                    init_kwargs=init_kwargs or {}, project_name=project_name))
            else:  # a tracker object, already made by the user
                if callable(getattr(item, "start", None)):
                    item.start()
                self.trackers.append(item)
        if config is not None:
            for tracker in self.trackers:
                tracker.store_init_configuration(config)

    def get_tracker(self, name: str, unwrap: bool = False):
        """The tracker called `name` (`unwrap`: its library object: the SummaryWriter, the
        wandb run, ...); where no tracker runs (other processes), one that does nothing."""
        if self.trackers:
            for tracker in self.trackers:
                if tracker.name == name:
                    return tracker.tracker if unwrap else tracker
            raise ValueError(f"{name} is not an available tracker stored inside the "
                             "`Accelerator`.")
        return _BlankTracker(name)

    def log(self, values: dict, step: int | None = None, log_kwargs: dict | None = None) -> None:
        """Log `values` to every tracker, on the main process only. `log_kwargs`:
        ``{tracker name: {keyword arguments of its log}}``."""
        if not self.is_main_process:
            return
        for tracker in self.trackers:
            extra = (log_kwargs or {}).get(tracker.name, {})
            if extra:
                tracker.log(values, step=step, **extra)
            else:
                tracker.log(values, step=step)

    def print(self, *args, **kwargs) -> None:
        if self.is_main_process:
            print(*args, **kwargs)

    def end_training(self) -> None:
        """Finish the trackers (main process), commit a checkpoint still being written, then
        release the process group (call once at the end of the script)."""
        for tracker in self.trackers:
            tracker.finish()
        self.wait_for_checkpoint()
        if self.env.is_distributed and dist.is_initialized():
            # A barrier on every group, its Work kept by this thread: the model's DDP Reducer,
            # collected later, may own the last reference to a group, and the group's
            # destructor then waits for its gloo threads while holding the GIL
            # (meshfit.distributed.settle).
            from meshfit.distributed.settle import settle_all

            settle_all()
            dist.destroy_process_group()

    def __repr__(self) -> str:
        return (f"Accelerator(device={self.device}, num_processes={self.num_processes}, "
                f"parallel={self.parallel}, zero_stage={self.zero_stage}, "
                f"mixed_precision={self.mixed_precision!r}, "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps})")
