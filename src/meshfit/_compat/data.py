"""torch.utils.data's internals: the DataLoader worker's identity.

A DataLoader worker process knows which worker it is through
``torch.utils.data.get_worker_info()`` (public), which reads the worker module's private
``_worker_info``. `meshfit.accelerator.stream` hands a user's iterable dataset, inside a
worker, the whole stream (each worker then takes its share of the batches), so the dataset
must see no worker while it is read: the slot is emptied around each ``iter`` and ``next``.

Public replacement: a context manager of torch's that hides the worker from a dataset.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from meshfit._compat import _probe


def can_hide_worker() -> bool:
    """Whether this torch keeps the worker's identity where `hidden_worker` finds it."""
    from torch.utils.data._utils import worker

    return hasattr(worker, "_worker_info")


@contextlib.contextmanager
def hidden_worker() -> Iterator[None]:
    """While inside, ``get_worker_info()`` returns None in this process (a worker or not)."""
    from torch.utils.data._utils import worker

    saved, worker._worker_info = worker._worker_info, None
    try:
        yield
    finally:
        worker._worker_info = saved


def missing() -> list[str]:
    return _probe.absent("torch", ("torch.utils.data._utils.worker._worker_info",))
