"""Packed next-token windows tokenized on the fly, for text too big (or too new) to cache."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from meshfit.data.tokenizer import Tokenizer, as_tokenizer, document_separator

__all__ = ["TokenStream"]


class TokenStream(IterableDataset):
    """An ``IterableDataset`` of ``(x, y)`` windows packed from a stream of texts.

    Each text is one document: it is tokenized, followed by the separator
    (`document_separator`) and appended to a running stream, which is cut exactly as
    :class:`~meshfit.data.TokenDataset` cuts a cached one (windows span document boundaries;
    the tokens after the last full window are dropped). So
    ``TokenStream(texts, tok, seq_len=L)`` yields the same windows as
    ``TokenDataset(load_tokens(..., val_fraction=0).train, L)`` over the same documents,
    without a cache and with memory bounded by the longest document.

    ``texts`` is read again from its start on every iteration (each epoch, each resume,
    each data-parallel rank and DataLoader worker), so it must be re-iterable and yield the
    same texts in the same order every time: a list, a ``datasets`` ``Dataset`` (or its
    column), a ``datasets`` ``IterableDataset`` with a fixed order, or a function of no
    arguments that returns a new iterator (e.g. ``lambda: open_shards()``). A one-shot
    iterator or generator object is refused. Items may be strings or mappings (dataset
    rows), whose ``text_column`` is the text; empty texts are skipped.

    Use it through ``Accelerator.prepare`` (``PreparedDataLoader``): that gives each rank,
    and each worker, its own share of the windows and a resumable position. A plain
    ``DataLoader`` with ``num_workers > 0`` would yield every window once per worker.
    """

    def __init__(self, texts: Iterable[Any] | Callable[[], Iterable[Any]],
                 tokenizer: Any = None, *, seq_len: int, text_column: str = "text") -> None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"TokenStream.seq_len={seq_len!r} must be an int >= 1")
        if isinstance(texts, (str, bytes)):
            raise ValueError("TokenStream.texts is a single string; pass a list of texts (one "
                             "per document) or a function returning an iterator of texts")
        if not callable(texts):
            if not isinstance(texts, Iterable):
                raise ValueError(f"TokenStream.texts={type(texts).__name__} is not iterable; "
                                 "pass a list, a dataset, or a function returning an iterator")
            if isinstance(texts, Iterator):
                raise ValueError("TokenStream.texts is a one-shot iterator, but the stream is "
                                 "re-read from its start on every pass and resume; pass a "
                                 "list, a dataset, or a function that returns a new iterator")
        self.texts = texts
        self.tokenizer: Tokenizer = as_tokenizer(tokenizer)
        self.separator = np.asarray(document_separator(self.tokenizer), dtype=np.int64)
        self.seq_len = seq_len
        self.text_column = text_column

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.vocab_size)

    def _texts(self) -> Iterator[str]:
        source = self.texts() if callable(self.texts) else self.texts
        for item in source:
            if isinstance(item, Mapping):
                if self.text_column not in item:
                    raise ValueError(f"TokenStream.text_column={self.text_column!r} is not a "
                                     f"key of the texts' rows; they have {sorted(item)}")
                item = item[self.text_column]
            if item is None:
                continue
            if not isinstance(item, str):
                raise ValueError(f"TokenStream.texts yielded a {type(item).__name__}; yield "
                                 f"strings, or rows whose {self.text_column!r} is a string")
            if item:
                yield item

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        length = self.seq_len + 1
        buf = np.empty(0, dtype=np.int64)
        for text in self._texts():
            ids = np.asarray(self.tokenizer.encode(text), dtype=np.int64)
            buf = np.concatenate([buf, ids, self.separator])
            n = (buf.size - 1) // self.seq_len  # full windows in the buffer
            for i in range(n):
                window = torch.from_numpy(buf[i * self.seq_len: i * self.seq_len + length])
                yield window[:-1].clone(), window[1:].clone()
            buf = buf[n * self.seq_len:]  # the last window's final token starts the next
