"""Accelerate's ``kwargs_handlers``: dataclasses whose fields set to something other than
their default are passed on (`KwargsHandler.to_kwargs`); `meshfit.accelerator.arguments`
says where each goes.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Optional

import torch

from meshfit.accelerator.compat.enums import DDPCommunicationHookType

__all__ = ["AutocastKwargs", "DistributedDataParallelKwargs", "GradScalerKwargs",
           "InitProcessGroupKwargs", "KwargsHandler", "ProfileKwargs"]


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
