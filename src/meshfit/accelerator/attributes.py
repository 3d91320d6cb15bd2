"""Where an `Accelerator`'s process stands, under Accelerate's attribute names: the
properties of `AcceleratorAttributes` (a mixin of `Accelerator`), and `AcceleratorState`
(``accelerator.state``).

They read what the Accelerator holds, and keep nothing of their own: ``env`` (`DistEnv`:
ranks, device), ``layout`` and ``runtime`` (the decided layout and its engine),
``precision``, ``grad_state`` (accumulation: `meshfit.accelerator.prepared.GradientState`),
``dataloader_config`` and ``project_configuration`` (the user's configuration objects).

``distributed_type`` is NO on one process, FSDP when the layout shards with FSDP2 (ZeRO-2/3,
and every data-parallel layout with tp or pp), and MULTI_GPU / MULTI_CPU / ... after the
device type otherwise (DDP, ZeRO-1), as Accelerate's.
"""

from __future__ import annotations

import torch

from meshfit.accelerator.compat.enums import DistributedType
from meshfit.accelerator.prepared import GradientState
from meshfit.distributed import DistEnv
from meshfit.parallel.layout import Layout

__all__ = ["AcceleratorAttributes", "AcceleratorState", "distributed_type"]


class AcceleratorState:
    """``accelerator.state``: where this process stands (Accelerate's attribute names)."""

    def __init__(self, accelerator):
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


_BY_DEVICE = {"cuda": DistributedType.MULTI_GPU, "cpu": DistributedType.MULTI_CPU,
              "xpu": DistributedType.MULTI_XPU, "npu": DistributedType.MULTI_NPU,
              "mlu": DistributedType.MULTI_MLU, "hpu": DistributedType.MULTI_HPU}


def distributed_type(env: DistEnv, layout: Layout) -> DistributedType:
    """NO on one process; FSDP when the layout shards with FSDP2 (ZeRO-2/3, and every
    data-parallel layout with tp or pp); MULTI_GPU, MULTI_CPU, ... (by device) for DDP and
    ZeRO-1."""
    if not env.is_distributed or env.world_size == 1:
        return DistributedType.NO
    if layout.is_fsdp:
        return DistributedType.FSDP
    return _BY_DEVICE.get(env.device.type, DistributedType.MULTI_GPU)


class AcceleratorAttributes:
    """The `Accelerator`'s attributes of where it stands (see this module's docstring)."""

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
        """NO, FSDP, MULTI_GPU, MULTI_CPU, ... (`distributed_type` above)."""
        return distributed_type(self.env, self.layout)

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
