"""``accelerate.logging``'s names: `get_logger`, a logger writing on the main process only
(`meshfit.accelerator.tools`)."""

from meshfit.accelerator.tools import MultiProcessAdapter, get_logger

__all__ = ["MultiProcessAdapter", "get_logger"]
