"""Accelerate's configuration objects, as ``accelerate.utils.dataclasses`` holds them: the
enums, the ``kwargs_handlers`` and the plugins, with the fields and defaults of Accelerate
1.15; `meshfit.accelerator.arguments` translates them into meshfit's options.
"""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

__all__ = ["AutocastKwargs", "DDPCommunicationHookType", "DataLoaderConfiguration",
           "DistributedDataParallelKwargs", "DistributedType", "DynamoBackend",
           "FullyShardedDataParallelPlugin", "GradScalerKwargs", "GradientAccumulationPlugin",
           "InitProcessGroupKwargs", "KwargsHandler", "LoggerType", "PrecisionType",
           "ProfileKwargs", "ProjectConfiguration", "RNGType"]


class _Contains(enum.EnumMeta):
    """``value in Enum``: whether `value` is one of the enum's."""

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
    """How the job is distributed (`meshfit.accelerator.attributes.distributed_type`); prints
    as ``DistributedType.NO``, as Accelerate's."""

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
    """Experiment trackers by name (``log_with``; built by `meshfit.tracking`)."""

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


# ------------------------------------------------------------------ kwargs_handlers
class KwargsHandler:
    """A dataclass whose `to_kwargs` gives the fields set to other than their default."""

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
        kinds = DDPCommunicationHookType
        power_sgd = (kinds.POWER_SGD, kinds.BATCHED_POWER_SGD)
        hooks = {kinds.FP16: default_hooks.fp16_compress_hook,
                 kinds.BF16: default_hooks.bf16_compress_hook,
                 kinds.POWER_SGD: powerSGD_hook.powerSGD_hook,
                 kinds.BATCHED_POWER_SGD: powerSGD_hook.batched_powerSGD_hook}
        wrappers = {kinds.FP16: default_hooks.fp16_compress_wrapper,
                    kinds.BF16: default_hooks.bf16_compress_wrapper}
        kind = kinds(self.comm_hook)
        hook, wrapper = hooks.get(kind), wrappers.get(kinds(self.comm_wrapper))
        if hook is None:
            return
        if wrapper is not None:
            hook = wrapper(hook)
        state = None
        if kind in power_sgd:
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
    """The process group's ``backend`` (meshfit picks by device when left at its default) and
    ``timeout``; not ``init_method`` (meshfit joins torchrun's environment)."""

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
        """The profiler these fields describe."""
        activities = None if self.activities is None else list(map(self._activity,
                                                                   self.activities))
        schedule = None if self.schedule_option is None else \
            torch.profiler.schedule(**self.schedule_option)
        return torch.profiler.profile(
            activities=activities, schedule=schedule, on_trace_ready=self.on_trace_ready,
            record_shapes=self.record_shapes, profile_memory=self.profile_memory,
            with_stack=self.with_stack, with_flops=self.with_flops,
            with_modules=self.with_modules)


# ----------------------------------------------------------------------------- plugins
@dataclass
class DataLoaderConfiguration:
    """How `Accelerator.prepare` shards data loaders: ``split_batches``, ``even_batches``
    (`meshfit.accelerator.sampler`); ``dispatch_batches`` None or False (every rank reads its
    own batches); ``use_seedable_sampler`` (``data_seed + epoch``; ``data_seed`` None:
    ``torch.initial_seed()``); ``non_blocking`` accepted (batches are copied to CUDA ahead,
    non-blocking, anyway); ``use_stateful_dataloader`` (`meshfit.accelerator.state`)."""

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
    ``automatic_checkpoint_naming``: see `meshfit.accelerator.state`."""

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
    """``num_steps`` micro-batches per optimizer step, also at each loader's end
    (``sync_with_dataloader``); ``adjust_scheduler`` has no effect on learning rates (in
    Accelerate it only counts the scheduler's internal step counter)."""

    num_steps: Optional[int] = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False


@dataclass
class FullyShardedDataParallelPlugin:
    """Accelerate's FSDP plugin, mapped onto meshfit's FSDP2 layouts: every process shards the
    model; ``reshard_after_forward`` True / ``sharding_strategy`` "FULL_SHARD" (the default) is
    ZeRO-3, False / "SHARD_GRAD_OP" ZeRO-2, "NO_SHARD" DDP ("HYBRID_SHARD": use
    ``parallel=ParallelDims(dp_replicate=R, dp_shard=S)``). ``cpu_offload`` (ZeRO-3 only),
    ``activation_checkpointing`` (every block) and ``mixed_precision_policy`` (or its
    param_dtype) become the Accelerator's; wrapping is meshfit's own (per transformer block),
    the other fields have no effect."""

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
        strategy = self.sharding_strategy if strategy is None else strategy
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
        on = policy not in (None, False) and bool(getattr(policy, "offload_params", True))
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
