"""meshfit: train PyTorch models efficiently on one device, many devices and many machines."""

from meshfit.accelerator import Accelerator
from meshfit.distributed import DistEnv, ParallelDims

__version__ = "0.1.0"
__all__ = ["Accelerator", "DistEnv", "ParallelDims", "__version__"]
