"""meshfit: train PyTorch models efficiently on one device, many devices and many machines.

The package is layered; each layer imports only the ones below it:

    distributed/   processes, devices, mesh axes, collectives          (torch only)
    models/, data/ the reference models with their parallel plans; token data
    parallel/      one technique per file, the `Layout` decision and `parallelize`
    optim, memory, peft
    accelerator/   the `Accelerator` facade for users' own loops (Accelerate's calls)
    utils/         the names scripts written for Accelerate import from accelerate.utils
    train/         `meshfit train` / `meshfit launch`: config, trainer, command line
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# Public names, imported on first use so that `import meshfit.models` does not pull in the
# whole stack.
_EXPORTS = {"Accelerator": "meshfit.accelerator", "DistEnv": "meshfit.distributed",
            "ParallelDims": "meshfit.distributed", "Layout": "meshfit.parallel.layout"}
# What scripts written for Hugging Face Accelerate import from ``accelerate`` itself.
_EXPORTS.update({name: "meshfit.accelerator.compat" for name in (
    "DistributedType", "AutocastKwargs", "DataLoaderConfiguration", "DDPCommunicationHookType",
    "DistributedDataParallelKwargs", "FullyShardedDataParallelPlugin", "GradScalerKwargs",
    "InitProcessGroupKwargs", "ProfileKwargs", "find_executable_batch_size")})
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'meshfit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
