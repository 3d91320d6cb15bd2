"""Import optional libraries without their import-time log noise.

torchao logs a warning for every CUDA extension it cannot load on a CPU-only machine, and
torch's pytree logs deprecation warnings for the enums torchao registers; peft imports
torchao. None of it concerns the user, and it would bury meshfit's one-line errors.
"""

from __future__ import annotations

import contextlib
import logging

_NOISY = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def quiet_logs(names: tuple[str, ...] = _NOISY):
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
