"""Hugging Face Accelerate's configuration objects and helper functions, as meshfit's.

A script written for Accelerate imports these names from ``accelerate`` / ``accelerate.utils``;
with meshfit it imports them from ``meshfit`` / ``meshfit.utils`` (which re-export this
package's `__all__`). Names, fields, defaults and behaviour follow Accelerate 1.15; what
meshfit does with each is said where it is used (`meshfit.accelerator.Accelerator`, and
`meshfit.accelerator.arguments` for the translation of the configuration objects):

    enums.py       DistributedType, LoggerType, PrecisionType, RNGType,
                   DDPCommunicationHookType, DynamoBackend        the enums (string valued)
    handlers.py    KwargsHandler, DistributedDataParallelKwargs, InitProcessGroupKwargs,
                   GradScalerKwargs, AutocastKwargs, ProfileKwargs    ``kwargs_handlers``
    plugins.py     DataLoaderConfiguration, ProjectConfiguration, GradientAccumulationPlugin,
                   FullyShardedDataParallelPlugin     the Accelerator's configuration
    utilities.py   set_seed, find_executable_batch_size, should_reduce_batch_size,
                   release_memory, clear_device_cache
    operations.py  gather, gather_object, broadcast, broadcast_object_list, reduce,
                   pad_across_processes, send_to_device   helpers over the default group
"""

from __future__ import annotations

from meshfit.accelerator.compat.enums import (DDPCommunicationHookType, DistributedType,
                                              DynamoBackend, LoggerType, PrecisionType, RNGType)
from meshfit.accelerator.compat.handlers import (AutocastKwargs, DistributedDataParallelKwargs,
                                                 GradScalerKwargs, InitProcessGroupKwargs,
                                                 KwargsHandler, ProfileKwargs)
from meshfit.accelerator.compat.operations import (broadcast, broadcast_object_list, gather,
                                                   gather_object, pad_across_processes, reduce,
                                                   send_to_device)
from meshfit.accelerator.compat.plugins import (DataLoaderConfiguration,
                                                FullyShardedDataParallelPlugin,
                                                GradientAccumulationPlugin, ProjectConfiguration)
from meshfit.accelerator.compat.utilities import (clear_device_cache,
                                                  find_executable_batch_size, release_memory,
                                                  set_seed, should_reduce_batch_size)

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
