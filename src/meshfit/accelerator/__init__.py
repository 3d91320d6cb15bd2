"""`Accelerator`: the facade for users' own training loops, and what it is made of.

    accelerator.py   the facade (Hugging Face Accelerate's calls), delegating to the rest
    arguments.py     its arguments translated and checked: pure functions, frozen options
    attributes.py    where its process stands (Accelerate's attributes, accelerator.state)
    models.py        models and pipelines laid out (parallelize, autocast, pretrained reads)
    runtime.py       what each data-parallel engine does at run time (groups, no_sync, export)
    prepared.py      optimizer / scheduler wrappers that act on accumulation boundaries
    precision.py     autocast and fp16 loss scaling
    loader.py        the prepared data loader (batches ahead on the device, resumable)
    sampler.py       which items each rank reads: map-style datasets sharded as Accelerate
                     shards them, iterable datasets (streams) sharded by position
    shuffle.py       each epoch's order, from the generators Accelerate draws from
    processes.py     collectives, barriers and process control
    trackers.py      experiment trackers (log_with, init_trackers, log)
    state.py         what it writes: checkpoints to resume from (save_state / load_state),
                     the whole model (get_state_dict, save_model, save)
    compat/          Accelerate's configuration objects, enums and helper functions
"""

from meshfit.accelerator.accelerator import Accelerator

__all__ = ["Accelerator"]
