"""``from accelerate.parallelism_config import ParallelismConfig``, for scripts written for
Hugging Face Accelerate (`meshfit.accelerator.compat.parallelism`)."""

from meshfit.accelerator.compat.parallelism import ParallelismConfig

__all__ = ["ParallelismConfig"]
