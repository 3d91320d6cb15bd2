"""Hugging Face Accelerate's configuration objects and helper functions, as meshfit's.

A script written for Accelerate imports these names from ``accelerate`` / ``accelerate.utils``;
with meshfit it imports them from ``meshfit`` / ``meshfit.utils`` (which re-export this
module). Names, fields, defaults and behaviour follow Accelerate 1.15; what meshfit does
with each is said where it is used (`meshfit.accelerator.Accelerator`):

    DistributedType, LoggerType, PrecisionType, RNGType, DDPCommunicationHookType,
    DynamoBackend                                     the enums (string valued)
    DataLoaderConfiguration, ProjectConfiguration,
    GradientAccumulationPlugin                        the Accelerator's configuration
    DistributedDataParallelKwargs, InitProcessGroupKwargs, GradScalerKwargs,
    AutocastKwargs, ProfileKwargs                     ``kwargs_handlers``
    FullyShardedDataParallelPlugin                    mapped onto meshfit's ZeRO-2/3 (FSDP2)
    set_seed, find_executable_batch_size, release_memory, clear_device_cache,
    gather, gather_object, broadcast, broadcast_object_list, reduce,
    pad_across_processes, send_to_device              helpers over the default process group

The collective helpers act over every process of the default process group (Accelerate's
``PartialState``); without a process group (one process) they return their input, as
Accelerate's do.
"""

from __future__ import annotations

import copy
import enum
import functools
import gc
import inspect
import random
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from meshfit.distributed.collectives import apply_to_tensors

__all__ = [
    "AutocastKwargs", "DDPCommunicationHookType", "DataLoaderConfiguration",
    "DistributedDataParallelKwargs", "DistributedType", "DynamoBackend",
    "FullyShardedDataParallelPlugin", "GradScalerKwargs", "GradientAccumulationPlugin",
    "InitProcessGroupKwargs", "KwargsHandler", "LoggerType", "PrecisionType", "ProfileKwargs",
    "ProjectConfiguration", "RNGType", "broadcast", "broadcast_object_list",
    "clear_device_cache", "find_executable_batch_size", "gather", "gather_object",
    "pad_across_processes", "reduce", "release_memory", "send_to_device", "set_seed",
    "should_reduce_batch_size",
]


# ----------------------------------------------------------------------------- enums
class _Contains(enum.EnumMeta):
    """``"bf16" in PrecisionType`` is True for a value of the enum (as Accelerate's enums)."""

    def __contains__(cls, item) -> bool:
        try:
            cls(item)
        except ValueError:
            return False
        return True


class _StrEnum(str, enum.Enum, metaclass=_Contains):
    """A string-valued enum: members compare equal to their values and print as them."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def list(cls) -> list[str]:
        return [m.value for m in cls]


class DistributedType(str, enum.Enum, metaclass=_Contains):
    """How the job is distributed (``accelerator.distributed_type``; compares equal to its
    value, prints as ``DistributedType.NO``, as Accelerate's).

    meshfit answers NO for one process, FSDP when the layout shards parameters or gradients
    (ZeRO-2/3 on FSDP2, also under tensor or pipeline parallel), and MULTI_GPU / MULTI_CPU /
    MULTI_XPU / ... after the device type otherwise (DDP, ZeRO-1)."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"


class LoggerType(_StrEnum):
    """Experiment trackers by name (``Accelerator(log_with=...)``; built by
    `meshfit.tracking`)."""

    ALL = "all"
    AIM = "aim"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    TRACKIO = "trackio"
    COMETML = "comet_ml"
    MLFLOW = "mlflow"
    CLEARML = "clearml"
    DVCLIVE = "dvclive"
    SWANLAB = "swanlab"
    CSV = "csv"  # meshfit's own: a CSV file per run


class PrecisionType(_StrEnum):
    NO = "no"
    FP8 = "fp8"
    FP16 = "fp16"
    BF16 = "bf16"


class RNGType(_StrEnum):
    TORCH = "torch"
    CUDA = "cuda"
    MLU = "mlu"
    SDAA = "sdaa"
    MUSA = "musa"
    NPU = "npu"
    XLA = "xla"
    XPU = "xpu"
    HPU = "hpu"
    NEURON = "neuron"
    GENERATOR = "generator"


class DDPCommunicationHookType(_StrEnum):
    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


class DynamoBackend(_StrEnum):
    NO = "NO"
    EAGER = "EAGER"
    AOT_EAGER = "AOT_EAGER"
    INDUCTOR = "INDUCTOR"
    AOT_TS_NVFUSER = "AOT_TS_NVFUSER"
    NVPRIMS_NVFUSER = "NVPRIMS_NVFUSER"
    CUDAGRAPHS = "CUDAGRAPHS"
    OFI = "OFI"
    FX2TRT = "FX2TRT"
    ONNXRT = "ONNXRT"
    TENSORRT = "TENSORRT"
    AOT_TORCHXLA_TRACE_ONCE = "AOT_TORCHXLA_TRACE_ONCE"
    TORCHXLA_TRACE_ONCE = "TORCHXLA_TRACE_ONCE"
    TVM = "TVM"
    HPU_BACKEND = "HPU_BACKEND"
    NEURON = "NEURON"


# ----------------------------------------------------------------------------- kwargs handlers
class KwargsHandler:
    """A dataclass whose `to_kwargs` gives the fields set to something other than their
    default (what the Accelerator passes on)."""

    def to_dict(self) -> dict:
        return copy.deepcopy(self.__dict__)

    def to_kwargs(self) -> dict:
        default = self.__class__().to_dict()
        return {k: v for k, v in self.to_dict().items() if default.get(k) != v}


@dataclass
class AutocastKwargs(KwargsHandler):
    """Arguments of ``torch.autocast`` for the prepared models' forward."""

    enabled: bool = True
    cache_enabled: Optional[bool] = None


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Arguments of ``DistributedDataParallel`` (passed as meshfit's ``ddp_kwargs``) and a
    communication hook registered on the wrapped model."""

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_state_option: dict = field(default_factory=dict)

    def to_dict(self, ignore_keys=("comm_hook", "comm_wrapper", "comm_state_option")) -> dict:
        return {k: v for k, v in super().to_dict().items() if k not in ignore_keys}

    def register_comm_hook(self, model: torch.nn.Module) -> None:
        """Register `comm_hook` (wrapped by `comm_wrapper`) on a DDP `model`."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        hooks = {DDPCommunicationHookType.FP16: default_hooks.fp16_compress_hook,
                 DDPCommunicationHookType.BF16: default_hooks.bf16_compress_hook,
                 DDPCommunicationHookType.POWER_SGD: powerSGD_hook.powerSGD_hook,
                 DDPCommunicationHookType.BATCHED_POWER_SGD: powerSGD_hook.batched_powerSGD_hook}
        wrappers = {DDPCommunicationHookType.FP16: default_hooks.fp16_compress_wrapper,
                    DDPCommunicationHookType.BF16: default_hooks.bf16_compress_wrapper}
        hook = hooks.get(DDPCommunicationHookType(self.comm_hook))
        wrapper = wrappers.get(DDPCommunicationHookType(self.comm_wrapper))
        if hook is None:
            return
        if wrapper is not None:
            hook = wrapper(hook)
        state = None
        if DDPCommunicationHookType(self.comm_hook) in (DDPCommunicationHookType.POWER_SGD,
                                                        DDPCommunicationHookType.BATCHED_POWER_SGD):
            state = powerSGD_hook.PowerSGDState(None, **self.comm_state_option)
        model.register_comm_hook(state=state, hook=hook)


@dataclass
class GradScalerKwargs(KwargsHandler):
    """Arguments of the fp16 ``torch.amp.GradScaler``."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """How the process group is created: ``backend`` ("nccl" or "gloo"; meshfit picks by
    device when left at its default) and ``timeout``. ``init_method`` is not supported
    (meshfit joins torchrun's environment)."""

    backend: Optional[str] = "nccl"
    init_method: Optional[str] = None
    timeout: Optional[timedelta] = None

    def __post_init__(self) -> None:
        if self.timeout is None:
            self.timeout = timedelta(seconds=1800 if self.backend != "nccl" else 600)


@dataclass
class ProfileKwargs(KwargsHandler):
    """``torch.profiler.profile`` for `Accelerator.profile`; `output_trace_dir` receives a
    Chrome trace per process (``profile_<rank>.json``)."""

    activities: Optional[list] = None
    schedule_option: Optional[dict] = None
    on_trace_ready: Optional[Callable] = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: Optional[str] = None

    def _activity(self, name: str):
        known = {"cpu": torch.profiler.ProfilerActivity.CPU,
                 "cuda": torch.profiler.ProfilerActivity.CUDA}
        if hasattr(torch.profiler.ProfilerActivity, "XPU") and hasattr(torch, "xpu") \
                and torch.xpu.is_available():
            known["xpu"] = torch.profiler.ProfilerActivity.XPU
        if name not in known:
            raise ValueError(f"Invalid profiler activity: {name}. Must be one of {list(known)}.")
        return known[name]

    def build(self) -> torch.profiler.profile:
        activities = None if self.activities is None else [self._activity(a)
                                                           for a in self.activities]
        schedule = None if self.schedule_option is None else \
            torch.profiler.schedule(**self.schedule_option)
        return torch.profiler.profile(
            activities=activities, schedule=schedule, on_trace_ready=self.on_trace_ready,
            record_shapes=self.record_shapes, profile_memory=self.profile_memory,
            with_stack=self.with_stack, with_flops=self.with_flops,
            with_modules=self.with_modules)


# ----------------------------------------------------------------------------- configuration
@dataclass
class DataLoaderConfiguration:
    """How `Accelerator.prepare` shards data loaders (Accelerate's fields and defaults).

    split_batches: False: every process receives batches of the loader's batch_size (the
        global batch is batch_size x processes); True: the loader's batch is the global one,
        cut into equal slices (batch_size must divide by the number of processes).
    dispatch_batches: None or False (True is not supported: every meshfit rank reads its own
        batches; for an IterableDataset, see `meshfit.accelerator.loader`).
    even_batches: True: when the global batch does not divide the dataset, the last round is
        completed with samples from the start of the epoch so that every process gets the
        same number of full batches; False: the short last batch goes to its process alone.
    use_seedable_sampler, data_seed: shuffle each epoch with a generator seeded
        ``data_seed + epoch`` (``data_seed`` None: ``torch.initial_seed()`` when prepared),
        instead of a generator carried from epoch to epoch.
    non_blocking: accepted (meshfit copies batches to CUDA devices ahead, non-blocking,
        whatever the value).
    use_stateful_dataloader: `load_state` puts every prepared loader back where it was (its
        epoch, shuffle and position, on any number of processes); False (Accelerate's
        default): `load_state` leaves loaders as they are and a script skips batches itself
        (`skip_first_batches`).
    """

    split_batches: bool = False
    dispatch_batches: Optional[bool] = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: Optional[int] = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False


@dataclass
class ProjectConfiguration:
    """Where a run writes: ``project_dir``, ``logging_dir`` (trackers; default project_dir);
    ``automatic_checkpoint_naming`` makes `save_state()` write
    ``project_dir/checkpoints/checkpoint_<iteration>`` keeping at most ``total_limit``."""

    project_dir: Optional[str] = None
    logging_dir: Optional[str] = None
    automatic_checkpoint_naming: bool = False
    total_limit: Optional[int] = None
    iteration: int = 0
    save_on_each_node: bool = False

    def set_directories(self, project_dir: Optional[str] = None) -> None:
        self.project_dir = project_dir
        if self.logging_dir is None:
            self.logging_dir = project_dir

    def __post_init__(self) -> None:
        self.set_directories(self.project_dir)


@dataclass
class GradientAccumulationPlugin(KwargsHandler):
    """Gradient accumulation: ``num_steps`` micro-batches per optimizer step;
    ``sync_with_dataloader``: also step at the end of each data loader;
    ``sync_each_batch``: synchronise gradients on every micro-batch (meshfit's
    ``sync_each_batch``). ``adjust_scheduler`` has no effect on learning rates (as in
    Accelerate, where it only counts the scheduler's internal step counter)."""

    num_steps: Optional[int] = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False


@dataclass
class FullyShardedDataParallelPlugin:
    """Accelerate's FSDP plugin, mapped onto meshfit's FSDP2 layouts.

    Every process shards the model (``ParallelDims(dp_shard=world)``): ``reshard_after_forward``
    True / ``sharding_strategy`` "FULL_SHARD" (the default) is ZeRO-3, False /
    "SHARD_GRAD_OP" is ZeRO-2, "NO_SHARD" is DDP; "HYBRID_SHARD" is refused (use
    ``Accelerator(parallel=ParallelDims(dp_replicate=R, dp_shard=S))``). ``cpu_offload``
    keeps the shards in host memory (ZeRO-3 only); ``activation_checkpointing`` recomputes
    every transformer block; ``mixed_precision_policy`` "bf16"/"fp16" (or a dict/object
    whose param_dtype is one) sets the Accelerator's mixed precision. Wrapping is meshfit's
    own (per transformer block); the other fields are accepted and have no effect.
    """

    fsdp_version: Optional[int] = None
    sharding_strategy: Any = None
    reshard_after_forward: Any = None
    backward_prefetch: Any = None
    mixed_precision_policy: Any = None
    auto_wrap_policy: Any = None
    cpu_offload: Any = None
    ignored_modules: Any = None
    state_dict_type: Any = None
    state_dict_config: Any = None
    optim_state_dict_config: Any = None
    limit_all_gathers: bool = True
    use_orig_params: Optional[bool] = None
    param_init_fn: Optional[Callable] = None
    sync_module_states: Optional[bool] = None
    forward_prefetch: Optional[bool] = None
    activation_checkpointing: Optional[bool] = None
    cpu_ram_efficient_loading: Optional[bool] = None
    transformer_cls_names_to_wrap: Optional[list] = None
    min_num_params: Optional[int] = None

    def zero_stage(self) -> int:
        """The ZeRO stage this plugin asks for: 3, 2, or 0 (no sharding)."""
        strategy = self.reshard_after_forward
        if strategy is None:
            strategy = self.sharding_strategy
        if strategy is None or strategy is True:
            return 3
        if strategy is False:
            return 2
        name = str(getattr(strategy, "name", strategy)).upper()
        if name.isdigit():  # Accelerate's numbered strategies: 1 FULL_SHARD, 2 SHARD_GRAD_OP, ...
            name = {"1": "FULL_SHARD", "2": "SHARD_GRAD_OP", "3": "NO_SHARD",
                    "4": "HYBRID_SHARD", "5": "HYBRID_SHARD_ZERO2"}.get(name, name)
        stages = {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2, "NO_SHARD": 0}
        if name not in stages:
            raise ValueError(f"FullyShardedDataParallelPlugin: sharding {name} is not available; "
                             "use FULL_SHARD, SHARD_GRAD_OP or NO_SHARD, or "
                             "Accelerator(parallel=ParallelDims(dp_replicate=R, dp_shard=S)) "
                             "for hybrid sharding")
        return stages[name]

    def offload(self) -> str:
        policy = self.cpu_offload
        on = bool(getattr(policy, "offload_params", True)) if policy not in (None, False) \
            else False
        return "cpu" if on else "none"

    def mixed_precision(self) -> Optional[str]:
        """"bf16", "fp16" or None (not set by the plugin)."""
        policy = self.mixed_precision_policy
        if policy is None:
            return None
        dtype = policy if isinstance(policy, (str, torch.dtype)) else (
            policy.get("param_dtype") if isinstance(policy, dict)
            else getattr(policy, "param_dtype", None))
        names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "no",
                 "bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16",
                 "fp32": "no", "float32": "no", None: None}
        key = dtype if not isinstance(dtype, str) else dtype.replace("torch.", "")
        if key not in names:
            raise ValueError(f"FullyShardedDataParallelPlugin: mixed_precision_policy "
                             f"{policy!r} is not available; use 'bf16', 'fp16' or 'fp32'")
        return names[key]


# ----------------------------------------------------------------------------- seeds, memory
def _process_index() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _num_processes() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed Python's `random`, NumPy and torch (CPU and every accelerator); with
    ``device_specific`` each process adds its rank; ``deterministic`` turns on
    ``torch.use_deterministic_algorithms``."""
    if device_specific:
        seed += _process_index()
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    torch.manual_seed(seed)
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        torch.xpu.manual_seed_all(seed)
    else:
        torch.cuda.manual_seed_all(seed)  # safe without CUDA
    if deterministic:
        torch.use_deterministic_algorithms(True)


def clear_device_cache(garbage_collection: bool = False) -> None:
    """Return the device allocator's cached blocks (and collect garbage first if asked)."""
    if garbage_collection:
        gc.collect()
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        torch.xpu.empty_cache()
    elif torch.backends.mps.is_available():
        torch.mps.empty_cache()
    elif torch.cuda.is_available():
        torch.cuda.empty_cache()


def release_memory(*objects) -> list:
    """``[None] * len(objects)`` after collecting garbage and emptying the device cache:
    ``a, b = release_memory(a, b)``."""
    objects = [None for _ in objects]
    clear_device_cache(garbage_collection=True)
    return objects


_OOM_MESSAGES = (" out of memory.", "MPS backend out of memory",
                 "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
                 "DefaultCPUAllocator: can't allocate memory",
                 "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed")


def should_reduce_batch_size(exception: Exception) -> bool:
    """Whether `exception` is an out-of-memory error (CUDA, XPU, MPS, CPU) or cuDNN's
    not-supported error, after which a smaller batch may run."""
    if isinstance(exception, RuntimeError) and len(exception.args) == 1:
        return any(m in str(exception.args[0]) for m in _OOM_MESSAGES)
    return False


def find_executable_batch_size(function: Optional[Callable] = None, starting_batch_size: int = 128,
                               reduce_batch_size_fn: Optional[Callable] = None):
    """Decorator: call ``function(batch_size, *args, **kwargs)`` from `starting_batch_size`,
    and after an out-of-memory error again with ``int(batch_size * 0.9)`` (or what
    ``reduce_batch_size_fn()`` returns) until it runs; RuntimeError at 0. Accelerate's
    decorator; for one that keeps the effective batch with accumulation see
    `meshfit.train.batch_size.find_executable_batch_size`."""
    if function is None:
        return functools.partial(find_executable_batch_size, starting_batch_size=starting_batch_size,
                                 reduce_batch_size_fn=reduce_batch_size_fn)
    batch_size = starting_batch_size
    if reduce_batch_size_fn is None:
        def reduce_batch_size_fn():
            nonlocal batch_size
            batch_size = int(batch_size * 0.9)
            return batch_size

    @functools.wraps(function)
    def decorator(*args, **kwargs):
        nonlocal batch_size
        clear_device_cache(garbage_collection=True)
        params = list(inspect.signature(function).parameters)
        if len(params) < len(args) + 1:
            given = ", ".join(f"{p}={v}" for p, v in zip(params[1:], args[1:]))
            raise TypeError(f"Batch size was passed into `{function.__name__}` as the first "
                            "argument when called. Remove this as the decorator already does "
                            f"so: `{function.__name__}({given})`")
        while True:
            if batch_size == 0:
                raise RuntimeError("No executable batch size found, reached zero.")
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as err:  # noqa: BLE001 - only out-of-memory is retried
                if not should_reduce_batch_size(err):
                    raise
                clear_device_cache(garbage_collection=True)
                batch_size = reduce_batch_size_fn()

    return decorator


# ----------------------------------------------------------------------------- collectives
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def is_all_tensors(obj: Any) -> bool:
    """Whether every leaf of a nest of lists, tuples and dicts is a tensor."""
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, (list, tuple)):
        return all(is_all_tensors(o) for o in obj)
    if isinstance(obj, dict):
        return all(is_all_tensors(o) for o in obj.values())
    return False


def _check_tensors(obj: Any, what: str) -> None:
    if not is_all_tensors(obj):
        raise TypeError(f"{what}: unsupported types in the data; it takes tensors or nested "
                        "lists/tuples/dicts of tensors")


def gather(tensor: Any, group=None) -> Any:
    """Concatenate tensors (a nest of them) from every process along dim 0, in rank order
    (0-dim tensors become one row each). Tensors that require grad are gathered as plain
    values (no autograd through the collective)."""
    from meshfit.distributed import collectives as ops

    _check_tensors(tensor, "gather")
    if not _distributed():
        return tensor
    return ops.gather(apply_to_tensors(lambda t: t.detach(), tensor), group)


def gather_object(obj: Any, group=None) -> Any:
    """Every process's picklable `obj`, concatenated in rank order (each process's object
    must be a list or another iterable, as in Accelerate; a non-iterable counts as one
    item); one process: `obj` itself."""
    if not _distributed():
        return obj
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    flat = []
    for part in out:
        try:
            flat.extend(part)
        except TypeError:
            flat.append(part)
    return flat


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Tensors (a nest of them) of process `from_process`, in place on every process."""
    _check_tensors(tensor, "broadcast")
    if not _distributed():
        return tensor

    def one(t: torch.Tensor) -> torch.Tensor:
        dist.broadcast(t, src=from_process)
        return t

    return apply_to_tensors(one, tensor)


def broadcast_object_list(object_list: list, from_process: int = 0) -> list:
    """Fill `object_list` (in place, and return it) with process `from_process`'s items."""
    if _distributed():
        dist.broadcast_object_list(object_list, src=from_process)
    return object_list


def reduce(tensor: Any, reduction: str = "mean", scale: float = 1.0, group=None) -> Any:
    """All-reduce tensors (a nest of them): "sum", "mean", "max" or "none" (no reduction);
    returns new tensors. `scale` is applied only on TPUs by Accelerate and is ignored here
    likewise."""
    _check_tensors(tensor, "reduce")
    if reduction not in ("sum", "mean", "max", "none"):
        raise ValueError(f"reduction={reduction!r} is not supported; use 'sum', 'mean', 'max' "
                         "or 'none'")
    world = dist.get_world_size(group) if _distributed() else 1

    def one(t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        if world == 1 or reduction == "none":
            return out
        dist.all_reduce(out, op=dist.ReduceOp.MAX if reduction == "max" else dist.ReduceOp.SUM,
                        group=group)
        if reduction == "mean":
            out /= world
        return out

    return apply_to_tensors(one, tensor)


def pad_across_processes(tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False,
                         group=None) -> Any:
    """Pad each tensor along `dim` to the largest size any process has (with `pad_index`, at
    the end or, with `pad_first`, at the start) so that they can be gathered."""
    _check_tensors(tensor, "pad_across_processes")

    def one(t: torch.Tensor) -> torch.Tensor:
        if dim >= t.dim() or dim < -t.dim():
            return t
        d = dim % t.dim()
        if not _distributed():
            return t
        size = torch.tensor([t.shape[d]], device=t.device, dtype=torch.long)
        sizes = [torch.empty_like(size) for _ in range(dist.get_world_size(group))]
        dist.all_gather(sizes, size, group=group)
        biggest = max(int(s.item()) for s in sizes)
        if biggest == t.shape[d]:
            return t
        shape = list(t.shape)
        shape[d] = biggest
        out = t.new_zeros(shape) + pad_index
        start = biggest - t.shape[d] if pad_first else 0
        index = [slice(None)] * t.dim()
        index[d] = slice(start, start + t.shape[d])
        out[tuple(index)] = t
        return out

    return apply_to_tensors(one, tensor)


def send_to_device(tensor: Any, device, non_blocking: bool = False, skip_keys=None) -> Any:
    """Move tensors (and objects with ``.to``) in a nest of lists, tuples and dicts to
    `device`; dict entries under `skip_keys` stay where they are."""
    if isinstance(skip_keys, str):
        skip_keys = [skip_keys]
    skip = set(skip_keys or ())
    if isinstance(tensor, torch.Tensor) or (hasattr(tensor, "to") and not isinstance(
            tensor, (list, tuple, dict))):
        try:
            return tensor.to(device, non_blocking=non_blocking)
        except TypeError:
            return tensor.to(device)
    if isinstance(tensor, tuple) and hasattr(tensor, "_fields"):
        return type(tensor)(*(send_to_device(t, device, non_blocking) for t in tensor))
    if isinstance(tensor, (list, tuple)):
        return type(tensor)(send_to_device(t, device, non_blocking, skip_keys) for t in tensor)
    if isinstance(tensor, dict):
        out = {k: v if k in skip else send_to_device(v, device, non_blocking, skip_keys)
               for k, v in tensor.items()}
        return out if type(tensor) is dict else type(tensor)(out)
    return tensor
