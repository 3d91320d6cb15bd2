"""Per-model options applied by `Accelerator.prepare`: activation checkpointing and compile.

They are validated when the `Accelerator` (or the run's config) is built — before any process
group, model or file exists — and applied in a fixed order in `prepare`: checkpoint each
transformer block, compile each (checkpointed) block, then wrap for data parallelism. This is
torchtitan's order: the recomputation lives inside the compiled region, and DDP/FSDP hooks stay
outside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CHECKPOINTING = ("none", "full", "selective")
POLICIES = ("block", "op")
SCOPES = ("block", "model")


def check_compile_settings(backend: str, mode: str | None, *, prefix: str = "") -> None:
    """One-line ValueErrors for a backend or mode torch.compile does not know."""
    from meshfit.parallel.compile import check_compile_args

    check_compile_args(backend, mode, prefix=prefix)


def _mode(mode: str | None) -> str | None:
    """torch.compile's own default is mode=None; "default" is its name in meshfit's options
    (TOML has no null), and it is accepted with any backend."""
    return None if mode in (None, "default") else mode


@dataclass(frozen=True, kw_only=True)
class ModelOptions:
    """What `prepare` does to a model before the data-parallel wrapper."""

    activation_checkpointing: str = "none"
    activation_checkpointing_every: int = 2
    activation_checkpointing_policy: str = "block"
    compile: bool = False
    compile_backend: str = "inductor"
    compile_mode: str = "default"
    compile_scope: str = "block"

    def __post_init__(self) -> None:
        if self.activation_checkpointing not in CHECKPOINTING:
            raise ValueError(f"activation_checkpointing={self.activation_checkpointing!r} is not "
                             f"one of {', '.join(CHECKPOINTING)}")
        if self.activation_checkpointing_policy not in POLICIES:
            raise ValueError("activation_checkpointing_policy="
                             f"{self.activation_checkpointing_policy!r} is not one of "
                             f"{', '.join(POLICIES)}")
        every = self.activation_checkpointing_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"activation_checkpointing_every={every!r} must be an integer >= 1")
        if self.compile_scope not in SCOPES:
            raise ValueError(f"compile_scope={self.compile_scope!r} is not one of "
                             f"{', '.join(SCOPES)}")
        if self.compile:
            check_compile_settings(self.compile_backend, _mode(self.compile_mode))

    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        """Checkpoint, then compile, `model` in place (parameter names are unchanged)."""
        if self.activation_checkpointing != "none":
            from meshfit.parallel.activation import apply_activation_checkpointing

            apply_activation_checkpointing(model, self.activation_checkpointing,
                                           every=self.activation_checkpointing_every,
                                           policy=self.activation_checkpointing_policy)
        if self.compile:
            from meshfit.parallel.compile import apply_compile

            apply_compile(model, backend=self.compile_backend, mode=_mode(self.compile_mode),
                          scope=self.compile_scope)
        return model
