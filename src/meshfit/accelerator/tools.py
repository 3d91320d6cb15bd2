"""The rest of what Accelerate's examples import: `get_logger` (``accelerate.logging``),
`init_empty_weights`, `merge_fsdp_weights`, `notebook_launcher` and `debug_launcher`."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from meshfit.accelerator.shared_state import PartialState
from meshfit.distributed.spawn import free_port

__all__ = ["MultiProcessAdapter", "debug_launcher", "get_logger", "init_empty_weights",
           "merge_fsdp_weights", "notebook_launcher"]


class MultiProcessAdapter(logging.LoggerAdapter):
    """A logger whose records are written by the main process only (``main_process_only=
    False``: by every process; with ``in_order=True``, one process after the other)."""

    def log(self, level, msg, *args, **kwargs):
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        kwargs.setdefault("stacklevel", 2)
        if not self.isEnabledFor(level):
            return
        state = PartialState()
        if not main_process_only or state.is_main_process:
            msg, kwargs = self.process(msg, kwargs)
            self.logger.log(level, msg, *args, **kwargs)
        elif in_order:
            for i in range(state.num_processes):
                if i == state.process_index:
                    msg, kwargs = self.process(msg, kwargs)
                    self.logger.log(level, msg, *args, **kwargs)
                state.wait_for_everyone()


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    """``logging.getLogger(name)`` writing on the main process only (`MultiProcessAdapter`);
    `log_level` (default: the environment's ``ACCELERATE_LOG_LEVEL``) sets its level."""
    log_level = log_level if log_level is not None else os.environ.get("ACCELERATE_LOG_LEVEL")
    logger = logging.getLogger(name)
    if log_level is not None:
        logger.setLevel(log_level.upper())
        logger.root.setLevel(log_level.upper())
    return MultiProcessAdapter(logger, {})


@contextlib.contextmanager
def init_empty_weights(include_buffers: bool = False):
    """Modules built inside get their parameters (and with `include_buffers`, their buffers)
    on the meta device: no memory, shapes only (to measure or lay out a model before its
    weights are loaded)."""
    if include_buffers:
        with torch.device("meta"):
            yield
        return
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def merge_fsdp_weights(checkpoint_dir, output_path, safe_serialization: bool = True,
                       remove_checkpoint_dir: bool = False) -> Path:
    """One file of the whole model (``model.safetensors``, or ``pytorch_model.bin``) in
    `output_path` from a sharded (DCP) checkpoint folder, written by the main process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    checkpoint_dir, output = Path(checkpoint_dir), Path(output_path)
    if not (checkpoint_dir / ".metadata").is_file():
        raise ValueError(f"merge_fsdp_weights: {checkpoint_dir} holds no sharded checkpoint "
                         "(no .metadata file); give the folder a sharded save wrote")
    state = PartialState()
    target = output / ("model.safetensors" if safe_serialization else "pytorch_model.bin")
    if state.is_main_process:
        output.mkdir(parents=True, exist_ok=True)
        whole = output / "pytorch_model.bin"
        dcp_to_torch_save(checkpoint_dir, whole)
        if safe_serialization:
            weights = torch.load(whole, weights_only=True)
            weights = weights.get("model", weights) if isinstance(weights, dict) else weights
            save_file({k: v.contiguous() for k, v in weights.items()}, target)
            whole.unlink()
        if remove_checkpoint_dir:
            shutil.rmtree(checkpoint_dir)
    state.wait_for_everyone()
    return target


def _launched(rank: int, function, args, world_size: int, port: int, cpu: bool) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    if cpu:
        os.environ["MESHFIT_CPU"] = "1"
    function(*args)


def notebook_launcher(function, args=(), num_processes: int | None = None,
                      mixed_precision: str = "no", use_port: str = "29500",
                      master_addr: str = "127.0.0.1", node_rank: int = 0, num_nodes: int = 1,
                      **kwargs) -> None:
    """Run ``function(*args)`` on `num_processes` local processes (forked: a notebook's
    functions need no import), each with a launcher's variables set; one process (or None
    on a machine without GPUs): in this process. One node only."""
    if num_nodes != 1 or node_rank != 0 or master_addr != "127.0.0.1":
        raise ValueError("notebook_launcher: several nodes are not supported; launch them with "
                         "`meshfit launch` (num_nodes=1)")
    if mixed_precision != "no":
        os.environ["ACCELERATE_MIXED_PRECISION"] = str(mixed_precision)
    if num_processes is None:
        num_processes = torch.cuda.device_count() or 1
    if num_processes == 1:
        function(*args)
        return
    torch.multiprocessing.start_processes(
        _launched, args=(function, args, num_processes, int(use_port),
                         not torch.cuda.is_available()),
        nprocs=num_processes, start_method="fork")


def debug_launcher(function, args=(), num_processes: int = 2) -> None:
    """``function(*args)`` on `num_processes` CPU processes (to debug distributed code)."""
    torch.multiprocessing.start_processes(
        _launched, args=(function, args, num_processes, free_port(), True),
        nprocs=num_processes, start_method="fork")
