"""The blocks of one pipeline stage, and where the stage meets its neighbours.

A stage cut from a model whose blocks sit in a `ModuleList` keeps its blocks in a
`StageBlocks`: keyed by their indices in the full model (parameter names stay the full
model's), iterated and indexed by position like the list the model's forward expects.

The boundary: while `StageBlocks.boundary(entry)` is open, the model's forward iterating the
blocks gets its first block called on `entry` (the hidden states the previous stage's last
block produced) in place of whatever the forward computed before its blocks, and the output
of its last block is kept in `StageBlocks.exit`. So a stage runs the model's own forward
(positions, masks, rotary tables: built from the input's shape) while what that forward does
before its first block (an embedding multiplier, an embedding dropout) and after its last
(final norm, head, logit softcapping or scaling) counts only on the first and last stage.
The substitution sits outside the block's own call, so a block that recomputes its forward in
the backward pass (activation checkpointing) recomputes it on `entry` too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
from torch import nn

__all__ = ["StageBlocks"]


class StageBlocks(nn.ModuleList):
    """A stage's blocks cut from a `ModuleList`, keyed by their indices in the full model so
    that parameter names stay the full model's; iterated and indexed by position like the
    list the model's forward expects (see the module docstring for `boundary`)."""

    def __init__(self, blocks: Mapping[str, nn.Module]):
        super().__init__()
        for key, block in blocks.items():
            self.add_module(key, block)
        self.entry: torch.Tensor | None = None
        """While a boundary is open on a stage after the first: its first block's input."""
        self.exit: torch.Tensor | None = None
        """The last block's output of the latest forward run under `boundary`."""
        self.bounded = False

    def _listed(self) -> list:
        blocks: list = list(super().__iter__())
        if self.bounded and blocks:
            if self.entry is not None:
                blocks[0] = _Entry(blocks[0], self.entry)
            blocks[-1] = _Exit(blocks[-1], self)
        return blocks

    def __iter__(self) -> Iterator:
        return iter(self._listed())

    def __getitem__(self, idx):
        return self._listed()[idx]  # by position, not key; a slice gives a plain list

    @contextlib.contextmanager
    def boundary(self, entry: torch.Tensor | None):
        """Within: the first block runs on `entry` (None: on what the forward gives it), the
        last block's output lands in `exit`."""
        self.entry, self.exit, self.bounded = entry, None, True
        try:
            yield self
        finally:
            self.entry, self.bounded = None, False


class _Proxy:
    """A block as the model's forward sees it at a stage boundary: attributes are the
    block's (a forward may read ``layer.attention_type``)."""

    def __init__(self, block):
        self.block = block

    def __getattr__(self, name):
        return getattr(self.block, name)


class _Entry(_Proxy):
    """The first block, called on the stage's input instead of its first argument."""

    def __init__(self, block, entry: torch.Tensor):
        super().__init__(block)
        self.entry = entry

    def __call__(self, *args, **kwargs):
        if args:
            return self.block(self.entry, *args[1:], **kwargs)
        return self.block(**{**kwargs, "hidden_states": self.entry})


class _Exit(_Proxy):
    """The last block, its output (hidden states, or the first of a tuple) kept."""

    def __init__(self, block, blocks: StageBlocks):
        super().__init__(block)
        self.blocks = blocks

    def __call__(self, *args, **kwargs):
        out = self.block(*args, **kwargs)
        self.blocks.exit = out[0] if isinstance(out, tuple) else out
        return out
