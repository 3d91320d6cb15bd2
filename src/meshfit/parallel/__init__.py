"""One technique per file, each a plain ``apply_x(model, mesh, ...)`` function."""

from meshfit.parallel.ddp import apply_ddp

__all__ = ["apply_ddp"]
