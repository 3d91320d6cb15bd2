"""`Accelerator`: the facade for users' own training loops, and what it is made of.

    accelerator.py   the facade (Hugging Face Accelerate's calls)
    runtime.py       what each data-parallel engine does at run time (groups, no_sync, export)
    prepared.py      optimizer / scheduler wrappers that act on accumulation boundaries
    loader.py        sharded, seeded data loaders
    precision.py     autocast and fp16 loss scaling
"""

from meshfit.accelerator.accelerator import Accelerator

__all__ = ["Accelerator"]
