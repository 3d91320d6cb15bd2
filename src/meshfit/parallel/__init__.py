"""One technique per file, each a plain ``apply_x(model, mesh, ...)`` function."""

from meshfit.parallel.ddp import apply_ddp
from meshfit.parallel.fsdp import apply_fsdp
from meshfit.parallel.zero1 import apply_zero1

__all__ = ["apply_ddp", "apply_fsdp", "apply_zero1"]
