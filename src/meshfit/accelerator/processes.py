"""Process control and collectives for the `Accelerator` (its process-control calls:
`ProcessControl`, a mixin). Results are exchanged over the
data-parallel group (``runtime.dp_group``): with tensor or pipeline parallel, the ranks of a
tensor-parallel group share their batch, so gathering over every process would repeat
samples. Barriers, the trigger and the process group's release act on every process; without
a process group every collective returns its input.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms import Join

from meshfit import distributed as mdist
from meshfit.accelerator.compat.config import DistributedType, ProfileKwargs
from meshfit.accelerator.compat.utilities import check_tensors, gather_object, is_all_tensors
from meshfit.accelerator.shared_state import run_if, share
from meshfit.distributed import DistEnv
from meshfit.distributed import collectives as ops
from meshfit.distributed.settle import barrier, settle_all

__all__ = ["ProcessControl", "first", "gather", "gather_for_metrics", "join_uneven_inputs",
           "profile", "reduce", "release", "run_if", "share", "triggered", "wait_for_everyone"]


def gather(tensor: Any, group) -> Any:
    """`meshfit.utils.gather` over `group` (first dimensions may differ; no grad, as with
    Accelerate)."""
    check_tensors(tensor, "gather", " (gather_object for the rest)")
    return ops.gather(ops.apply_to_tensors(lambda t: t.detach(), tensor), group)


def gather_for_metrics(input_data: Any, use_gather_object: bool, *, group, group_size: int,
                       end_of_dataloader: bool, remainder: int) -> Any:
    """`gather` (`meshfit.utils.gather_object` for objects that are not tensors, or with
    `use_gather_object`); on the loader's last batch (`end_of_dataloader`) only the first
    `remainder` items are kept (the rest is ``even_batches``' padding: see `sampler`)."""
    use_gather_object = use_gather_object or not is_all_tensors(input_data)
    if use_gather_object:
        data = gather_object(input_data, group=group) if group_size > 1 else input_data
    else:
        data = gather(input_data, group)
    if not end_of_dataloader or remainder <= 0:
        return data
    if use_gather_object:
        return data[:remainder]
    return ops.apply_to_tensors(lambda t: t[:remainder], data)


def reduce(tensor: Any, reduction: str, group) -> Any:
    """All-reduce tensors (a nest of them) over `group`: ``"sum"``, ``"mean"``, ``"max"``,
    ``"min"`` or ``"none"`` (a copy); returns new tensors."""
    if reduction == "none":
        return ops.apply_to_tensors(lambda t: t.clone(), tensor)
    return ops.reduce(tensor, reduction, group)


def triggered(flag: torch.Tensor | None, env: DistEnv) -> bool:
    """Whether any process's `flag` (set_trigger's; None: not set) is set: a collective."""
    flag = torch.tensor(0, device=env.device) if flag is None else flag.clone()
    if env.is_distributed and env.world_size > 1:
        dist.all_reduce(flag)
    return flag.item() >= 1


def wait_for_everyone(env: DistEnv) -> None:
    """A barrier over every process (`meshfit.distributed.settle.barrier`)."""
    if env.is_distributed:
        barrier()


@contextlib.contextmanager
def first(is_first: bool, env: DistEnv):
    """The processes for which `is_first` holds run the block first, then the others."""
    if not is_first:
        wait_for_everyone(env)
    yield
    if is_first:
        wait_for_everyone(env)


@contextlib.contextmanager
def join_uneven_inputs(joinables, even_batches: bool | None, *, loaders: list,
                       default_even_batches: bool, kind: DistributedType, use_distributed: bool):
    """``torch.distributed.algorithms.Join`` over `joinables` for loaders whose ranks hold
    different numbers of batches; `even_batches` overrides the prepared `loaders`' inside the
    block. Under DDP, on GPUs and (unlike Accelerate, which does nothing there) CPUs."""
    if not use_distributed or kind == DistributedType.FSDP:
        if use_distributed:
            warnings.warn("meshfit: joining uneven inputs is only supported for multi-GPU "
                          "(and multi-CPU) DDP training; training proceeds without join",
                          UserWarning, stacklevel=3)
        yield joinables
        return
    saved = []
    if even_batches is not None:
        for loader in loaders:
            if loader.batch_sampler is not None:
                saved.append((loader, loader.batch_sampler.even_batches))
                loader.batch_sampler.even_batches = even_batches
    else:
        even_batches = default_even_batches
    try:
        with Join(joinables, enable=not even_batches, throw_on_early_termination=False):
            yield joinables
    finally:
        for loader, value in saved:
            loader.batch_sampler.even_batches = value


@contextlib.contextmanager
def profile(handler: ProfileKwargs, env: DistEnv):
    """``torch.profiler.profile`` configured by `handler` around the block (yields the
    profiler); each process then writes its Chrome trace to ``output_trace_dir``, if set."""
    with handler.build() as profiler:
        yield profiler
    if handler.output_trace_dir is None:
        return
    os.makedirs(handler.output_trace_dir, exist_ok=True)
    profiler.export_chrome_trace(os.path.join(handler.output_trace_dir,
                                              f"profile_{env.rank}.json"))
    wait_for_everyone(env)


def release(env: DistEnv) -> None:
    """Release the process group (end of the script)."""
    if env.is_distributed and mdist.is_initialized():
        # A barrier on every group, its Work kept by this thread: the model's DDP Reducer,
        # collected later, may own the last reference to a group, and the group's
        # destructor then waits for its gloo threads while holding the GIL
        # (meshfit.distributed.settle).
        settle_all()
        dist.destroy_process_group()


class ProcessControl:
    """The `Accelerator`'s calls that coordinate its processes, under Accelerate's names (a
    mixin: they read the Accelerator's ``env``, where it stands and its ``flag_tensor``)."""

    def set_trigger(self) -> None:
        """Mark this process: the next `check_trigger` on every process returns True."""
        self.flag_tensor = torch.tensor(1, device=self.device)

    def check_trigger(self) -> bool:
        """Whether any process called `set_trigger` since the last check (a collective; the
        mark is cleared)."""
        fired = triggered(self.flag_tensor, self.env)
        if fired or self.flag_tensor is None:
            self.flag_tensor = torch.tensor(0, device=self.device)
        return fired

    def wait_for_everyone(self) -> None:
        wait_for_everyone(self.env)

    def main_process_first(self):
        """The main process runs the block first (e.g. to build a cache), then the others."""
        return first(self.is_main_process, self.env)

    def local_main_process_first(self):
        """Each node's first process runs the block first, then that node's others."""
        return first(self.is_local_main_process, self.env)

    def on_main_process(self, function=None):
        """Decorator: run `function` on the main process only (the other ``on_*``: theirs)."""
        return run_if(self.is_main_process, function)

    def on_local_main_process(self, function=None):
        return run_if(self.is_local_main_process, function)

    def on_last_process(self, function):
        return run_if(self.is_last_process, function)

    def on_process(self, function=None, process_index: int | None = None):
        return run_if(self.process_index == process_index, function)

    def on_local_process(self, function=None, local_process_index: int | None = None):
        return run_if(self.local_process_index == local_process_index, function)

    def profile(self, profile_handler: ProfileKwargs | None = None):
        """``torch.profiler`` around the block (this module's `profile`)."""
        return profile(profile_handler or self.profile_handler or ProfileKwargs(), self.env)

    def print(self, *args, **kwargs) -> None:
        if self.is_main_process:
            print(*args, **kwargs)
