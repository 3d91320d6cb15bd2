"""torch.compile's internals (`torch._dynamo`, `torch._inductor`): what dynamo compiled, the
inductor modes, and the module a whole-model compile wraps.

``torch.compiler`` is the public face of both (``torch.compiler.list_backends`` is used
directly); three things it does not offer:

- dynamo's counters (``torch._dynamo.utils.counters``): frames converted, graphs handed to
  the backend, graph breaks, which `meshfit.parallel.compile.compile_stats` reports so that
  a model that silently ran eager is seen;
- inductor's modes (``torch._inductor.list_mode_options``), against which
  `meshfit.parallel.options` checks ``compile_mode``;
- the module a ``torch.compile(model)`` wrapper (``OptimizedModule``) holds, ``_orig_mod``;
- no limit on recompiles (``torch._dynamo.utils.disable_cache_limit``): torchao's 8/4-bit
  AdamW step (`meshfit.optim.states`) is one function compiled per parameter shape, more
  shapes than dynamo's default limit of 8 recompiles per function (torchao does the same).

Public replacement: a ``torch.compiler`` function for each (counters, modes, unwrapping,
a per-call recompile limit).
"""

from __future__ import annotations

from collections.abc import Mapping

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


def missing() -> list[str]:
    return _probe.absent("torch", ("torch._dynamo.utils.counters",
                                   "torch._dynamo.utils.disable_cache_limit",
                                   "torch._inductor.list_mode_options"),
                         (("torch._dynamo.eval_frame.OptimizedModule", "_orig_mod"),))
