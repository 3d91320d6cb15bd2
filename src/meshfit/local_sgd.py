"""``accelerate.local_sgd``'s `LocalSGD` (`meshfit.accelerator.local_sgd`)."""

from meshfit.accelerator.local_sgd import LocalSGD

__all__ = ["LocalSGD"]
