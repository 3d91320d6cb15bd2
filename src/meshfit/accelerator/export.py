"""The whole model out of a training job: `Accelerator.get_state_dict`, `save_model`, `save`.

The state dict is a collective under zero_stage 2/3 and tensor parallel (each parameter
all-gathered by `get_model_state_dict(full_state_dict=True, cpu_offload=True)`, which fills
rank 0 only): call these on every rank. Names are the user's module's (no DDP/FSDP/compile
prefixes), values fp32 master weights: it loads into a plain single-device model.
Accelerate's returns the dict on every rank under DDP; this one on rank 0 only.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from meshfit.accelerator.processes import wait_for_everyone
from meshfit.accelerator.runtime import Runtime
from meshfit.checkpoint.export import write_safetensors
from meshfit.distributed import DistEnv

__all__ = ["get_state_dict", "save", "save_model"]


def get_state_dict(model: torch.nn.Module, runtime: Runtime) -> dict[str, torch.Tensor]:
    """`model`'s (or a `Pipeline`'s) whole state dict on CPU on rank 0, ``{}`` elsewhere."""
    # Lazy: the pipeline code loads torch.distributed.pipelining (about a second); a model
    # that is a Pipeline has loaded it already.
    from meshfit.parallel.pp import Pipeline

    if isinstance(model, Pipeline):
        return model.full_state_dict()
    runtime.check_files()  # (offload_params: no changed file goes into an export)
    return runtime.full_state_dict(model)


def save_model(model: torch.nn.Module, save_directory: str | os.PathLike, *, runtime: Runtime,
               env: DistEnv) -> Path:
    """Write `get_state_dict(model)` to ``save_directory/model.safetensors`` from the main
    process, atomically; tied weights as separate copies (safetensors requires it; both load
    back). A `save_directory` that is (or lies under) a file is refused first, on every rank."""
    folder = Path(save_directory)
    main = env.rank == 0
    blocked = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()),
                   None) if main else None
    flag = torch.tensor([0 if blocked is None else 1], device=env.device)
    if env.is_distributed:  # the main process's file system decides for everyone
        torch.distributed.broadcast(flag, src=0)
    if flag.item():
        where = f"{str(blocked)!r} is a file" if blocked is not None else \
            "it is a file, or lies under one, on the main process"
        raise ValueError(f"save_model: save_directory={str(folder)!r} cannot be a folder: "
                         f"{where}; give a folder path")
    state = get_state_dict(model, runtime)
    path = folder / "model.safetensors"
    if main:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_safetensors(state, path)
        except OSError as err:  # (written atomically: an old model.safetensors is kept)
            raise ValueError(f"save_model: cannot write {path} ({err.strerror or err}); give "
                             "a folder on a writable disk with free space") from None
    wait_for_everyone(env)
    return path


def save(obj: Any, f, *, writer: bool, safe_serialization: bool = False) -> None:
    """Write `obj` to `f` where `writer` holds (`safe_serialization`: safetensors)."""
    if not writer:
        return
    if safe_serialization:
        save_file(obj, f, metadata={"format": "pt"})
    else:
        torch.save(obj, f)
