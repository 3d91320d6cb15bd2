"""The names scripts written for Hugging Face Accelerate import from ``accelerate.utils``:
exactly `meshfit.accelerator.compat`'s ``__all__`` (see there for what each does)."""

from meshfit.accelerator.compat import *  # noqa: F401,F403 - exactly compat.__all__
from meshfit.accelerator.compat import __all__  # noqa: F401
