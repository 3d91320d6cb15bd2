"""The `Accelerator`'s arguments, translated by pure functions (`read_arguments`, then
`resolve_layout` on the job's processes) from what a script passes and the environment
variables Accelerate reads into small frozen options, one per consumer; checked before any
process group, model or file exists.

The arguments up to ``parallelism_config`` are Hugging Face Accelerate 1.15's, with its
defaults and meaning (a script written for Accelerate runs with ``accelerate`` replaced by
``meshfit`` in its imports; the objects are `meshfit.utils`'), except:
    device_placement: False on the CPU only.
    split_batches: ignored, as by Accelerate 1.15 (with a warning); use
        ``dataloader_config=DataLoaderConfiguration(split_batches=True)``.
    mixed_precision: None (``ACCELERATE_MIXED_PRECISION``, else ``"no"``), ``"no"``,
        ``"bf16"`` (autocast), ``"fp16"`` (autocast + dynamic loss scaling) or ``"fp8"``
        (Accelerate's torchao float8: bf16 autocast with ``float8=True``).
    cpu: run on the CPU (gloo) even where CUDA is available; None: ``MESHFIT_CPU``, else
        False; ``ACCELERATE_USE_CPU=true`` (``accelerate launch --cpu``) means True.
    fsdp_plugin: instead of ``parallel``/``zero_stage`` (`FullyShardedDataParallelPlugin`).
    deepspeed_plugin, torch_tp_plugin, megatron_lm_plugin, dynamo_plugin, deepspeed_plugins:
        None only (``parallel``, ``zero_stage``, ``compile`` instead).
    parallelism_config: Accelerate's ``ParallelismConfig(dp_replicate_size=, dp_shard_size=,
        tp_size=, cp_size=)``, instead of ``parallel`` (its sizes; all 1: every process on
        dp_replicate, as Accelerate); with an FSDP plugin, the plugin gives the ZeRO stage.
        ``sp_size`` > 1 (DeepSpeed's Ulysses) is refused.
    rng_types: ``"generator"`` (default: the shuffling one), ``"torch"`` or ``"cuda"``.
    log_with: tracker names (``"csv"`` too) or objects (`meshfit.accelerator.trackers`).
    dynamo_backend: ``torch.compile`` the whole prepared model with it (``"no"``: not at all).

The keyword-only ones after them are meshfit's own: `ModelOptions`' fields (activation
checkpointing, compile, ``tp_plan``, ``ddp_kwargs``: over a DistributedDataParallelKwargs
handler's), `LayoutRequest`'s (the layout, `meshfit.parallel.request`, the type of `meshfit
train`'s [parallel] too), and:
    step_scheduler_per_process: True (Accelerate's rule): each optimizer step advances a
        prepared scheduler once per data-parallel process (once when batches are split),
        because scripts size their schedules in one process's batches; False: once per
        optimizer step, for schedules that count optimizer steps (`meshfit train`).
    tf32: switch TF32 tensor cores for fp32 matrix products on or off (`set_tf32`); None
        leaves PyTorch's setting.
    empty_cache_steps: release the device allocator's cached blocks every this many optimizer
        steps (0: never), as Transformers' ``torch_empty_cache_steps``.
    parallel: the layout, decided once in the constructor (``accelerator.layout``): a
        `LayoutRequest` whole (sizes and options: then no option keyword beside it), or the
        sizes (`ParallelDims`) that the option keywords below complete; default: every
        process a DDP replica. ``dp_shard=N`` shards
        over N ranks (ZeRO); with ``dp_replicate=M``, M groups of N (HSDP); all M x N ranks
        see different data. ``tp=T`` splits every block over T ranks, with any data-parallel
        axes; ``pp=P`` cuts the model into stages (`prepare_pipeline`).
    zero_stage: 1 is applied in `prepare_optimizer` (ZeroRedundancyOptimizer). Under 2 and 3,
        and whenever tp or pp > 1 (every data-parallel stage then runs on FSDP2; 0:
        replicate-only, 1: whole gradients until the boundary), mixed precision is FSDP's
        policy instead of autocast (`meshfit.parallel.fsdp`).
    sync_each_batch: under accumulation with zero_stage 2/3, False (fewer collectives) holds
        full unsharded gradients, Ψ·4 bytes per rank, until the boundary; True
        reduce-scatters every micro-batch (sharded gradients accumulate: Ψ·4/N bytes);
        ``"auto"`` picks True when the unsharded gradients would take more than a quarter of
        the free memory (CUDA free memory, host available memory on CPU) on any rank, and logs
        the choice when the first model is prepared (the attribute then holds it). Under DDP
        and ZeRO-1 gradients are full-size anyway, so "auto" means False there.
    loss_parallel: computes the reference GPT's ``model(idx, targets)`` loss on sharded
        logits; other losses: `meshfit.parallel.tp.tp_cross_entropy`.
    env: an existing `DistEnv`; default: `meshfit.distributed.init()`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshfit.accelerator.compat.foreign import from_accelerate_arguments
from meshfit.accelerator.compat.config import (AutocastKwargs, DataLoaderConfiguration,
                                               DistributedDataParallelKwargs,
                                               FullyShardedDataParallelPlugin, GradScalerKwargs,
                                               InitProcessGroupKwargs, KwargsHandler,
                                               ProfileKwargs, ProjectConfiguration)
from meshfit.accelerator.trackers import tracker_list
from meshfit.distributed import DistEnv, ParallelDims
from meshfit.parallel.disk import check_writable
from meshfit.parallel.layout import Layout
from meshfit.parallel.options import ModelOptions
from meshfit.parallel.request import LayoutRequest
from meshfit.parallel.rules import namer, precision_problem

__all__ = ["Arguments", "HANDLER_TYPES", "Handlers", "LayoutRequest", "LoopOptions",
           "PrecisionOptions", "ProcessOptions", "UNSET", "init_kwargs", "read_arguments",
           "resolve_layout", "sort_handlers"]

UNSET = object()  # an argument not given (Accelerate's split_batches)

# Accelerate's arguments meshfit has no counterpart for: None only.
_UNAVAILABLE = ("deepspeed_plugin", "deepspeed_plugins", "torch_tp_plugin",
                "megatron_lm_plugin", "dynamo_plugin")
HANDLER_TYPES = (DistributedDataParallelKwargs, InitProcessGroupKwargs, GradScalerKwargs,
                 AutocastKwargs, ProfileKwargs)
_TRUE = ("1", "true", "yes")  # ACCELERATE_USE_CPU values that mean True
_SPLIT_BATCHES = ("Accelerator(split_batches=...) is ignored, as by Accelerate 1.15; pass "
                  "dataloader_config=DataLoaderConfiguration(split_batches=...)")


@dataclass(frozen=True, kw_only=True)
class PrecisionOptions:
    """`meshfit.accelerator.precision.Precision`'s arguments, and the TF32 switch."""

    mode: str = "no"
    scaler_kwargs: dict | None = None  # GradScalerKwargs' fields set (None: no handler)
    autocast_kwargs: dict | None = None  # AutocastKwargs' fields set (None: no handler)
    tf32: bool | None = None


@dataclass(frozen=True, kw_only=True)
class LoopOptions:
    """How the user's loop is driven: accumulation, scheduler, device cache, data loaders."""

    gradient_accumulation_steps: int = 1
    sync_with_dataloader: bool = True
    adjust_scheduler: bool = False
    step_scheduler_with_optimizer: bool = True
    step_scheduler_per_process: bool = True
    empty_cache_steps: int = 0
    rng_types: tuple[str, ...] = ("generator",)
    dataloader_config: DataLoaderConfiguration = field(default_factory=DataLoaderConfiguration)
    """The user's object itself (the Accelerator's ``even_batches`` setter changes it)."""


@dataclass(frozen=True, kw_only=True)
class ProcessOptions:
    """Device placement, and `meshfit.distributed.init`'s arguments (cpu, backend, timeout_s)."""

    device_placement: bool = True
    cpu: bool | None = None
    init_kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Handlers:
    """``kwargs_handlers`` by kind (None: not given)."""

    ddp: DistributedDataParallelKwargs | None = None
    init: InitProcessGroupKwargs | None = None
    scaler: GradScalerKwargs | None = None
    autocast: AutocastKwargs | None = None
    profile: ProfileKwargs | None = None


@dataclass(frozen=True, kw_only=True)
class Arguments:
    """Everything the Accelerator's arguments say, translated (`read_arguments`)."""

    layout: LayoutRequest
    model: ModelOptions
    precision: PrecisionOptions
    loop: LoopOptions
    process: ProcessOptions
    handlers: Handlers
    fsdp_plugin: FullyShardedDataParallelPlugin | None = None
    parallelism_config: Any = None
    """Accelerate's ParallelismConfig as given (its sizes are in `layout`)."""
    offload_dir: str | None = None
    """offload="disk": the folder each rank's optimizer state goes to (a subfolder per rank)."""
    project_configuration: ProjectConfiguration
    log_with: tuple = ()  # tracker names (lower case) and tracker objects
    warnings: tuple[str, ...] = ()  # for the caller to issue (without the "meshfit: " prefix)


# ----------------------------------------------------------------------------- the whole
def read_arguments(given: Mapping[str, Any],
                   environ: Mapping[str, str] | None = None) -> Arguments:
    """`given`: every argument of `Accelerator.__init__` by name (``env`` aside); `environ`:
    the environment variables (default ``os.environ``). Returns the translation, or raises
    the one-line error of the first argument that is wrong, in the constructor's order."""
    environ = os.environ if environ is None else environ
    given = from_accelerate_arguments(given)  # Accelerate's own objects, made meshfit's
    _check_types(given)
    steps, plugin, sync_each_batch = _accumulation(given)
    _check_loop_numbers(given)
    mixed_precision = given["mixed_precision"]
    if mixed_precision is None:  # what `accelerate launch --mixed_precision` sets, else "no"
        mixed_precision = environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    mixed_precision = str(mixed_precision)  # checked with the layout's options
    float8 = given["float8"]
    if mixed_precision == "fp8":  # Accelerate's torchao float8: float8 linears in bf16 autocast
        mixed_precision, float8 = "bf16", True
    handlers = sort_handlers(given["kwargs_handlers"])
    ddp_kwargs = given["ddp_kwargs"]
    if handlers.ddp is not None:
        ddp_kwargs = {**handlers.ddp.to_kwargs(), **(ddp_kwargs or {})}
    compiling = _dynamo(given)
    mixed_precision, offload, checkpointing = _fsdp_plugin(given, mixed_precision)
    loop = LoopOptions(
        gradient_accumulation_steps=steps,
        sync_with_dataloader=plugin.get("sync_with_dataloader", True),
        adjust_scheduler=plugin.get("adjust_scheduler", False),
        step_scheduler_with_optimizer=given["step_scheduler_with_optimizer"],
        step_scheduler_per_process=given["step_scheduler_per_process"],
        empty_cache_steps=given["empty_cache_steps"],
        dataloader_config=_dataloader_config(given["dataloader_config"]),
        rng_types=_rng_types(given["rng_types"]))
    project = _project_configuration(given["project_dir"], given["project_config"])
    log_with = tuple(tracker_list(given["log_with"]))
    layout = _layout_request(given, offload=offload, sync_each_batch=sync_each_batch,
                             mixed_precision=mixed_precision)
    model = ModelOptions(
        activation_checkpointing=checkpointing,
        activation_checkpointing_every=given["activation_checkpointing_every"],
        activation_checkpointing_policy=given["activation_checkpointing_policy"],
        **{k: given[k] for k in ("activation_checkpointing_budget", "activation_offload")},
        **compiling, float8=float8, float8_recipe=given["float8_recipe"],
        tp_plan=given["tp_plan"], ddp_kwargs=dict(ddp_kwargs or {}),
        cp_load_balance=given["cp_load_balance"])
    # ACCELERATE_USE_CPU (`accelerate launch --cpu`) means True; None is left to
    # `meshfit.distributed.init` (MESHFIT_CPU).
    use_cpu = environ.get("ACCELERATE_USE_CPU", "").strip().lower() in _TRUE
    process = ProcessOptions(device_placement=given["device_placement"],
                             cpu=True if use_cpu else given["cpu"],
                             init_kwargs=init_kwargs(handlers.init))
    precision = PrecisionOptions(
        mode=mixed_precision, tf32=given["tf32"],
        scaler_kwargs=None if handlers.scaler is None else handlers.scaler.to_kwargs(),
        autocast_kwargs=None if handlers.autocast is None else handlers.autocast.to_kwargs())
    return Arguments(layout=layout, model=model, precision=precision, loop=loop, process=process,
                     handlers=handlers, fsdp_plugin=given["fsdp_plugin"],
                     parallelism_config=given["parallelism_config"],
                     offload_dir=_offload_dir(given, layout.offload),
                     project_configuration=project, log_with=log_with,
                     warnings=() if given["split_batches"] is UNSET else (_SPLIT_BATCHES,))


def resolve_layout(arguments: Arguments, env: DistEnv) -> Layout:
    """The job's `Layout`: the request on `env`'s processes (after refusing
    ``device_placement=False`` off the CPU). As Accelerate's, the FSDP plugin shards over every
    process when there is more than one; on one process its sharding is not even read."""
    request, plugin = arguments.layout, arguments.fsdp_plugin
    if plugin is not None and env.world_size > 1:
        zero_stage = plugin.zero_stage()
        sizes = ParallelDims(dp_replicate=1, dp_shard=-1).sizes() \
            if zero_stage and arguments.parallelism_config is None else {}
        request = dataclasses.replace(request, **sizes, zero_stage=zero_stage or None)
    if not arguments.process.device_placement and env.device.type != "cpu":
        raise ValueError("Accelerator(device_placement=False) is available on the CPU only; "
                         f"this process runs on {env.device}")
    # The one decision of how this job is laid out (every rule lives in Layout).
    return Layout.resolve(request, env.world_size, distributed=env.is_distributed,
                          mixed_precision=arguments.precision.mode,
                          ddp_kwargs=arguments.model.ddp_kwargs,
                          local_world_size=env.local_world_size if env.is_distributed else None)


# ----------------------------------------------------------------------------- the parts
def _check_types(given: Mapping[str, Any]) -> None:
    for name in _UNAVAILABLE:
        if given[name] is not None:
            raise ValueError(f"Accelerator({name}=...) is not available in meshfit; lay the "
                             "job out with parallel=ParallelDims(...) and zero_stage=, or "
                             "fsdp_plugin=FullyShardedDataParallelPlugin(...); compile with "
                             "dynamo_backend= or compile=True")
    device_placement, cpu = given["device_placement"], given["cpu"]
    ddp_kwargs, project_dir = given["ddp_kwargs"], given["project_dir"]
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
    if not isinstance(given["step_scheduler_with_optimizer"], bool) or \
            not isinstance(given["step_scheduler_per_process"], bool):
        raise ValueError("step_scheduler_with_optimizer and step_scheduler_per_process must "
                         "be True or False")


def _accumulation(given: Mapping[str, Any]) -> tuple[int, dict, bool | str]:
    """(micro-batches per step, GradientAccumulationPlugin's fields set, sync_each_batch)."""
    steps, sync_each_batch = given["gradient_accumulation_steps"], given["sync_each_batch"]
    plugin = {}
    if given["gradient_accumulation_plugin"] is not None:
        if steps != 1:
            raise ValueError("You can only pass one of `gradient_accumulation_steps` and "
                             "`gradient_accumulation_plugin`. Please only pass in the "
                             "created `GradientAccumulationPlugin` object.")
        # Only the fields set to other than their defaults, read with GradientState's
        # defaults, as Accelerate reads them: adjust_scheduler (default True) reads False.
        plugin = given["gradient_accumulation_plugin"].to_kwargs()
        steps = plugin.get("num_steps", 1)
        if plugin.get("sync_each_batch", False) and sync_each_batch is False:
            sync_each_batch = True
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"gradient_accumulation_steps={steps!r} must be an integer >= 1 (1 "
                         "means no accumulation)")
    return steps, plugin, sync_each_batch


def _check_loop_numbers(given: Mapping[str, Any]) -> None:
    empty_cache_steps, tf32 = given["empty_cache_steps"], given["tf32"]
    if isinstance(empty_cache_steps, bool) or not isinstance(empty_cache_steps, int) or \
            empty_cache_steps < 0:
        raise ValueError(f"empty_cache_steps={empty_cache_steps!r} must be an integer >= 0 "
                         "(0: never)")
    if tf32 is not None and not isinstance(tf32, bool):
        raise ValueError(f"tf32={tf32!r} must be True, False or None (leave as it is)")


def sort_handlers(handlers) -> Handlers:
    """``kwargs_handlers`` by kind; one of each, of the kinds meshfit knows."""
    out: dict[type, KwargsHandler] = {}
    for handler in handlers or ():
        kind = next((k for k in HANDLER_TYPES if isinstance(handler, k)), None)
        if kind is None:
            raise ValueError(f"kwargs_handlers: {handler!r} ({type(handler).__name__}) is not "
                             "available; use "
                             f"{', '.join(k.__name__ for k in HANDLER_TYPES)}")
        if kind in out:
            # Accelerate's message names the class as it prints; meshfit's classes print
            # as where scripts import them from (they were defined there until the split).
            raise ValueError(f"You can only pass one <class 'meshfit.accelerator.compat."
                             f"{kind.__name__}'> in `kwargs_handlers`.")
        out[kind] = handler
    return Handlers(ddp=out.get(DistributedDataParallelKwargs),
                    init=out.get(InitProcessGroupKwargs), scaler=out.get(GradScalerKwargs),
                    autocast=out.get(AutocastKwargs), profile=out.get(ProfileKwargs))


def _dynamo(given: Mapping[str, Any]) -> dict[str, Any]:
    """ModelOptions' compile fields; ``dynamo_backend`` compiles the whole model with that
    backend (lower case, as Accelerate passes it to torch.compile)."""
    names = ("compile", "compile_backend", "compile_scope", "compile_mode")
    backend = given["dynamo_backend"]
    if backend is not None and str(backend).upper() != "NO":
        return dict(zip(names, (True, str(backend).lower(), "model", given["compile_mode"])))
    return {name: given[name] for name in names}


def _fsdp_plugin(given: Mapping[str, Any], mixed_precision: str) -> tuple[str, str, str]:
    """(mixed_precision, offload, activation_checkpointing) with Accelerate's FSDP plugin's
    settings applied; its sharding waits for the world size (`resolve_layout`)."""
    plugin = given["fsdp_plugin"]
    offload, checkpointing = given["offload"], given["activation_checkpointing"]
    if plugin is None:
        return mixed_precision, offload, checkpointing
    if not isinstance(plugin, FullyShardedDataParallelPlugin):
        raise TypeError("`fsdp_plugin` must be a FullyShardedDataParallelPlugin object.")
    if given["parallel"] is not None or given["zero_stage"] is not None:
        raise ValueError("Accelerator(fsdp_plugin=...) lays the job out itself; pass "
                         "either fsdp_plugin or parallel=/zero_stage=")
    wanted = plugin.mixed_precision()
    if wanted is not None and mixed_precision not in ("no", wanted):
        raise ValueError(f"mixed_precision={mixed_precision!r} and the FSDP plugin's "
                         f"mixed_precision_policy ({wanted}) disagree; give one")
    if wanted is not None:
        mixed_precision = wanted
    if plugin.offload() == "cpu":
        offload = "cpu"
    if plugin.activation_checkpointing and checkpointing == "none":
        checkpointing = "full"
    return mixed_precision, offload, checkpointing


def _dataloader_config(config: DataLoaderConfiguration | None) -> DataLoaderConfiguration:
    if config is not None and not isinstance(config, DataLoaderConfiguration):
        raise ValueError(f"dataloader_config={config!r} must be a DataLoaderConfiguration, e.g. "
                         "meshfit.utils.DataLoaderConfiguration(even_batches=False)")
    return config or DataLoaderConfiguration()


def _rng_types(rng_types) -> tuple[str, ...]:
    if isinstance(rng_types, str) or (rng_types is not None and not isinstance(
            rng_types, (list, tuple))):
        raise ValueError(f"rng_types={rng_types!r} must be a list of names, e.g. "
                         f"[{rng_types!r}] or ['generator', 'torch']")
    out = ("generator",) if rng_types is None else tuple(
        getattr(r, "value", r) if not isinstance(r, str) else r for r in rng_types)
    out = tuple(str(r) for r in out)
    unknown = sorted(set(out) - {"generator", "torch", "cuda"})
    if unknown:
        raise ValueError(f"rng_types {unknown} are not available; use 'generator', 'torch' "
                         "or 'cuda'")
    return out


def _project_configuration(project_dir, project_config) -> ProjectConfiguration:
    """`project_config` (the user's object, its directories filled in from `project_dir` as
    Accelerate fills them) or a new one."""
    config = project_config if project_config is not None \
        else ProjectConfiguration(project_dir=project_dir)
    if project_dir is not None and config.project_dir is None:
        config.set_directories(project_dir)
    return config


def _layout_request(given: Mapping[str, Any], *, offload: str, sync_each_batch: bool | str,
                    mixed_precision: str) -> LayoutRequest:
    """The layout request: the one place it is built, checked before any process group or
    model work, with the techniques' own rules (the mixed precision too, with them).
    ``parallel`` is a `LayoutRequest` whole, or the sizes (`ParallelDims`) the option
    keywords complete; Accelerate's ParallelismConfig gives sizes too."""
    options = dict(zero_stage=given["zero_stage"], offload=offload,
                   sync_each_batch=sync_each_batch, sequence_parallel=given["sequence_parallel"],
                   loss_parallel=given["loss_parallel"], offload_params=given["offload_params"])
    parallel = given["parallel"]
    if given["parallelism_config"] is not None:
        if parallel is not None:
            raise ValueError("Accelerator(parallelism_config=..., parallel=...): give the "
                             "layout once, as one or the other")
        parallel = _parallelism_dims(given["parallelism_config"])
    problem = precision_problem(mixed_precision, namer(None))
    if problem:
        raise ValueError(problem)
    if isinstance(parallel, LayoutRequest):
        return _whole_request(parallel, options, given)
    if parallel is not None and not isinstance(parallel, ParallelDims):
        raise ValueError(f"parallel={parallel!r} must be a meshfit.ParallelDims (the mesh "
                         "sizes) or a meshfit LayoutRequest (sizes and options, whole)")
    return LayoutRequest.of(parallel, **options)


def _whole_request(request: LayoutRequest, options: dict[str, Any],
                   given: Mapping[str, Any]) -> LayoutRequest:
    """``parallel=LayoutRequest(...)``: the request as given; an option keyword beside it
    would say the same thing twice (GradientAccumulationPlugin's sync_each_batch=True, which
    the keyword mirrors, is taken into it)."""
    defaults = {f.name: f.default for f in dataclasses.fields(LayoutRequest)}
    twice = [k for k, v in options.items() if k != "sync_each_batch" and v != defaults[k]]
    if given["sync_each_batch"] is not False:
        twice.append("sync_each_batch")
    if twice:
        raise ValueError(f"Accelerator(parallel=LayoutRequest(...), {twice[0]}=...): the "
                         f"request holds {twice[0]} already; set it in the request and drop "
                         "the keyword")
    if options["sync_each_batch"] is True and request.sync_each_batch is False:
        request = dataclasses.replace(request, sync_each_batch=True)
    return request


def _offload_dir(given: Mapping[str, Any], offload: str) -> str | None:
    folder = given["offload_dir"]
    if offload == "disk":
        if folder is None or not str(folder).strip():
            raise ValueError("offload='disk' needs offload_dir=PATH: a folder on a local disk "
                             "for the optimizer state (created private to the run)")
        check_writable(Path(folder).expanduser())
        return str(Path(folder).expanduser())
    if folder is not None:
        raise ValueError(f"offload_dir={str(folder)!r} is used with offload='disk' only, and "
                         f"offload={offload!r}; set offload='disk' or drop offload_dir")
    return None


def _parallelism_dims(config) -> ParallelDims:
    """The `ParallelDims` of Accelerate's ParallelismConfig (sizes None meaning 1; all 1:
    every process on dp_replicate, as Accelerate fills it in)."""
    names = {"dp_replicate": "dp_replicate_size", "dp_shard": "dp_shard_size",
             "tp": "tp_size", "cp": "cp_size"}
    if not all(hasattr(config, a) for a in names.values()):
        raise ValueError(f"parallelism_config={config!r} must be Accelerate's "
                         "ParallelismConfig (dp_replicate_size, dp_shard_size, tp_size, "
                         "cp_size)")
    if (getattr(config, "sp_size", None) or 1) > 1:
        raise ValueError(f"ParallelismConfig(sp_size={config.sp_size}) (DeepSpeed's Ulysses "
                         "sequence parallel) is not available in meshfit; split the sequence "
                         "with cp_size (ring attention) instead")
    backend = getattr(config, "cp_backend", None)
    if backend not in (None, "torch"):
        raise ValueError(f"ParallelismConfig(cp_backend={backend!r}) is not available in "
                         "meshfit; leave it unset (meshfit's own ring attention)")
    sizes = {axis: getattr(config, attr) or 1 for axis, attr in names.items()}
    for axis, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"ParallelismConfig({names[axis]}={size!r}) must be an integer "
                             ">= 1")
    if all(size == 1 for size in sizes.values()):
        return ParallelDims()  # every process on dp_replicate
    return ParallelDims(**sizes)


def init_kwargs(handler: InitProcessGroupKwargs | None) -> dict:
    """`meshfit.distributed.init`'s arguments from an InitProcessGroupKwargs' fields set."""
    if handler is None:
        return {}
    given = handler.to_kwargs()
    if given.get("init_method") is not None:
        raise ValueError("InitProcessGroupKwargs(init_method=...) is not available: meshfit "
                         "joins the process group torchrun (meshfit launch) describes")
    out = {}
    if given.get("backend") is not None:
        out["backend"] = given["backend"]
    if given.get("timeout") is not None:
        out["timeout_s"] = given["timeout"].total_seconds()
    return out
