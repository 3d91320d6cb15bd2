"""Import optional libraries without their import-time log noise.

torchao logs a warning for every CUDA extension it cannot load on a CPU-only machine, and
torch's pytree logs deprecation warnings for the enums torchao registers; peft imports
torchao. None of it concerns the user, and it would bury meshfit's one-line errors.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

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


@contextlib.contextmanager
def quiet_stderr():
    """File descriptor 2 sent to /dev/null for the duration: for a library's C++ code that
    writes there directly (torch 2.13's CPU profiler prints "USDT: ... profiler_start" and
    "profiler_stop" lines at each start and stop). Wrap only the call that prints."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
