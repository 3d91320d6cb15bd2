"""Where this process stands, as Hugging Face Accelerate's ``accelerate.state`` holds it:
`PartialState` (the processes: usable without an `Accelerator`, e.g. for inference or the
collectives of `meshfit.utils.operations`) and `AcceleratorState` (the same plus the latest
`Accelerator`'s mixed precision and distribution). Both are shared by every instance in the
process (each instance reads and writes one dictionary, as Accelerate's do), so that
``AcceleratorState()`` anywhere sees the Accelerator a script built, and
``state.debug = True`` switches on the collectives' shape checks everywhere.
"""

from __future__ import annotations

import contextlib
import functools
import os
import weakref

import torch
import torch.distributed as dist

from meshfit import distributed as mdist
from meshfit.accelerator.compat.config import DistributedType
from meshfit.accelerator.compat.utilities import DEBUG_MODE
from meshfit.distributed.settle import barrier, settle_all
from meshfit.distributed import DistEnv
from meshfit.parallel.layout import Layout

__all__ = ["AcceleratorState", "PartialState", "distributed_type", "run_if", "share"]

_BY_DEVICE = {"cuda": DistributedType.MULTI_GPU, "cpu": DistributedType.MULTI_CPU,
              "xpu": DistributedType.MULTI_XPU, "npu": DistributedType.MULTI_NPU,
              "mlu": DistributedType.MULTI_MLU, "hpu": DistributedType.MULTI_HPU}


def distributed_type(env: DistEnv, layout: Layout | None = None) -> DistributedType:
    """As Accelerate's: NO on one process; FSDP when the layout shards with FSDP2 (ZeRO-2/3,
    and every data-parallel layout with tp or pp); MULTI_GPU, MULTI_CPU, ... by device type
    otherwise (DDP, ZeRO-1, or no Accelerator yet)."""
    if not env.is_distributed or env.world_size == 1:
        return DistributedType.NO
    if layout is not None and layout.is_fsdp:
        return DistributedType.FSDP
    return _BY_DEVICE.get(env.device.type, DistributedType.MULTI_GPU)


def share(inputs, n: int, rank: int, *, apply_padding: bool, device: torch.device):
    """Rank `rank` of `n`'s contiguous share of `inputs` (a list, tuple, tensor, a dict of
    them, or a ``datasets.Dataset``: its rows; the first ranks take one more), padded with the
    last item (`apply_padding`)."""
    if n == 1:
        return inputs
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
        if hasattr(values, "select") and not isinstance(values, torch.Tensor):
            # a datasets.Dataset (its slices are columns, not rows): rows by index
            rows = list(range(start, end))
            if apply_padding:
                rows += [length - 1] * (longest - len(rows))
            return values.select(rows)
        if isinstance(values, (list, tuple, torch.Tensor)):
            part = values[start:end]
            if apply_padding:
                if isinstance(part, torch.Tensor):
                    fill = values[-1:].to(device).expand(longest - len(part), *values.shape[1:])
                    part = torch.cat([part.to(device), fill])
                else:
                    part = part + type(part)([values[-1]] * (longest - len(part)))
            return part
        if isinstance(values, dict):
            return {k: split(v) for k, v in values.items()}
        return values

    return split(inputs)


def run_if(run: bool, function=None):
    """`function`, called only where `run` holds (None elsewhere); without `function`, the
    decorator that makes it."""
    if function is None:
        return functools.partial(run_if, run)

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        return function(*args, **kwargs) if run else None
    return wrapper


def _debug_from_environment() -> bool:
    """Accelerate's switch for the collectives' checks: ``ACCELERATE_DEBUG_MODE=1``."""
    return os.environ.get("ACCELERATE_DEBUG_MODE", "").strip().lower() in ("1", "true", "yes")


class PartialState:
    """The processes of this job (Accelerate's ``PartialState``): joins the process group the
    launcher describes (none on one process) on first construction; later ones share it.
    ``cpu=True`` keeps to the CPU and gloo; `_reset_state` forgets it (Accelerate's tests)."""

    _shared_state: dict = {}

    def __init__(self, cpu: bool = False, **kwargs):
        self.__dict__ = self._shared_state
        if "env" not in self.__dict__:
            self.env = mdist.init(backend=kwargs.get("backend"), cpu=cpu or None)
            self.fork_launched = False
            DEBUG_MODE["on"] = DEBUG_MODE["on"] or _debug_from_environment()

    @classmethod
    def _reset_state(cls) -> None:
        """Forget the shared state (the process group stays): the next construction starts
        afresh. Accelerate's test helper, kept for its scripts."""
        cls._shared_state.clear()

    def __getattr__(self, name: str):
        # Only for names missing from the shared dictionary: the state was reset under this
        # instance (Accelerate's message, which its tests read).
        raise AttributeError(f"`{type(self).__name__}` object has no attribute `{name}`. This "
                             "happens if `AcceleratorState._reset_state()` was called and an "
                             "`Accelerator` or `PartialState` was not reinitialized.")

    initialized = property(lambda self: "env" in self.__dict__)
    device = property(lambda self: self.env.device)
    backend = property(lambda self: self.env.backend)
    num_processes = property(lambda self: self.env.world_size)
    process_index = property(lambda self: self.env.rank)
    local_process_index = property(lambda self: self.env.local_rank)
    is_main_process = property(lambda self: self.process_index == 0)
    is_local_main_process = property(lambda self: self.local_process_index == 0)
    is_last_process = property(lambda self: self.process_index == self.num_processes - 1)
    use_distributed = property(
        lambda self: self.distributed_type != DistributedType.NO and self.num_processes > 1)

    @property
    def debug(self) -> bool:
        """Whether the collectives of `meshfit.utils.operations` first check that every
        process passes tensors of the same structure (one switch for the whole process)."""
        return DEBUG_MODE["on"]

    @debug.setter
    def debug(self, value: bool) -> None:
        DEBUG_MODE["on"] = bool(value)

    @property
    def distributed_type(self) -> DistributedType:
        """NO, MULTI_CPU, MULTI_GPU, ... (`distributed_type`; settable, as Accelerate's)."""
        given = self.__dict__.get("_distributed_type")
        return given if given is not None else self._computed_type()

    @distributed_type.setter
    def distributed_type(self, value: DistributedType) -> None:
        self.__dict__["_distributed_type"] = value

    def _computed_type(self) -> DistributedType:
        return distributed_type(self.env)

    def wait_for_everyone(self) -> None:
        """A barrier over every process."""
        if self.env.is_distributed:
            barrier()

    @contextlib.contextmanager
    def _first(self, is_first: bool):
        if not is_first:
            self.wait_for_everyone()
        yield
        if is_first:
            self.wait_for_everyone()

    def main_process_first(self):
        """The main process runs the block first, then the others."""
        return self._first(self.is_main_process)

    def local_main_process_first(self):
        return self._first(self.is_local_main_process)

    @contextlib.contextmanager
    def split_between_processes(self, inputs, apply_padding: bool = False):
        """This process's contiguous share of `inputs` (a list, tuple, tensor, dict of them or
        a ``datasets.Dataset``; `meshfit.accelerator.processes.share`)."""
        yield share(inputs, self.num_processes, self.process_index,
                    apply_padding=apply_padding, device=self.device)

    def _run_if(self, run: bool, function):
        return run_if(run, function)

    def on_main_process(self, function=None):
        return self._run_if(self.is_main_process, function)

    def on_local_main_process(self, function=None):
        return self._run_if(self.is_local_main_process, function)

    def on_last_process(self, function):
        return self._run_if(self.is_last_process, function)

    def on_process(self, function=None, process_index: int | None = None):
        return self._run_if(self.process_index == process_index, function)

    def on_local_process(self, function=None, local_process_index: int | None = None):
        return self._run_if(self.local_process_index == local_process_index, function)

    def print(self, *args, **kwargs) -> None:
        if self.is_local_main_process:
            print(*args, **kwargs)

    def destroy_process_group(self, group=None) -> None:
        """Release the process group (`group`, or the default one), at the end of a script."""
        if group is not None:
            dist.destroy_process_group(group)
            return
        if self.env.is_distributed and mdist.is_initialized():
            # (see `meshfit.accelerator.processes.release`)
            settle_all()
            dist.destroy_process_group()

    def __repr__(self) -> str:
        return (f"Distributed environment: {self.distributed_type}\n"
                f"Num processes: {self.num_processes}\nProcess index: {self.process_index}\n"
                f"Local process index: {self.local_process_index}\nDevice: {self.device}\n")


class AcceleratorState(PartialState):
    """`PartialState` plus the latest `Accelerator`'s settings (Accelerate's
    ``AcceleratorState``; ``accelerator.state``): ``mixed_precision`` ("no" before any
    Accelerator) and ``distributed_type`` (FSDP under ZeRO-2/3)."""

    _shared_state: dict = {}
    deepspeed_plugin = None

    def __init__(self, cpu: bool = False, **kwargs):
        self.__dict__ = self._shared_state
        if "env" not in self.__dict__:
            self.env = PartialState(cpu, **kwargs).env

    @classmethod
    def _reset_state(cls, reset_partial_state: bool = False) -> None:
        """Forget the shared state (and `PartialState`'s: `reset_partial_state`)."""
        cls._shared_state.clear()
        if reset_partial_state:
            PartialState._reset_state()

    def destroy_process_group(self, group=None) -> None:
        PartialState().destroy_process_group(group)

    @classmethod
    def _current(cls) -> AcceleratorState:
        """The shared state as it is (reset: empty), without joining anything."""
        state = cls.__new__(cls)
        state.__dict__ = cls._shared_state
        return state

    @classmethod
    def attach(cls, accelerator) -> None:
        """`accelerator` is the latest: the state describes it from now on."""
        shared = cls._shared_state
        shared.clear()
        shared["env"] = accelerator.env
        shared["_accelerator"] = weakref.ref(accelerator)
        PartialState._shared_state.setdefault("env", accelerator.env)
        PartialState._shared_state.setdefault("fork_launched", False)
        DEBUG_MODE["on"] = DEBUG_MODE["on"] or _debug_from_environment()

    @property
    def _acc(self):
        ref = self.__dict__.get("_accelerator")
        return None if ref is None else ref()

    def _computed_type(self) -> DistributedType:
        acc = self._acc
        return distributed_type(self.env, None if acc is None else acc.layout)

    mixed_precision = property(lambda self: "no" if self._acc is None
                               else self._acc.precision.mode)
    fsdp_plugin = property(lambda self: None if self._acc is None else self._acc.fsdp_plugin)

    def __repr__(self) -> str:
        return super().__repr__() + f"Mixed precision type: {self.mixed_precision}\n"
