"""The names scripts written for Hugging Face Accelerate import from ``accelerate.utils``:
``from meshfit.utils import set_seed, DataLoaderConfiguration, ...`` (see
`meshfit.accelerator.compat` for what each does in meshfit).

The list of names is `meshfit.accelerator.compat`'s own ``__all__`` (one list, not a copy)."""

from meshfit.accelerator.compat import *  # noqa: F401,F403 - exactly compat.__all__
from meshfit.accelerator.compat import __all__  # noqa: F401
