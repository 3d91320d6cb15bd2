"""Memory-budget activation checkpointing: torch.compile's partitioner chooses what to
recompute.

    apply_memory_budget(model, 0.5)   # then apply_compile(model): keep about half

AOTAutograd traces a compiled module's forward and backward as one joint graph and splits
it in two; its min-cut partitioner (used by inductor) decides which intermediate values the
forward saves and which the backward recomputes. Given an activation memory budget (a share
between 0 and 1), it keeps at most that share of the activations it would save without one,
choosing by a knapsack over the recomputation's runtime the cheapest to recompute first
(torch 2.4's ``activation_memory_budget``; torchtitan's ``MemoryBudgetAC``). 1 keeps what
the eager forward keeps, 0 recomputes everything that can be. Unlike "full" or "selective",
the choice is per operation and per graph, and it needs compile.

The budget is a global setting of the partitioner, read when a graph is compiled (on its
first call, and again on a recompile), so it is held around every call of the model
(`meshfit.parallel.activation_call`), whichever of its modules are compiled, and undone
after: other models of the process keep theirs. The private name lives in
`meshfit._compat.dynamo`.
"""

from __future__ import annotations

import functools

from torch import nn

from meshfit._compat import dynamo
from meshfit.parallel.activation_call import add_around_call, arounds, remove_around_call
from meshfit.parallel.options import check_budget

__all__ = ["apply_memory_budget", "check_budget", "memory_budget_of"]

_NAME = "memory_budget"


def apply_memory_budget(model: nn.Module, budget: float) -> nn.Module:
    """Compile `model`'s graphs with the partitioner keeping `budget` (in [0, 1]) of their
    activations; returns `model`. Compile it too (`meshfit.parallel.compile.apply_compile`,
    backend inductor): without compile nothing is partitioned and the budget does nothing,
    which `meshfit.parallel.options.check_budget` refuses for the options' path."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 <= budget <= 1:
        raise ValueError(f"apply_memory_budget: budget={budget!r} must be a number in [0, 1] "
                         "(the share of the activations kept)")
    if not dynamo.memory_budget_supported():
        raise ValueError("apply_memory_budget: this torch's partitioner takes no memory budget "
                         "(torch 2.4 or later); use full or selective checkpointing")
    if budget == 1:
        remove_around_call(model, _NAME)
        return model
    add_around_call(model, _NAME, functools.partial(dynamo.memory_budget, float(budget)))
    return model


def memory_budget_of(model: nn.Module) -> float | None:
    """The budget `apply_memory_budget` gave `model`, None without one."""
    factory = arounds(model).get(_NAME)
    return None if factory is None else factory.args[0]
