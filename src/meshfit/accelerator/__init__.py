"""`Accelerator`: the facade for users' own training loops, Hugging Face Accelerate's calls
(accelerator.py), and what it is made of: its arguments translated and checked
(arguments.py); where its process stands, Accelerate's attributes (attributes.py); models and
pipelines laid out (models.py); what each data-parallel engine does at run time, disk offload
included (runtime.py); the objects it has prepared and registered (registry.py); the
optimizer and scheduler wrappers acting on accumulation boundaries (prepared.py); the
prepared data loader, batches ahead on the device (loader.py), map-style datasets sharded as
Accelerate shards them (sampler.py), streams sharded by position (stream.py), each epoch's
order (shuffle.py), a batch's sequences cut for context parallel (sequence.py); autocast and
fp16 loss scaling (precision.py); collectives, barriers and process control (processes.py);
experiment trackers (trackers.py); checkpoints to resume from (state.py); the whole model out
(export.py); Accelerate's configuration objects and helpers (compat/).
"""

from meshfit.accelerator.accelerator import Accelerator
# What scripts import from ``accelerate.accelerator`` beside the Accelerator.
from meshfit.accelerator.compat.config import (DataLoaderConfiguration,
                                               GradientAccumulationPlugin)

__all__ = ["Accelerator", "DataLoaderConfiguration", "GradientAccumulationPlugin"]
