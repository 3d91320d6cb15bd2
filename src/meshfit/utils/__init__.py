"""The names scripts written for Hugging Face Accelerate import from ``accelerate.utils``:
``from meshfit.utils import set_seed, DataLoaderConfiguration, ...`` (see
`meshfit.accelerator.compat` for what each does in meshfit)."""

from meshfit.accelerator.compat import (AutocastKwargs, DataLoaderConfiguration,
                                        DDPCommunicationHookType, DistributedDataParallelKwargs,
                                        DistributedType, DynamoBackend,
                                        FullyShardedDataParallelPlugin, GradientAccumulationPlugin,
                                        GradScalerKwargs, InitProcessGroupKwargs, KwargsHandler,
                                        LoggerType, PrecisionType, ProfileKwargs,
                                        ProjectConfiguration, RNGType, broadcast,
                                        broadcast_object_list, clear_device_cache,
                                        find_executable_batch_size, gather, gather_object,
                                        pad_across_processes, reduce, release_memory,
                                        send_to_device, set_seed, should_reduce_batch_size)

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
