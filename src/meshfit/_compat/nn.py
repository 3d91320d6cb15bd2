"""torch.nn's internals: a module's own slots and hooks, and the normalisation layers' bases.

`torch.nn.Module` keeps its children, parameters and hooks in private dicts (``_modules``,
``_parameters``, ``_forward_hooks``, ...). The public accessors cover reading them
(``named_children``, ``named_parameters(recurse=False, remove_duplicate=False)``, ...) with
two gaps meshfit needs: a slot holding a plain tensor where a parameter was (``setattr``
and ``register_parameter`` accept only an ``nn.Parameter`` there), and whether a module has
forward hooks at all. ``named_children`` also skips a child registered twice, which
`child_slots` does not.

Public replacement: ``torch.func.functional_call`` for `put_parameter` (a different shape
of code: the swap for one call of the whole module), a ``Module.has_hooks()`` for
`has_forward_hooks`, ``named_children`` where a twice-registered child cannot occur.
"""

from __future__ import annotations

from torch import nn

from meshfit._compat import _probe

NORM_BASES: tuple[type, ...] = (nn.modules.batchnorm._BatchNorm,
                                nn.modules.instancenorm._InstanceNorm)
"""The bases of torch's batch and instance norms (``BatchNorm1d/2d/3d``, ``SyncBatchNorm``,
``InstanceNorm1d/2d/3d`` and their lazy forms) and of other libraries' (apex's
``SyncBatchNorm``). Public replacement: the public classes, for torch's own layers only."""


def put_parameter(module: nn.Module, name: str, tensor) -> None:
    """Put `tensor` into `module`'s parameter slot `name` (``_parameters[name]``), where it
    is what the module's forward reads, whatever its type: a DTensor parameter's local
    tensor for one forward, then the parameter back. Public replacement:
    ``torch.func.functional_call``, which swaps them for a call of the whole module
    instead."""
    module._parameters[name] = tensor


def child_slots(module: nn.Module) -> dict[str, nn.Module | None]:
    """`module`'s children by name, in order (``_modules``), None entries and a child
    registered under two names included; the live dict."""
    return module._modules


def has_forward_hooks(module: nn.Module) -> bool:
    """Whether `module` has a forward or forward-pre hook of its own (``_forward_hooks``,
    ``_forward_pre_hooks``; the global ones of ``register_module_forward_hook`` are not
    counted)."""
    return bool(module._forward_hooks or module._forward_pre_hooks)


def missing() -> list[str]:
    lines = _probe.absent("torch", ("torch.nn.modules.batchnorm._BatchNorm",
                                    "torch.nn.modules.instancenorm._InstanceNorm"))
    module = nn.Module()  # (its slots are set in __init__, through object.__setattr__)
    return lines + [f"{_probe.version('torch')}: torch.nn.Module().{name}"
                    for name in ("_parameters", "_modules", "_forward_hooks",
                                 "_forward_pre_hooks") if not hasattr(module, name)]
