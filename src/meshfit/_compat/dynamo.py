"""torch.compile's internals (`torch._dynamo`, `torch._inductor`): what dynamo compiled, the
inductor modes, and the module a whole-model compile wraps.

``torch.compiler`` is the public face of both (``torch.compiler.list_backends`` is used
directly); what it does not offer:

- dynamo's counters (``torch._dynamo.utils.counters``): frames converted, graphs handed to
  the backend, graph breaks, which `meshfit.parallel.compile.compile_stats` reports so that
  a model that silently ran eager is seen;
- inductor's modes (``torch._inductor.list_mode_options``), against which
  `meshfit.parallel.options` checks ``compile_mode``;
- the module a ``torch.compile(model)`` wrapper (``OptimizedModule``) holds, ``_orig_mod``;
- no limit on recompiles (``torch._dynamo.utils.disable_cache_limit``): torchao's 8/4-bit
  AdamW step (`meshfit.optim.states`) is one function compiled per parameter shape, more
  shapes than dynamo's default limit of 8 recompiles per function (torchao does the same);
- the activation memory budget of AOTAutograd's min-cut partitioner
  (``torch._functorch.config.activation_memory_budget``, torch >= 2.4): the share of a
  compiled graph's activations the forward keeps for the backward, the rest recomputed
  (`meshfit.parallel.activation_budget`; torchtitan's ``MemoryBudgetAC``).

Public replacement: a ``torch.compiler`` function for each (counters, modes, unwrapping,
a per-compile memory budget, e.g. an option of ``torch.compile``, and a per-call recompile
limit).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager

from meshfit._compat import _probe


def counters() -> Mapping[str, Mapping[str, int]]:
    """dynamo's counters of this process (``torch._dynamo.utils.counters``), live: kind ->
    name -> count, e.g. ``["frames"]["ok"]``, ``["stats"]["unique_graphs"]``,
    ``["graph_break"]`` by reason. ``torch.compiler.reset()`` does not clear them."""
    import torch._dynamo.utils

    return torch._dynamo.utils.counters


def inductor_modes() -> list[str]:
    """The modes inductor accepts (``torch._inductor.list_mode_options``; a heavy import)."""
    from torch._inductor import list_mode_options

    return list(list_mode_options())


def uncompiled(module):
    """The module a whole-model ``torch.compile`` wrapped (``_orig_mod``), or `module` itself
    where it is not such a wrapper."""
    return module._orig_mod if hasattr(module, "_orig_mod") else module


def unlimited_recompiles():
    """A context in which a compiled function recompiles for every new input shape
    (``torch._dynamo.utils.disable_cache_limit()``) instead of falling back to eager."""
    import torch._dynamo.utils

    return torch._dynamo.utils.disable_cache_limit()


# The backends whose joint graph goes through the min-cut partitioner, which alone reads the
# budget ("aot_eager" and "eager" save what the eager forward would).
MEMORY_BUDGET_BACKENDS = ("inductor", "aot_eager_decomp_partition")


def memory_budget_supported() -> bool:
    """Whether this torch's partitioner takes an activation memory budget."""
    import torch._functorch.config

    return hasattr(torch._functorch.config, "activation_memory_budget")


def memory_budget(fraction: float) -> AbstractContextManager:
    """A context in which torch.compile's partitioner keeps `fraction` of the activations
    (0: recompute all it can; 1: keep what the eager forward keeps). The partition is chosen
    when a graph is compiled, on its first call, so the context must hold around the calls
    of the compiled module (a patch of the global config, undone on exit)."""
    import torch._functorch.config

    return torch._functorch.config.patch(activation_memory_budget=float(fraction))


def missing() -> list[str]:
    return _probe.absent("torch", ("torch._dynamo.utils.counters",
                                   "torch._dynamo.utils.disable_cache_limit",
                                   "torch._inductor.list_mode_options",
                                   "torch._functorch.config.activation_memory_budget",
                                   "torch._functorch.config.patch"),
                         (("torch._dynamo.eval_frame.OptimizedModule", "_orig_mod"),))
