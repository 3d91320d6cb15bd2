"""Barriers after which no gloo worker thread needs Python again.

A gloo process group runs every collective on worker threads of its own. When a worker thread
is the last owner of a finished collective's `Work`, it destroys it, and a `Work` that holds
tensors seen from Python (an all-gather's outputs; a barrier holds the works that were in
flight when it was issued) takes the GIL to release them. Two ways this goes wrong with torch
2.13 on gloo, both seen in meshfit's tests on a loaded 2-core machine:

* a deadlock: a DDP model is collected by the garbage collector after
  `destroy_process_group()`. Its `Reducer` is then the last owner of the group, and the group's
  destructor joins the worker threads while holding the GIL (torch's binding of `Reducer` does
  not release it), while a worker waits for the GIL to finish destroying a barrier's `Work`.
  Two ranks that end with a barrier, destroy the group and collect the model: 4 of 4 runs of
  100 such rounds hung under load; with `barrier` below, 4 of 4 finished. The Accelerate
  compatibility test's two-process launch hung at `end_training` in 2 of 15 trials with four
  launches at once on 2 cores; 0 of 15 with `settle_all`.
* an abort at exit: a worker that asks for the GIL after the interpreter began finalising is
  ended by Python with `pthread_exit`, which unwinds through a C++ destructor:
  "terminate called without an active exception".

`barrier` keeps the `Work` of the last barrier on each group in this module, so that this
(main) thread, not a worker, destroys it and the works it holds: once it returns, the group's
workers have nothing left that needs the GIL. `settle_all` does that on every group this
process belongs to, before the groups are destroyed.
"""

from __future__ import annotations

import torch.distributed as dist

from meshfit._compat.distributed import process_groups
from meshfit.distributed.env import is_initialized

# group name -> the Work of the last barrier on it; a newer barrier's replaces it (and this
# thread then destroys the older one).
_KEPT: dict[str, object] = {}


def _name(group) -> str:
    pg = group if group is not None else dist.group.WORLD
    return getattr(pg, "group_name", None) or str(id(pg))


def barrier(group=None) -> None:
    """`dist.barrier(group)`, with its `Work` kept by this thread (see the module's text)."""
    work = dist.barrier(group=group, async_op=True)
    work.wait()
    _KEPT[_name(group)] = work


def groups() -> list:
    """Every process group this process belongs to, in the order they were created (the
    same order on every rank, since groups are created collectively); the default first."""
    found = process_groups()
    if not found and is_initialized():
        found = [dist.group.WORLD]
    return [g for g in found if g is not dist.GroupMember.NON_GROUP_MEMBER
            and dist.get_rank(g) >= 0]


def settle_all() -> None:
    """A kept barrier on every group of `groups()`, in their creation order (so no two ranks
    wait on each other's groups). Every rank calls it, before `destroy_process_group()`."""
    if not is_initialized():
        return
    for group in groups():
        barrier(group)
