"""Tokenizers: the small protocol the data pipeline needs, and a byte-level default.

The cache (``cache.py``) only needs four things from a tokenizer: a stable ``name`` (part of
the cache key, so two tokenizers never share a cache), ``vocab_size`` (picks the on-disk
dtype), ``encode`` and ``decode``. ``eos_id`` says how documents are separated: a tokenizer
with an end-of-sequence token uses it, one without (the byte tokenizer) uses the encoding
of a blank line, so that a byte stream stays plain UTF-8 text end to end.

Hugging Face tokenizers (a ``tokenizers.Tokenizer`` or a ``transformers``
``PreTrainedTokenizer[Fast]``) can be passed in directly; :func:`as_tokenizer` wraps them.
Neither library is a dependency: the wrapper only calls methods on the object it is given.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = ["Tokenizer", "ByteTokenizer", "HFTokenizer", "as_tokenizer", "token_dtype"]


@runtime_checkable
class Tokenizer(Protocol):
    """What ``load_tokens`` needs from a tokenizer.

    ``name`` must change whenever the mapping text -> ids changes (it keys the cache);
    ``eos_id`` is the id put between documents, or ``None`` to use ``encode("\\n\\n")``.
    """

    name: str
    vocab_size: int
    eos_id: int | None

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are the tokens: vocab 256, no training, no unknown tokens.

    Because the ids are exactly the UTF-8 bytes, the cache builder skips ``encode`` and
    reads file bytes straight into the token file (``np.frombuffer``), which is what makes
    tokenizing the whole standard library take well under a second.
    """

    name = "bytes-utf8"
    vocab_size = 256
    eos_id = None

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        # errors="replace": a window cut from the stream may split a multi-byte character
        # at either end; that must not make decoding a training sample raise.
        return bytes(np.asarray(ids, dtype=np.uint8)).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """Adapter for a Hugging Face ``tokenizers.Tokenizer`` or ``transformers`` tokenizer.

    The ``name`` embeds a hash of the full vocabulary, so retraining or swapping a tokenizer
    under the same checkpoint name can never reuse a stale cache.
    """

    def __init__(self, hf: Any) -> None:
        self._hf = hf
        # tokenizers.Tokenizer has get_vocab_size(); transformers tokenizers have __len__
        # (len() counts added special tokens, which vocab_size does not).
        self._is_raw = hasattr(hf, "get_vocab_size")
        if self._is_raw:
            self.vocab_size = int(hf.get_vocab_size(with_added_tokens=True))
            label = "tokenizers"
        else:
            self.vocab_size = int(len(hf))
            label = str(getattr(hf, "name_or_path", "") or type(hf).__name__)
        eos = None if self._is_raw else getattr(hf, "eos_token_id", None)
        self.eos_id = None if eos is None else int(eos)
        vocab = sorted(hf.get_vocab().items())
        digest = hashlib.sha256(json.dumps(vocab).encode("utf-8")).hexdigest()[:12]
        self.name = f"hf:{label}:{self.vocab_size}:{digest}"

    def encode(self, text: str) -> np.ndarray:
        if self._is_raw:
            ids = self._hf.encode(text, add_special_tokens=False).ids
        else:
            ids = self._hf.encode(text, add_special_tokens=False)
        return np.asarray(ids, dtype=token_dtype(self.vocab_size))

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._hf.decode([int(i) for i in np.asarray(ids).ravel()])

    def __repr__(self) -> str:
        return f"HFTokenizer(name={self.name!r})"


def as_tokenizer(tokenizer: Any = None) -> Tokenizer:
    """Return a :class:`Tokenizer`: the byte tokenizer for ``None``, the object itself when
    it already follows the protocol, or an :class:`HFTokenizer` around a Hugging Face one."""
    if tokenizer is None:
        return ByteTokenizer()
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    if hasattr(tokenizer, "get_vocab") and hasattr(tokenizer, "encode"):
        return HFTokenizer(tokenizer)
    raise ValueError(
        f"tokenizer={tokenizer!r} is not supported; pass None for bytes, an object with "
        "name, vocab_size, eos_id, encode and decode, or a Hugging Face tokenizer"
    )


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype holding every id: halves or quarters the cache on disk."""
    if vocab_size < 1:
        raise ValueError(f"tokenizer.vocab_size={vocab_size} must be >= 1")
    if vocab_size <= 1 << 8:
        return np.dtype(np.uint8)
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    return np.dtype(np.uint32)
