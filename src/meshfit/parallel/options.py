"""The techniques' option names and their checks, without torch: a config is read and
refused before torch loads (`meshfit train --train.activation_checkpointing=all` answers in
a fraction of a second). The modules of the techniques re-export these names.

    ModelOptions                                             parallelize.py
    CheckpointMode, CheckpointPolicy, check_checkpointing   activation.py
    check_budget                                             activation_budget.py
    CompileScope, check_compile_args                         compile.py
    FLOAT8_RECIPES                                           float8.py
    SCHEDULES                                                pp/schedule.py
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

from meshfit._compat import dynamo

__all__ = ["CheckpointMode", "CheckpointPolicy", "CompileScope", "FLOAT8_RECIPES", "ModelOptions",
           "SCHEDULES",
           "check_budget", "check_checkpointing", "check_compile_args", "compile_mode"]

CheckpointMode = Literal["none", "full", "selective", "budget"]
CheckpointPolicy = Literal["block", "op"]
CompileScope = Literal["block", "model"]
FLOAT8_RECIPES = ("rowwise", "tensorwise", "rowwise_with_gw_hp")
"""torchao's float8 training recipes (`meshfit.parallel.float8.apply_float8`)."""
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
"""Pipeline schedules by name (`meshfit.parallel.pp.schedule.TORCH_SCHEDULES` maps each to
torch's class)."""

# Debug backends that torch.compiler.list_backends() hides but that are useful in tests.
_DEBUG_BACKENDS = ("eager", "aot_eager")
# Names accepted without asking torch (each is registered by every torch 2.x); any other
# backend or mode is looked up in torch's registry, which imports dynamo.
_COMMON_BACKENDS = ("inductor", *_DEBUG_BACKENDS)
_COMMON_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")

_CHECKPOINT_FIELDS = ("activation_checkpointing", "activation_checkpointing_every",
                      "activation_checkpointing_policy")


def check_checkpointing(mode: object, every: object, policy: object, *,
                        names: tuple[str, str, str] = _CHECKPOINT_FIELDS,
                        where: str = "") -> None:
    """One-line ValueError for a mode, interval or policy that checkpointing does not know;
    `names` spell the three fields as the caller's user wrote them."""
    if mode not in get_args(CheckpointMode):
        raise ValueError(f"{where}{names[0]}={mode!r} is not one of "
                         f"{', '.join(get_args(CheckpointMode))}")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"{where}{names[1]}={every!r} must be an integer >= 1 (1 "
                         "checkpoints every block)")
    if policy not in get_args(CheckpointPolicy):
        raise ValueError(f"{where}{names[2]}={policy!r} is not one of "
                         f"{', '.join(get_args(CheckpointPolicy))}")


def check_budget(mode: object, budget: object, *, compile: object, backend: object,
                 offload: object = False, prefix: str = "") -> None:
    """One-line ValueError for a memory budget outside [0, 1], for mode "budget" without
    torch.compile, with a backend whose partitioner ignores the budget, or with a torch
    that has none (torch is imported only for mode "budget"), and for an `offload` that is
    not a bool; the fields are spelled ``{prefix}activation_checkpointing_budget`` etc."""
    if not isinstance(offload, bool):
        raise ValueError(f"{prefix}activation_offload={offload!r} must be True or False")
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 <= budget <= 1:
        raise ValueError(f"{prefix}activation_checkpointing_budget={budget!r} must be a number "
                         "in [0, 1] (the share of the activations kept; 0.5 keeps half)")
    if mode != "budget":
        return
    if compile is not True:
        raise ValueError(f"{prefix}activation_checkpointing='budget' needs {prefix}compile="
                         "true: the memory budget is applied by torch.compile's min-cut "
                         "partitioner; set compile = true, or use 'full' or 'selective'")
    if backend not in dynamo.MEMORY_BUDGET_BACKENDS:
        raise ValueError(f"{prefix}activation_checkpointing='budget' with {prefix}"
                         f"compile_backend={backend!r}: only "
                         f"{' and '.join(dynamo.MEMORY_BUDGET_BACKENDS)} partition by a "
                         "memory budget; use compile_backend = 'inductor'")
    if not dynamo.memory_budget_supported():
        raise ValueError(f"{prefix}activation_checkpointing='budget' needs a torch whose "
                         "partitioner takes a memory budget (2.4 or later); upgrade torch, or "
                         "use 'full' or 'selective'")


def check_compile_args(backend: object, mode: str | None, *, scope: object = "block",
                       compile: bool = True, prefix: str = "") -> None:
    """One-line ValueError for a scope, backend or mode torch.compile does not know, naming
    the fields `{prefix}compile_scope` / `compile_backend` / `compile_mode` (prefix e.g.
    "train."). The backend and mode are checked only when `compile` is on."""
    if scope not in get_args(CompileScope):
        raise ValueError(f"{prefix}compile_scope={scope!r} is not one of "
                         f"{', '.join(get_args(CompileScope))}")
    if compile:
        check_backend_mode(backend, mode, f"{prefix}compile_backend", f"{prefix}compile_mode")


def check_backend_mode(backend: object, mode: str | None, backend_field: str, mode_field: str,
                       where: str = "") -> None:
    """One-line ValueError for a torch.compile backend or inductor mode torch does not know
    (torch is imported only for a name outside the common ones)."""
    if not callable(backend) and backend not in _COMMON_BACKENDS:  # a function is a backend too
        import torch.compiler  # here: torch-free at import (TORCH_FREE, tests/test_architecture.py)

        backends = sorted(set(torch.compiler.list_backends()) | {"inductor", *_DEBUG_BACKENDS})
        registered = torch.compiler.list_backends(exclude_tags=())  # with the debug ones
        if backend not in backends and backend not in registered:
            raise ValueError(f"{where}{backend_field}={backend!r} is not a torch.compile "
                             f"backend; use one of {backends}")
    if mode is None:
        return
    if backend != "inductor":
        raise ValueError(
            f"{where}{mode_field}={mode!r} applies to the inductor backend only, but "
            f"{backend_field}={backend!r}; drop {mode_field} or use {backend_field}='inductor'")
    if mode in _COMMON_MODES:
        return
    modes = dynamo.inductor_modes()  # (inductor loads here, for an unusual mode only)
    if mode not in modes:
        raise ValueError(f"{where}{mode_field}={mode!r} is not an inductor mode; use None or "
                         f"one of {modes}")


def compile_mode(mode: str | None) -> str | None:
    """torch.compile's own default is mode=None; "default" is its name in meshfit's options
    (TOML has no null), and it is accepted with any backend."""
    return None if mode in (None, "default") else mode


@dataclass(frozen=True, kw_only=True)
class ModelOptions:
    """What `meshfit.parallel.parallelize` does to a model besides the layout: activation
    checkpointing, compile, a tensor-parallel plan and DDP's own keywords. Declared once:
    `Accelerator` takes these fields as keywords and `meshfit train`'s ``[train]`` section
    carries the first eleven (`meshfit.train.config.TrainConfig` is a `ModelOptions`; the
    fields whose metadata has ``"toml": None`` are not config keys). Validated when built,
    before any process group, model or file exists."""

    activation_checkpointing: CheckpointMode = "none"
    """"none", "full" (every block), "selective" (see the two options below) or "budget"
    (torch.compile's partitioner keeps activation_checkpointing_budget of them; needs
    compile)."""
    activation_checkpointing_every: int = 2
    """selective with policy "block": checkpoint every this many blocks."""
    activation_checkpointing_policy: CheckpointPolicy = "block"
    """selective: "block" (every n-th block) or "op" (keep matrix-product outputs, recompute
    the rest)."""
    activation_checkpointing_budget: float = 0.5
    """budget: the share of the activations torch.compile keeps (0: recompute all it can, 1:
    keep all)."""
    activation_offload: bool = False
    """Copy each block's saved activations to host memory (pinned, on a side stream on CUDA)
    and bring them back for the backward; with checkpointing, what it keeps."""
    compile: bool = False
    """torch.compile the model."""
    compile_backend: str = "inductor"
    """torch.compile backend: inductor, aot_eager, eager, ..."""
    compile_mode: str = "default"
    """inductor mode: default, reduce-overhead, max-autotune, ..."""
    compile_scope: CompileScope = "block"
    """"block" (each transformer block) or "model" (the whole model)."""
    float8: bool = False
    """float8 matrix products in the linear layers (torchao; GPUs of compute capability 8.9+)."""
    float8_recipe: str = "rowwise"
    """torchao's float8 recipe: rowwise, tensorwise or rowwise_with_gw_hp."""
    tp_plan: Any = field(default=None, metadata={"toml": None})
    """A `meshfit.models.plans.TPPlan` or {module pattern: style}; None: the model's
    built-in plan (`meshfit.parallel.tp.apply_tp`)."""
    ddp_kwargs: Mapping[str, Any] = field(default_factory=dict, metadata={"toml": None})
    """Extra keyword arguments for DistributedDataParallel (bucket_cap_mb, ...)."""
    cp_load_balance: bool = field(default=True, metadata={"toml": None})
    """cp > 1: rank r holds chunks r and 2·cp-1-r of each sequence (equal causal work on every
    rank) rather than the r-th contiguous piece (`meshfit.parallel.cp`); [parallel] key."""

    def __post_init__(self) -> None:
        self.check()

    def check(self, prefix: str = "") -> None:
        """One-line ValueError for a value the techniques do not know; `prefix` spells the
        fields as the caller's user writes them (e.g. "train.")."""
        check_checkpointing(self.activation_checkpointing, self.activation_checkpointing_every,
                            self.activation_checkpointing_policy, where=prefix)
        check_budget(self.activation_checkpointing, self.activation_checkpointing_budget,
                     compile=self.compile, backend=self.compile_backend,
                     offload=self.activation_offload, prefix=prefix)
        if not isinstance(self.compile, bool):
            raise ValueError(f"{prefix}compile={self.compile!r} must be True or False")
        check_compile_args(self.compile_backend, compile_mode(self.compile_mode),
                           scope=self.compile_scope, compile=self.compile, prefix=prefix)
        if not isinstance(self.float8, bool):
            raise ValueError(f"{prefix}float8={self.float8!r} must be True or False")
        if self.float8_recipe not in FLOAT8_RECIPES:
            raise ValueError(f"{prefix}float8_recipe={self.float8_recipe!r} is not one of "
                             f"{', '.join(FLOAT8_RECIPES)}")
        if not isinstance(self.cp_load_balance, bool):
            raise ValueError(f"cp_load_balance={self.cp_load_balance!r} must be True or False")
        if not isinstance(self.ddp_kwargs, Mapping):
            raise ValueError(f"{prefix}ddp_kwargs={self.ddp_kwargs!r} must be a dict of "
                             "DistributedDataParallel keyword arguments")

    def keywords(self) -> dict[str, Any]:
        """The `ModelOptions` fields of these options (of a type that extends it too), as
        keyword arguments: ``ModelOptions(**cfg.train.keywords())``, ``Accelerator(**...)``."""
        return {f.name: getattr(self, f.name) for f in fields(ModelOptions)}
