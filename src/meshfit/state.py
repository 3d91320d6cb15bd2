"""``accelerate.state``'s names: `PartialState` and `AcceleratorState` (where this process
stands, usable without an `Accelerator`; `meshfit.accelerator.shared_state`) and
`GradientState` (gradient accumulation's bookkeeping; `meshfit.accelerator.prepared`)."""

from meshfit.accelerator.compat.config import DistributedType
from meshfit.accelerator.prepared import GradientState
from meshfit.accelerator.shared_state import AcceleratorState, PartialState

__all__ = ["AcceleratorState", "DistributedType", "GradientState", "PartialState"]
