"""Where an `Accelerator`'s process stands, under Accelerate's names: `AcceleratorAttributes`
(a mixin of `Accelerator`; ``accelerator.state`` is `meshfit.accelerator.shared_state`'s
`AcceleratorState`). They keep nothing: they read the Accelerator's ``env``, ``layout``,
``runtime``, ``precision``, ``grad_state``, its registry of prepared objects and the user's
``dataloader_config`` and ``project_configuration``.
"""

from __future__ import annotations

from meshfit.accelerator.compat.config import DistributedType
from meshfit.accelerator.shared_state import AcceleratorState, distributed_type

__all__ = ["AcceleratorAttributes", "AcceleratorState", "distributed_type"]


class AcceleratorAttributes:
    """The `Accelerator`'s attributes of where it stands (see this module's docstring)."""

    device = property(lambda self: self.env.device)
    process_index = property(lambda self: self.env.rank)
    local_process_index = property(lambda self: self.env.local_rank)
    num_processes = property(lambda self: self.env.world_size)
    is_main_process = property(lambda self: self.env.rank == 0)
    is_local_main_process = property(lambda self: self.env.local_rank == 0)
    is_last_process = property(lambda self: self.process_index == self.num_processes - 1)
    mixed_precision = property(lambda self: self.precision.mode)
    @property
    def distributed_type(self) -> DistributedType:
        """NO, FSDP, MULTI_GPU, MULTI_CPU, ... (`distributed_type`), or what a script set
        ``accelerator.state.distributed_type`` to (the state is the process's, as in
        Accelerate: until the next Accelerator is built)."""
        given = AcceleratorState._shared_state.get("_distributed_type")
        if given is not None:
            return given
        return distributed_type(self.env, self.layout)
    use_distributed = property(
        lambda self: self.distributed_type != DistributedType.NO and self.num_processes > 1)
    mesh = property(lambda self: self.runtime.mesh,
                    doc="The layout's `DeviceMesh` (None: one process without a process group).")
    zero_stage = property(lambda self: self.layout.zero_stage,
                          doc="The resolved ZeRO stage (0: DDP or a single process).")
    @property
    def state(self) -> AcceleratorState:
        """The process's shared `AcceleratorState`, describing the latest Accelerator (after
        ``AcceleratorState._reset_state()``, an empty one: reading it raises, as in
        Accelerate)."""
        return AcceleratorState._current()
    gradient_state = property(
        lambda self: self.grad_state,
        doc="Accumulation state: ``sync_gradients``, ``num_steps``, ``end_of_dataloader``, "
            "``remainder``, ``active_dataloader``, ``in_dataloader``.")
    sync_gradients = property(
        lambda self: self.grad_state.sync_gradients,
        doc="True on micro-batches whose backward synchronises gradients (and so on which "
            "the prepared optimizer steps).")
    # The user's configuration objects.
    split_batches = property(lambda self: self.dataloader_config.split_batches)
    dispatch_batches = property(lambda self: self.dataloader_config.dispatch_batches)
    use_seedable_sampler = property(lambda self: self.dataloader_config.use_seedable_sampler)
    non_blocking = property(lambda self: self.dataloader_config.non_blocking)
    use_stateful_dataloader = property(
        lambda self: self.dataloader_config.use_stateful_dataloader)
    project_dir = property(lambda self: self.project_configuration.project_dir)
    logging_dir = property(lambda self: self.project_configuration.logging_dir)
    save_iteration = property(lambda self: self.project_configuration.iteration)

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
    def multi_device(self) -> bool:
        """Distributed over several accelerators (not CPUs, not FSDP), as Accelerate's."""
        return self.use_distributed and self.distributed_type not in (
            DistributedType.FSDP, DistributedType.MULTI_CPU)

    @property
    def step(self) -> int:
        """Micro-batches since the last synchronising one (Accelerate's ``step``)."""
        return self.grad_state.step

    @step.setter
    def step(self, value: int) -> None:
        self.grad_state.step = value

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether the last optimizer step was skipped (fp16 overflow; schedulers then wait)."""
        return self._registry.step_was_skipped

    # Accelerate's lists of the prepared objects, which transformers' Trainer reads
    # (``len(accelerator._models) == 0``: whether its model still needs preparing).
    _models = property(lambda self: self._registry.models)
    _optimizers = property(lambda self: self._registry.optimizers)
    _schedulers = property(lambda self: self._registry.schedulers)
    _dataloaders = property(lambda self: self._registry.loaders)

    @property
    def even_batches(self) -> bool:
        return self.dataloader_config.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        self.dataloader_config.even_batches = value
