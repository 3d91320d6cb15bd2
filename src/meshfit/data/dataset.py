"""Fixed-length next-token windows over a token stream."""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = ["TokenDataset"]


class TokenDataset(Dataset):
    """Map-style dataset of non-overlapping windows for next-token prediction.

    Item ``i`` reads the ``seq_len + 1`` tokens starting at ``i * seq_len`` and returns
    ``(x, y)``, two int64 tensors of shape ``(seq_len,)`` with ``y[t] == x[t + 1]``:
    consecutive windows share one token, so every token but the first is a target exactly
    once. ``len == (n_tokens - 1) // seq_len``; the trailing remainder is dropped.

    With ``separator`` (the documents' separator token, e.g. EOS) an item is ``(x, y,
    positions)``: each token's position in its own document, and no target that begins a
    document (see `meshfit.models.packing.packed_forward`, which keeps a Hugging Face model's
    attention inside each document).

    Only the window is read per item, so a memory-mapped stream of any size costs no RAM.
    Pickling (DataLoader workers under ``spawn``) re-opens the map by file name instead of
    copying the whole array into every worker.
    """

    def __init__(self, tokens: np.ndarray | torch.Tensor, seq_len: int, *,
                 separator: int | None = None) -> None:
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.detach().cpu().numpy()
        if not isinstance(tokens, np.ndarray):
            tokens = np.asarray(tokens)
        if tokens.ndim != 1:
            raise ValueError(f"TokenDataset.tokens has shape {tokens.shape}; pass a 1-D stream "
                             "such as load_tokens(...).train")
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"TokenDataset.seq_len={seq_len!r} must be an int >= 1")
        if tokens.size < seq_len + 1:
            raise ValueError(f"TokenDataset.seq_len={seq_len} needs at least seq_len+1="
                             f"{seq_len + 1} tokens for one window, but tokens has {tokens.size}; "
                             "use a smaller seq_len or more data")
        if separator is not None and (isinstance(separator, bool) or
                                      not isinstance(separator, int)):
            raise ValueError(f"TokenDataset.separator={separator!r} must be a token id (int)")
        self.tokens = tokens
        self.seq_len = seq_len
        self.separator = separator

    def __len__(self) -> int:
        return (self.tokens.size - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            # IndexError (not ValueError) so plain iteration over the dataset stops here.
            raise IndexError(f"TokenDataset index {index} out of range for length {n}")
        start = index * self.seq_len
        window = torch.from_numpy(np.asarray(self.tokens[start : start + self.seq_len + 1],
                                             dtype=np.int64))
        if self.separator is None:
            return window[:-1], window[1:]
        # Documents kept apart: a token's position counts from the first token after the
        # last separator (the window's first token begins one too); the first token of a
        # document is nobody's target (its context would be another document).
        begins = torch.zeros_like(window, dtype=torch.bool)
        begins[0] = True
        begins[1:] = window[:-1] == self.separator
        index_ = torch.arange(len(window))
        start_of = torch.cummax(torch.where(begins, index_, 0), 0).values
        positions = index_ - start_of
        y = torch.where(positions[1:] == 0, torch.full_like(window[1:], -100), window[1:])
        return window[:-1], y, positions[:-1]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        t = self.tokens
        # Only a map straight from np.memmap(...) (its base is the mmap itself): a slice of
        # one inherits the parent's offset attribute, so re-opening it would read the wrong
        # bytes; slices fall back to ordinary (copying) pickling.
        if (isinstance(t, np.memmap) and t.filename is not None
                and isinstance(t.base, mmap.mmap)):
            state["tokens"] = ("memmap", t.filename, t.dtype.str, t.offset, t.shape)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        t = state["tokens"]
        if isinstance(t, tuple) and t and t[0] == "memmap":
            _, filename, dtype, offset, shape = t
            state["tokens"] = np.memmap(filename, dtype=np.dtype(dtype), mode="r",
                                        offset=offset, shape=shape)
        self.__dict__.update(state)
