"""Tokenizers: the small protocol the data pipeline needs (`Tokenizer`), a byte-level
default, Hugging Face tokenizers (a ``tokenizers.Tokenizer`` or a ``transformers``
``PreTrainedTokenizer[Fast]``, wrapped by :func:`as_tokenizer`), and loading/saving a
tokenizer by name or path (:func:`load_tokenizer`). The ``tokenizers``/``transformers``
libraries are imported only when such a tokenizer is loaded.

The cache (``cache.py``) only needs four things from a tokenizer: a stable ``name`` (part of
the cache key, so two tokenizers never share a cache), ``vocab_size`` (picks the on-disk
dtype), ``encode`` and ``decode``; ``eos_id`` separates documents (:func:`document_separator`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = ["Tokenizer", "ByteTokenizer", "HFTokenizer", "as_tokenizer", "load_tokenizer",
           "document_separator", "encode_head", "token_dtype", "MESHFIT_TOKENIZER_FILE"]

MESHFIT_TOKENIZER_FILE = "meshfit_tokenizer.json"
"""Written by ``save`` for tokenizers that have no Hugging Face folder format of their own
(bytes; a bare ``tokenizers`` tokenizer and its EOS token)."""

# The EOS token of a bare tokenizer.json (tokenizers.Tokenizer has no eos concept), in order.
_EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "[EOS]", "<EOS>")


@runtime_checkable
class Tokenizer(Protocol):
    """What ``load_tokens`` needs from a tokenizer. ``name`` must change whenever the mapping
    text -> ids (or ``eos_id``) changes: it keys the cache."""

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

    def save(self, folder: str | os.PathLike[str]) -> Path:
        """Write ``meshfit_tokenizer.json`` ``{"kind": "bytes"}`` into ``folder``, which
        :func:`load_tokenizer` reads back."""
        return _write_marker(folder, {"kind": "bytes"})

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """Adapter for a Hugging Face ``tokenizers.Tokenizer`` or ``transformers`` tokenizer.

    ``eos_id``: a ``transformers`` tokenizer's ``eos_token_id``; for a bare ``tokenizers``
    tokenizer, the id of ``eos_token`` when given, else the first special token named like
    an EOS token (``</s>``, ``<|endoftext|>``, ...), else ``None`` (refused by
    ``load_tokens`` and ``TokenStream``: documents need a separator).

    The ``name`` embeds a hash of the tokenizer's full serialization (``tokenizer.json``:
    vocabulary, merges, normalizer, pre-tokenizer, added tokens; the vocabulary for a slow
    ``transformers`` tokenizer) and of ``eos_id``, so retraining or swapping a tokenizer
    under the same folder name can never reuse a stale cache, while the same tokenizer
    copied to another folder still finds its cache.
    """

    def __init__(self, hf: Any, *, eos_token: str | None = None) -> None:
        self._hf = hf
        # tokenizers.Tokenizer has get_vocab_size(); transformers tokenizers have __len__
        # (len() counts added special tokens, which vocab_size does not).
        self._is_raw = hasattr(hf, "get_vocab_size")
        if self._is_raw:
            self.vocab_size = int(hf.get_vocab_size(with_added_tokens=True))
            self.label = "tokenizers"
            self.eos_token = eos_token if eos_token is not None else _guess_eos(hf)
            eos = None if self.eos_token is None else hf.token_to_id(self.eos_token)
            if self.eos_token is not None and eos is None:
                raise ValueError(f"tokenizer eos_token={self.eos_token!r} is not in the "
                                 "tokenizer's vocabulary; name one of its special tokens")
        else:
            self.vocab_size = int(len(hf))
            self.label = str(getattr(hf, "name_or_path", "") or type(hf).__name__)
            eos = getattr(hf, "eos_token_id", None)
            self.eos_token = getattr(hf, "eos_token", None)
        self.eos_id = None if eos is None else int(eos)
        # The fast path: a tokenizers.Tokenizer (bare, or the backend of a fast transformers
        # tokenizer) encodes whole batches in parallel and never warns about model lengths.
        backend = hf if self._is_raw else getattr(hf, "backend_tokenizer", None)
        self._backend = backend if hasattr(backend, "encode_batch") else None
        digest = hashlib.sha256()
        if self._backend is not None:
            digest.update(self._backend.to_str().encode("utf-8"))
        else:
            digest.update(json.dumps(sorted(hf.get_vocab().items())).encode("utf-8"))
        digest.update(f"|eos={self.eos_id}".encode())
        kind = "tokenizers" if self._is_raw else type(hf).__name__
        self.name = f"hf:{kind}:{self.vocab_size}:{digest.hexdigest()[:16]}"

    @property
    def hf(self) -> Any:
        """The wrapped Hugging Face tokenizer."""
        return self._hf

    def encode(self, text: str) -> np.ndarray:
        if self._backend is not None:
            ids = self._backend.encode(text, add_special_tokens=False).ids
        else:
            ids = self._hf.encode(text, add_special_tokens=False)
        return np.asarray(ids, dtype=token_dtype(self.vocab_size))

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """``[encode(t) for t in texts]``, in parallel threads where the library can."""
        dtype = token_dtype(self.vocab_size)
        if self._backend is not None:
            out = self._backend.encode_batch(list(texts), add_special_tokens=False)
            return [np.asarray(e.ids, dtype=dtype) for e in out]
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._hf.decode([int(i) for i in np.asarray(ids).ravel()])

    def save(self, folder: str | os.PathLike[str]) -> Path:
        """Write the tokenizer into ``folder`` so :func:`load_tokenizer` reads it back:
        ``save_pretrained`` for a ``transformers`` tokenizer; ``tokenizer.json`` plus
        ``meshfit_tokenizer.json`` (which records the EOS token) for a bare one."""
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        if self._is_raw:
            self._hf.save(str(out / "tokenizer.json"))
            return _write_marker(out, {"kind": "tokenizers", "eos_token": self.eos_token})
        self._hf.save_pretrained(str(out))
        return out

    def __repr__(self) -> str:
        return f"HFTokenizer(name={self.name!r}, source={self.label!r})"


def _guess_eos(raw: Any) -> str | None:
    specials = {t.content for t in raw.get_added_tokens_decoder().values()
                if getattr(t, "special", True)}
    return next((name for name in _EOS_NAMES if name in specials), None)


def _write_marker(folder: str | os.PathLike[str], payload: dict[str, Any]) -> Path:
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    (out / MESHFIT_TOKENIZER_FILE).write_text(json.dumps(payload) + "\n", encoding="utf-8")
    return out


def load_tokenizer(spec: str | os.PathLike[str], *, trust_code: bool = False
                   ) -> ByteTokenizer | HFTokenizer:
    """The tokenizer ``spec`` names: ``"bytes"`` (or ``""``); a folder with
    ``meshfit_tokenizer.json`` (written by ``save``); a Hugging Face tokenizer folder
    (``AutoTokenizer``, local files only, never a download); or a ``tokenizer.json`` file
    (``tokenizers.Tokenizer``, with the EOS token from a ``tokenizer_config.json`` beside it,
    else guessed from its special tokens). Errors name ``data.tokenizer``, the field this comes
    from in a run config. `trust_code`: a folder's own tokenizer code (``auto_map``) may run
    (transformers' ``trust_remote_code``); without it such a folder is refused, never
    prompted for."""
    text = os.fspath(spec)
    if text in ("", "bytes"):  # "": an unset config string means the default
        return ByteTokenizer()
    path = Path(text).expanduser()
    if not path.exists():
        raise ValueError(f'data.tokenizer={text!r} does not exist; give "bytes", a Hugging '
                         "Face tokenizer folder or a tokenizer.json file")
    if path.is_dir() and (path / MESHFIT_TOKENIZER_FILE).is_file():
        return _from_marker(path, text)
    if path.is_file():
        return _from_tokenizer_json(path, text, _sibling_eos(path.parent))
    try:
        from transformers import AutoTokenizer
    except ImportError:
        if (path / "tokenizer.json").is_file():  # tokenizers alone can still read it
            return _from_tokenizer_json(path / "tokenizer.json", text, _sibling_eos(path))
        raise ValueError(f"data.tokenizer={text!r} is a Hugging Face tokenizer folder, which "
                         'needs transformers; pip install "meshfit[data]"') from None
    try:
        hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True,
                                           trust_remote_code=trust_code)
    except Exception as err:  # noqa: BLE001 - any failure here means "not a tokenizer"
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ValueError(f"data.tokenizer={text!r} could not be read as a Hugging Face "
                         f"tokenizer folder ({first}); give a folder written by "
                         "save_pretrained or a tokenizer.json file") from None
    return HFTokenizer(hf)


def _from_marker(folder: Path, text: str) -> ByteTokenizer | HFTokenizer:
    marker = folder / MESHFIT_TOKENIZER_FILE
    try:
        info = json.loads(marker.read_text(encoding="utf-8"))
        kind = info["kind"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ValueError(f"data.tokenizer={text!r}: {marker.name} is not valid; write it "
                         "again with the tokenizer's save(folder)") from None
    if kind == "bytes":
        return ByteTokenizer()
    if kind == "tokenizers":
        return _from_tokenizer_json(folder / "tokenizer.json", text, info.get("eos_token"))
    raise ValueError(f"data.tokenizer={text!r}: {marker.name} has kind={kind!r}, which this "
                     'meshfit does not know; expected "bytes" or "tokenizers"')


def _sibling_eos(folder: Path) -> str | None:
    """``eos_token`` from a ``tokenizer_config.json`` next to a ``tokenizer.json``."""
    try:
        eos = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        eos = eos.get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(eos, dict):  # older transformers write AddedToken dicts
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


def _from_tokenizer_json(path: Path, text: str, eos_token: str | None) -> HFTokenizer:
    try:
        from tokenizers import Tokenizer as RawTokenizer
    except ImportError:
        raise ValueError(f"data.tokenizer={text!r} is a tokenizer.json, which needs the "
                         'tokenizers library; pip install "meshfit[data]"') from None
    try:
        raw = RawTokenizer.from_file(str(path))
    except Exception as err:  # noqa: BLE001 - a parse error of the user's file
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ValueError(f"data.tokenizer={text!r}: {path.name} is not a tokenizers "
                         f"tokenizer.json ({first})") from None
    return HFTokenizer(raw, eos_token=eos_token)


def as_tokenizer(tokenizer: Any = None) -> Tokenizer:
    """Return a :class:`Tokenizer`: the byte tokenizer for ``None``, :func:`load_tokenizer`
    for a string or path, the object itself when it already follows the protocol, or an
    :class:`HFTokenizer` around a Hugging Face one."""
    if tokenizer is None:
        return ByteTokenizer()
    if isinstance(tokenizer, (str, os.PathLike)):
        return load_tokenizer(tokenizer)
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    if hasattr(tokenizer, "get_vocab") and hasattr(tokenizer, "encode"):
        return HFTokenizer(tokenizer)
    raise ValueError(f"tokenizer={tokenizer!r} is not supported; pass None or \"bytes\" for "
                     "bytes, a path to a Hugging Face tokenizer folder or tokenizer.json, an "
                     "object with name, vocab_size, eos_id, encode and decode, or a Hugging "
                     "Face tokenizer")


def document_separator(tok: Tokenizer) -> list[int]:
    """The ids put after every document when documents are packed into one stream:
    ``[eos_id]``; for a tokenizer without one, ``encode("\\n\\n")`` (the byte tokenizer: a
    byte stream stays plain UTF-8 text end to end), except a Hugging Face tokenizer, which is
    refused: it has special tokens, and a blank line would not tell the model where a
    document ends."""
    if tok.eos_id is not None:
        return [int(tok.eos_id)]
    if isinstance(tok, HFTokenizer):
        raise ValueError(
            f"tokenizer {tok.label!r} ({tok.name}) has no EOS token to separate documents; "
            "set one (tokenizer.eos_token = '</s>' then save_pretrained, an eos_token in "
            "tokenizer_config.json, or HFTokenizer(tok, eos_token=...))")
    return [int(i) for i in np.asarray(tok.encode("\n\n")).ravel()]


HEAD_CHARS = 4096
"""The first prefix `encode_head` tokenizes (at least; 8 characters a kept token beyond)."""
HEAD_GUARD = 16
"""Tokens a prefix's encoding must hold past the kept ones before it is trusted."""


def encode_head(hf: Any, text: str, limit: int | None, *, add_special_tokens: bool,
                offsets: bool = True) -> tuple[list[int], list[tuple[int, int]]]:
    """The first `limit` tokens of ``hf(text, add_special_tokens=...)`` (all of them for
    None) and, with `offsets` (a fast tokenizer's), each one's characters in `text`.

    Only a prefix of `text` is tokenized, so the time and memory follow the tokens kept,
    not the text (a 52 MB conversation cut to 33 tokens tokenized all 52 MB). A prefix's
    tokens equal the whole text's except near where it is cut: a BPE merge or a
    pre-tokenizer's split can reach across the cut. So the prefix doubles until two in a
    row agree on the first `limit` tokens with `HEAD_GUARD` tokens more to spare (the cut
    then lies well past them), or holds the whole text; the first prefix is
    ``max(HEAD_CHARS, 8 * limit)`` characters, so a row costs about three times its own
    tokens' worth of text."""

    def encode(part: str) -> tuple[list[int], list[tuple[int, int]]]:
        out = hf(part, add_special_tokens=add_special_tokens, return_offsets_mapping=offsets)
        return list(out["input_ids"]), ([tuple(o) for o in out["offset_mapping"]]
                                        if offsets else [])

    if limit is None:
        return encode(text)
    size, previous = max(HEAD_CHARS, 8 * limit), None
    while size < len(text):
        ids, spans = encode(text[:size])
        if len(ids) >= limit + HEAD_GUARD:
            head = (ids[:limit], spans[:limit])
            if head == previous:
                return head
            previous = head
        size *= 2
    ids, spans = encode(text)
    return ids[:limit], spans[:limit]


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype holding every id: halves or quarters the cache on disk."""
    if vocab_size < 1:
        raise ValueError(f"tokenizer.vocab_size={vocab_size} must be >= 1")
    if vocab_size <= 1 << 8:
        return np.dtype(np.uint8)
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    return np.dtype(np.uint32)
