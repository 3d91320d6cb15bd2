"""Hugging Face Accelerate's configuration objects and helper functions, as meshfit's.

A script written for Accelerate imports these names from ``accelerate`` / ``accelerate.utils``;
with meshfit it imports them from ``meshfit`` / ``meshfit.utils`` (which re-export this
package's `__all__`). Names, fields, defaults and behaviour follow Accelerate 1.15; what
meshfit does with each is said where it is used (`meshfit.accelerator.arguments` translates
the configuration objects):

    config.py      the configuration objects: enums, ``kwargs_handlers``, plugins
    utilities.py   the helper functions: seeds, device memory, batch sizes, collectives
"""

from __future__ import annotations

# Each module's `__all__` (Accelerate's names are the list below).
from meshfit.accelerator.compat.config import *  # noqa: F401,F403
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
    "should_reduce_batch_size",
]
