"""torch's elastic launcher (`torch.distributed.elastic`, what ``torchrun`` runs): how its
agent stops its workers.

`meshfit.launch.torchrun.stopping_workers` adjusts the stop: it learns which workers had
failed before the agent began terminating the rest, and turns a SIGINT passed on to the
workers into a SIGTERM. The agent stops them through ``PContext.close(death_sig, timeout)``,
public, which this module wraps; which workers had failed is the context's private
``_failures``.

Public replacement: a hook of the agent's (or of ``PContext``) called with the failures and
the signal before it terminates the remaining workers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from meshfit._compat import _probe

_CONTEXT = "torch.distributed.elastic.multiprocessing.api.SubprocessContext"


@contextlib.contextmanager
def before_close(hook: Callable[[object, object], object]) -> Iterator[None]:
    """While inside: every ``SubprocessContext.close(death_sig, timeout)`` (the agent
    stopping its workers, or a context finding a failed one) first calls
    ``hook(context, death_sig)`` and closes with the signal it returns. ``close`` is
    public; replacing it on the class is the only way in, since the agent builds its
    contexts itself."""
    from torch.distributed.elastic.multiprocessing import api

    real = api.SubprocessContext.close

    def close(self, death_sig=None, timeout: int = 30):
        return real(self, hook(self, death_sig), timeout)

    api.SubprocessContext.close = close
    try:
        yield
    finally:
        api.SubprocessContext.close = real


def failed_pids(context) -> set[int]:
    """The PIDs of the workers `context` has recorded as failed so far (its private
    ``_failures``: local rank -> ``ProcessFailure``; the public ``wait()`` returns them only
    once every worker ended)."""
    return {failure.pid for failure in context._failures.values()}


def missing() -> list[str]:
    return _probe.absent("torch", (f"{_CONTEXT}.close",), ((_CONTEXT, "_failures"),))
