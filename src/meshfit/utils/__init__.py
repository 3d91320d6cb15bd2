"""The names scripts written for Hugging Face Accelerate import from ``accelerate.utils``:
`meshfit.accelerator.compat`'s ``__all__`` (see there for what each does), and the tools of
`meshfit.accelerator.tools` (`get_logger`, `init_empty_weights`, `merge_fsdp_weights`, the
launchers)."""

from meshfit.accelerator import tools
from meshfit.accelerator.compat import *  # noqa: F401,F403 - exactly compat.__all__
from meshfit.accelerator.compat import __all__ as _compat_names
from meshfit.accelerator.tools import *  # noqa: F401,F403 - exactly tools.__all__

__all__ = [*_compat_names, *tools.__all__]
