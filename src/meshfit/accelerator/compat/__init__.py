"""Hugging Face Accelerate's configuration objects (config.py: enums, ``kwargs_handlers``,
plugins) and helper functions (utilities.py: seeds, device memory, batch sizes, collectives),
with Accelerate 1.15's names, fields, defaults and behaviour. Scripts import them from
``meshfit`` / ``meshfit.utils`` (which re-export this package's `__all__`) instead of
``accelerate`` / ``accelerate.utils``; `meshfit.accelerator.arguments` translates them.
"""

from __future__ import annotations

# Each module's `__all__` (Accelerate's names are the list below).
from meshfit.accelerator.compat import environment
from meshfit.accelerator.compat.config import *  # noqa: F401,F403
from meshfit.accelerator.compat.environment import *  # noqa: F401,F403
from meshfit.accelerator.compat.utilities import *  # noqa: F401,F403

# The one list of Accelerate's names: `meshfit.utils` exports exactly these.
__all__ = [
    "AutocastKwargs", "DDPCommunicationHookType", "DataLoaderConfiguration",
    "DistributedDataParallelKwargs", "DistributedType", "DynamoBackend",
    "FullyShardedDataParallelPlugin", "GradScalerKwargs", "GradientAccumulationPlugin",
    "InitProcessGroupKwargs", "KwargsHandler", "LoggerType", "PrecisionType", "ProfileKwargs",
    "ProjectConfiguration", "RNGType", "broadcast", "broadcast_object_list",
    "clear_device_cache", "find_executable_batch_size", "gather", "gather_object",
    "pad_across_processes", "reduce", "release_memory", "send_to_device", "set_seed",
    "should_reduce_batch_size", "DistributedOperationException", "copy_tensor_to_devices",
    *environment.__all__,
]
