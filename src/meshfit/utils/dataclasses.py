"""``accelerate.utils.dataclasses``' names: Accelerate's enums, kwargs handlers and plugins
(`meshfit.accelerator.compat.config`)."""

from meshfit.accelerator.compat.config import *  # noqa: F401,F403 - exactly config.__all__
from meshfit.accelerator.compat.config import __all__  # noqa: F401
