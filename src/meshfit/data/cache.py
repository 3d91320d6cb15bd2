"""Tokenize a corpus once into a memory-mapped file, and reuse it on every later run.

The text comes from files (the built-in corpus, a user's file or folder: ``corpus.py``) or
from a Hugging Face ``datasets`` dataset on disk (``hf.py``). Either way it is a sequence of
*documents* (a file, a dataset row), and documents are *packed*: each is tokenized and
followed by the separator (the tokenizer's EOS token; a blank line for the byte tokenizer,
see ``tokenizer.document_separator``), and the results are concatenated into one stream, so
a ``TokenDataset`` window may span the end of one document and the start of the next, with
the separator between them telling the model where one ended. Nothing is padded.

On disk, per source+tokenizer+split, two files in ``cache_dir``::

    <slug>-<key16>.bin    train tokens, then validation tokens, raw little-endian ids
    <slug>-<key16>.json   sidecar: source, file-list hash, tokenizer, dtype, split sizes,
                          checksum ("blake2b-128": BLAKE2b with a 16-byte digest of the whole
                          .bin, as ``b2sum -l 128`` prints it)

The key hashes the sorted file paths with their sizes and mtimes (for a dataset: its
fingerprints and text column), the tokenizer's name (which for a Hugging Face tokenizer
hashes its whole ``tokenizer.json``, so a retrained tokenizer never reuses a stale cache)
and the validation fraction, so editing, adding or removing a file, or changing the
tokenizer, selects a new cache instead of reading a stale one.

Crash and concurrency safety come from atomic renames (`meshfit._files.atomic_write`), not
locks: ``.bin`` first and ``.json`` last. The sidecar is the commit marker: a reader trusts
a ``.bin`` only if a sidecar with the same key exists and the ``.bin`` has exactly the size
the sidecar records. Several ranks building at once each do the work and replace identical
bytes, which is wasted time but never a torn file; a rank that already mapped the old
``.bin`` keeps reading its inode. No ``fcntl`` lock, because locks are unreliable on the
network filesystems clusters often put caches on, and the duplicate work (seconds for the
standard library) is cheaper than that risk.

Damage after the write is caught on every open: the sidecar's fields are checked against the
tokenizer (name, vocabulary size, dtype, separator) and against the file (token count times
the dtype's size, split sizes), then the mapped ``.bin`` is hashed in 64 MiB chunks and
compared with the recorded checksum, and its largest id with the vocabulary. Any mismatch
(flipped bytes, zeros, an edited sidecar, a cache of an older meshfit without a checksum) is
one warning line naming the file and the reason, and the cache is rebuilt from the source,
which `load_tokens` always has at hand.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from meshfit._files import atomic_write
from meshfit.data.corpus import Corpus, SourceFile, data_source, find_corpus, is_validation
from meshfit.data.dataset import TokenDataset
from meshfit.data.formats import DataSpec
from meshfit.data.hf import HFSource, open_hf_dataset
from meshfit.data.tokenizer import (ByteTokenizer, HFTokenizer, Tokenizer, as_tokenizer,
                                    document_separator, token_dtype)

__all__ = ["TokenSplits", "load_tokens", "load_text", "DEFAULT_CACHE_DIR",
           "DEFAULT_VAL_FRACTION", "CHECKSUM", "cache_problem"]

DEFAULT_CACHE_DIR = Path("~/.cache/meshfit/tokens")
# 0.02 puts ~500k tokens (~40 of ~800 files) of the 3.11 standard library in validation:
# comfortably above the ~100k needed for a loss estimate that is stable to ~0.01 nats,
# whichever Python version supplies the corpus. 0.01 would give ~290k on 3.11 but leaves
# less margin, since a few large files (pydoc_data/topics.py is 750 kB) dominate the count.
DEFAULT_VAL_FRACTION = 0.02
# Bump when the on-disk layout or the meaning of a sidecar field changes.
_FORMAT = 1
CHECKSUM = "blake2b-128"
"""The sidecar's checksum field: hex BLAKE2b, 16-byte digest, of the whole .bin."""
_CHUNK = 64 << 20  # bytes hashed at a time: large enough for full speed, small for the cache


@dataclass(frozen=True, kw_only=True)
class TokenSplits:
    """Token streams ready for :class:`~meshfit.data.TokenDataset`."""

    train: np.ndarray
    """1-D read-only ``np.memmap`` of training token ids (uint8/16/32)."""
    val: np.ndarray
    """1-D read-only ``np.memmap`` of validation token ids; empty if ``val_fraction=0``."""
    vocab_size: int
    """Ids are in ``[0, vocab_size)``; size the model's embedding from this."""
    tokenizer: Tokenizer
    """The tokenizer that produced the ids: decode samples with it, and ``save(folder)``
    it (a tokenizer from ``load_tokenizer``) next to a trained model."""
    meta: dict[str, Any]
    """The sidecar JSON: source, file counts, split sizes, dtype, build time."""
    path: Path
    """The ``.bin`` file both streams are mapped from."""

    def windows(self, split: str, seq_len: int, *, documents_apart: bool = False):
        """The ``"train"`` or ``"val"`` stream as `TokenDataset` windows of `seq_len`;
        `documents_apart`: with each token's position in its document (a single-token
        separator: the tokenizer's EOS)."""
        separator = None
        if documents_apart:
            ids = document_separator(self.tokenizer)
            if len(ids) != 1:
                raise ValueError("data.document_mask=true needs a tokenizer with an EOS token "
                                 "between documents (the byte tokenizer separates them with "
                                 "a blank line); give data.tokenizer a Hugging Face tokenizer")
            separator = ids[0]
        return TokenDataset(self.train if split == "train" else self.val, seq_len,
                            separator=separator)

    @property
    def train_tokens(self) -> int:
        return int(self.train.shape[0])


def load_tokens(path: str | os.PathLike[str] | None = None, *, tokenizer: Any = None,
                cache_dir: str | os.PathLike[str] | None = None,
                val_fraction: float = DEFAULT_VAL_FRACTION,
                hf_dataset: str | os.PathLike[str] | None = None,
                text_column: str = "text") -> TokenSplits:
    """Tokenize ``path`` (default: the Python standard library) or ``hf_dataset`` once,
    pack its documents into one stream (see the module docstring), and map the cache.

    ``path`` is a UTF-8 text file or a folder (every non-hidden file below it, in sorted
    order; files that are not valid UTF-8 are skipped with a warning); each file is one
    document. ``hf_dataset`` (instead of ``path``) is a ``datasets`` dataset on local disk
    (see ``meshfit.data.hf``). ``tokenizer``: anything `as_tokenizer` takes. Documents go to
    validation by a stable hash of their relative path (row index); when that leaves one
    side empty (a single file, a handful of files) the last ``val_fraction`` of tokens is
    used instead, and ``meta["split"]`` says which rule applied. ``val_fraction=0``: no
    validation at all.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"data.val_fraction={val_fraction!r} must be in [0, 1); use e.g. "
                         "0.02, or 0 for no validation split")
    data_source(path, hf_dataset)  # not both; a data.path that exists
    tok = as_tokenizer(tokenizer)
    document_separator(tok)  # refuse a tokenizer without a separator before any work
    # "" means default too: that is how an unset config string arrives.
    folder = Path(cache_dir or DEFAULT_CACHE_DIR).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    source: Corpus | HFSource
    if hf_dataset is not None and str(hf_dataset) != "":
        source = open_hf_dataset(hf_dataset, text_column, cache_dir=folder / "hf-datasets")
    else:
        source = find_corpus(path)
    key = _cache_key(source, tok, val_fraction)
    stem = folder / f"{source.slug}-{key[:16]}"
    meta, problem = _read_meta(stem, key)
    if meta is not None:
        problem = cache_problem(_paths(stem)[0], meta, tok, val_fraction)
    if problem is not None:
        warnings.warn(f"data: token cache {_paths(stem)[0]} {problem}; rebuilding it from "
                      f"{source.description}", stacklevel=2)
    if meta is None or problem is not None:
        meta = _build(source, tok, val_fraction, stem, key)
    if meta["skipped_non_utf8"]:
        skipped = meta["skipped_non_utf8"]
        warnings.warn(f"data: skipped {len(skipped)} of {meta['n_files']} files that are "
                      f"not UTF-8 text (not valid UTF-8, or binary: NUL bytes) (e.g. "
                      f"{skipped[:3]})", stacklevel=2)
    return _open(stem, meta, tok)


def load_text(spec: DataSpec, *, tokenizer: Any = None, seq_len: int | None = None,
              val_fraction: float = DEFAULT_VAL_FRACTION) -> TokenSplits:
    """The loader of format "text" (`meshfit.data.formats`): `load_tokens` of `spec`'s
    data.path or data.hf_dataset (its text column) into `spec`'s cache folder. `seq_len`
    is not needed here: the stream is cut into windows when it is read (`windows`)."""
    return load_tokens(spec.path or None, cache_dir=spec.cache_dir or None, tokenizer=tokenizer,
                       hf_dataset=spec.hf_dataset or None,
                       text_column=spec.column("text_column"), val_fraction=val_fraction)


def _files_hash(source: Corpus | HFSource) -> str:
    if isinstance(source, HFSource):
        return source.identity
    listing = [[str(source.root)]] + [[f.rel, f.size, f.mtime_ns] for f in source.files]
    return hashlib.sha256(json.dumps(listing).encode("utf-8")).hexdigest()


def _cache_key(source: Corpus | HFSource, tok: Tokenizer, val_fraction: float) -> str:
    parts = [_FORMAT, _files_hash(source), tok.name, int(tok.vocab_size), repr(val_fraction)]
    return hashlib.sha256(json.dumps(parts).encode("utf-8")).hexdigest()


def _paths(stem: Path) -> tuple[Path, Path]:
    return stem.with_name(stem.name + ".bin"), stem.with_name(stem.name + ".json")


def _read_meta(stem: Path, key: str) -> tuple[dict[str, Any] | None, str | None]:
    """(the sidecar if it commits a ``.bin`` for ``key``, what is wrong with the sidecar);
    ``(None, None)`` means nothing committed yet (build), a problem means damage (warn, then
    rebuild)."""
    bin_path, json_path = _paths(stem)
    try:
        text = json_path.read_text(encoding="utf-8")
        size = bin_path.stat().st_size
    except OSError:
        return None, None  # never committed (or gone): build
    try:
        meta = json.loads(text)
    except ValueError as err:
        return None, f"has a sidecar {json_path.name} that is not JSON ({err})"
    if not isinstance(meta, dict):
        return None, f"has a sidecar {json_path.name} that is not a JSON object"
    if meta.get("format") != _FORMAT or meta.get("key") != key:
        return None, None  # another layout's: replaced silently
    try:
        expected = int(meta["n_tokens"]) * np.dtype(meta["dtype"]).itemsize
    except (KeyError, TypeError, ValueError):
        return meta, None  # a damaged sidecar: cache_problem says what is wrong
    # A .bin of another size under a sidecar without a checksum: torn by an older meshfit's
    # write; with one, cache_problem names it.
    return (meta if size == expected or "checksum" in meta else None), None


def cache_problem(bin_path: Path, meta: dict[str, Any], tok: Tokenizer,
                  val_fraction: float) -> str | None:
    """What is wrong with a committed cache, in a few words (None: nothing). Checks the
    sidecar against `tok` and the file, then hashes the mapped file (`CHECKSUM`) and takes
    its largest id: one pass at memory speed once the file is in the page cache."""
    if "checksum" not in meta:
        return "was written without a checksum (by an older meshfit)"
    try:
        fields = _meta_problem(bin_path, meta, tok, val_fraction)
        if fields is not None:
            return fields
        digest, top = _content_digest(bin_path, np.dtype(meta["dtype"]))
    except OSError as err:
        return f"cannot be read ({err.strerror or err})"
    except (KeyError, TypeError, ValueError) as err:
        return f"has a damaged sidecar ({type(err).__name__}: {err})"
    if digest != meta["checksum"].get(CHECKSUM):
        return (f"failed its checksum ({CHECKSUM} {digest}, the sidecar records "
                f"{meta['checksum'].get(CHECKSUM)}): it was changed after it was written")
    if top >= tok.vocab_size:
        return f"holds id {top}, outside tokenizer.vocab_size={tok.vocab_size}"
    return None


def _meta_problem(bin_path: Path, meta: dict[str, Any], tok: Tokenizer,
                  val_fraction: float) -> str | None:
    expected = {"tokenizer": tok.name, "vocab_size": int(tok.vocab_size),
                "dtype": token_dtype(tok.vocab_size).name,
                "separator": [int(i) for i in document_separator(tok)]}
    for name, value in expected.items():
        if meta[name] != value:
            return f"records {name}={meta[name]!r} where the tokenizer has {value!r}"
    if not isinstance(meta["checksum"], dict) or not isinstance(
            meta["checksum"].get(CHECKSUM), str):
        return f"records no {CHECKSUM} checksum"
    n_tokens, n_train, n_val = (int(meta[k]) for k in ("n_tokens", "n_train", "n_val"))
    if min(n_train, n_val) < 0 or n_train + n_val != n_tokens:
        return (f"records n_train={n_train} + n_val={n_val}, not the n_tokens={n_tokens} it "
                "holds")
    if meta["split"] == "by_tokens" and n_val != min(max(1, round(n_tokens * val_fraction)),
                                                     n_tokens - 1):
        return f"records n_val={n_val}, not the tail that val_fraction={val_fraction} gives"
    size = bin_path.stat().st_size
    if size != n_tokens * np.dtype(meta["dtype"]).itemsize:
        return (f"is {size} bytes where the sidecar's n_tokens={n_tokens} of "
                f"{meta['dtype']} make {n_tokens * np.dtype(meta['dtype']).itemsize}")
    return None


def _content_digest(bin_path: Path, dtype: np.dtype) -> tuple[str, int]:
    """(hex `CHECKSUM` of the file, its largest id; -1 when empty), read through a memory
    map in `_CHUNK`-byte pieces."""
    digest = hashlib.blake2b(digest_size=16)
    top = -1
    if bin_path.stat().st_size == 0:
        return digest.hexdigest(), top
    step = _CHUNK - _CHUNK % dtype.itemsize
    with open(bin_path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        if hasattr(mm, "madvise"):
            mm.madvise(mmap.MADV_SEQUENTIAL)  # read-ahead: one pass, front to back
        view = memoryview(mm)
        try:
            for start in range(0, len(mm), step):
                with view[start:start + step] as part:
                    digest.update(part)
                    top = max(top, int(np.frombuffer(part, dtype=dtype).max()))
        finally:
            view.release()  # before the map closes
    return digest.hexdigest(), top


@dataclass(frozen=True)
class _Row:
    """One dataset row as a document: ``rel`` names it for the by-hash split, ``split`` is
    ``"train"``/``"validation"`` when the dataset's own split decides, else None."""

    rel: str
    split: str | None


def _documents(source: Corpus | HFSource, tok: Tokenizer, dtype: np.dtype,
               skipped: list[str]) -> Iterator[tuple[SourceFile | _Row, np.ndarray]]:
    """Yield ``(document, token ids)`` per non-empty UTF-8 file or dataset row; record the
    files that are not UTF-8 text (invalid UTF-8, or NUL bytes: binary) in ``skipped``."""
    if isinstance(source, HFSource):
        yield from _row_documents(source, tok, dtype)
        return
    corpus = source
    fast = type(tok) is ByteTokenizer  # ids == UTF-8 bytes: no encode call needed
    for f in corpus.files:
        raw = f.path.read_bytes()
        if len(raw) != f.size:
            # The key recorded the listed size; caching different bytes under it would let
            # a later run trust tokens that match neither version of the file.
            raise ValueError(f"data.path file {f.path} changed while being read ({f.size} -> "
                             f"{len(raw)} bytes); run again once the data is no longer being "
                             "written")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(f.rel)
            continue
        if b"\x00" in raw:  # valid UTF-8, but binary: text files hold no NUL bytes
            skipped.append(f.rel)
            continue
        if not raw:
            continue
        if fast:
            yield f, np.frombuffer(raw, dtype=np.uint8)
            continue
        yield f, _checked(np.asarray(tok.encode(text)), tok, dtype, f.rel)


def _checked(ids: np.ndarray, tok: Tokenizer, dtype: np.dtype, where: str) -> np.ndarray:
    if ids.size and (ids.min() < 0 or ids.max() >= tok.vocab_size):
        # Checked before the cast to the narrow on-disk dtype, which would wrap silently.
        raise ValueError(f"tokenizer {tok.name!r} produced ids in [{ids.min()}, {ids.max()}] "
                         f"for {where}, outside tokenizer.vocab_size={tok.vocab_size}; fix "
                         "vocab_size")
    return np.ascontiguousarray(ids, dtype=dtype)


def _row_documents(source: HFSource, tok: Tokenizer, dtype: np.dtype
                   ) -> Iterator[tuple[_Row, np.ndarray]]:
    """Rows in order, train split then validation split; empty and null texts are skipped
    (as empty files are). Fast tokenizers encode a batch of rows at once."""
    batched = getattr(tok, "encode_batch", None) if isinstance(tok, HFTokenizer) else None
    for split in ("train", "validation"):
        fixed = None if source.validation is None else split
        for start, values in source.rows(split):
            keep = [(start + i, v) for i, v in enumerate(values) if v]
            if not keep:
                continue
            texts = [v for _, v in keep]
            encoded = batched(texts) if batched else [tok.encode(t) for t in texts]
            for (index, _), ids in zip(keep, encoded):
                rel = f"{split}/{index}"
                yield _Row(rel, fixed), _checked(np.asarray(ids), tok, dtype, f"row {rel}")


def _goes_to_validation(doc: SourceFile | _Row, val_fraction: float) -> bool:
    split = getattr(doc, "split", None)
    if split is not None:
        return split == "validation"
    return is_validation(doc.rel, val_fraction)


@dataclass
class _Written:
    """What `_write_bin` put in the ``.bin``: token counts (each document with its
    separator), the validation documents' names, the files left out (not UTF-8 text) and
    the `CHECKSUM` of the bytes as written."""

    n_train: int = 0
    n_train_files: int = 0
    n_val: int = 0
    val_files: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    checksum: str = ""


def _build(source: Corpus | HFSource, tok: Tokenizer, val_fraction: float, stem: Path,
           key: str) -> dict[str, Any]:
    """Write ``.bin`` (`_write_bin`), then the sidecar, which commits it."""
    start = time.perf_counter()
    dtype = token_dtype(tok.vocab_size)
    sep = np.asarray(document_separator(tok), dtype=dtype)
    bin_path, json_path = _paths(stem)
    written = _write_bin(source, tok, val_fraction, bin_path, dtype, sep)
    if written.n_train + written.n_val == 0:
        bin_path.unlink(missing_ok=True)
        raise _no_text(source)
    meta = _sidecar(source, tok, val_fraction, key, written, dtype, sep)
    meta["build_seconds"] = round(time.perf_counter() - start, 3)
    payload = json.dumps(meta, indent=1).encode("utf-8")
    atomic_write(json_path, lambda out: out.write(payload))
    return meta


def _write_bin(source: Corpus | HFSource, tok: Tokenizer, val_fraction: float,
               bin_path: Path, dtype: np.dtype, sep: np.ndarray) -> _Written:
    """The ``.bin``, atomically: train then val, each document followed by the separator.
    Validation documents are held in memory (they are ``val_fraction`` of the data) so the
    much larger training part can stream to disk without a second pass."""
    written = _Written()
    val_docs: list[np.ndarray] = []
    digest = hashlib.blake2b(digest_size=16)  # of the bytes as written: CHECKSUM

    def fill(out) -> None:
        def put(ids: np.ndarray) -> None:
            out.write(memoryview(ids))
            digest.update(memoryview(ids))

        for f, ids in _documents(source, tok, dtype, written.skipped):
            if _goes_to_validation(f, val_fraction):
                if val_fraction == 0:  # 0 means no validation, whatever the dataset has
                    continue
                val_docs.extend((ids, sep))
                written.val_files.append(f.rel)
                continue
            put(ids)
            put(sep)
            written.n_train += ids.size + sep.size
            written.n_train_files += 1
        for ids in val_docs:
            put(ids)

    atomic_write(bin_path, fill)
    written.n_val = sum(a.size for a in val_docs)
    written.checksum = digest.hexdigest()
    return written


def _no_text(source: Corpus | HFSource) -> ValueError:
    """The one line for a source whose documents hold no token at all."""
    if isinstance(source, HFSource):
        return ValueError(f"data.hf_dataset={str(source.path)!r} holds no text: column "
                          f"data.text_column={source.text_column!r} is empty in all "
                          f"{source.n_rows} rows; choose the column that holds the text")
    return ValueError(f"data.path holds no text: all {len(source.files)} files of "
                      f"{source.description} are empty, not valid UTF-8 or binary (NUL "
                      "bytes); point data.path at UTF-8 text files")


def _sidecar(source: Corpus | HFSource, tok: Tokenizer, val_fraction: float, key: str,
             written: _Written, dtype: np.dtype, sep: np.ndarray) -> dict[str, Any]:
    """The sidecar's fields (the module docstring), and where the split falls."""
    n_train, n_val = written.n_train, written.n_val
    n_tokens = n_train + n_val
    split = "by_file"
    if val_fraction > 0 and (n_val == 0 or n_train == 0) and n_tokens >= 2:
        # Too few files for the by-file rule to put any on one side: fall back to the tail
        # of the stream. The layout is one contiguous stream, so only the boundary moves.
        split = "by_tokens"
        n_val = min(max(1, round(n_tokens * val_fraction)), n_tokens - 1)
        n_train = n_tokens - n_val
    # n_files counts every listed file; n_train_files + n_val_files count the documents
    # actually written (empty and non-UTF-8 files are listed but not written).
    # For a dataset, "files" are rows; their names (split/index) are not listed.
    hf = isinstance(source, HFSource)
    return {"format": _FORMAT, "key": key, "source": source.description,
            "root": str(source.path if hf else source.root), "files_hash": _files_hash(source),
            "n_files": source.n_rows if hf else len(source.files),
            "n_train_files": written.n_train_files, "n_val_files": len(written.val_files),
            "val_files": [] if hf else written.val_files, "skipped_non_utf8": written.skipped,
            "tokenizer": tok.name, "vocab_size": int(tok.vocab_size), "dtype": dtype.name,
            "separator": [int(i) for i in sep], "val_fraction": val_fraction, "split": split,
            "n_tokens": n_tokens, "n_train": n_train, "n_val": n_val,
            "checksum": {CHECKSUM: written.checksum}}


def _open(stem: Path, meta: dict[str, Any], tok: Tokenizer) -> TokenSplits:
    bin_path, _ = _paths(stem)
    dtype = np.dtype(meta["dtype"])
    n_train, n_val = int(meta["n_train"]), int(meta["n_val"])
    return TokenSplits(train=_map(bin_path, dtype, 0, n_train),
                       val=_map(bin_path, dtype, n_train * dtype.itemsize, n_val),
                       # equal to the sidecar's (cache_problem checks it)
                       vocab_size=int(tok.vocab_size), tokenizer=tok, meta=meta, path=bin_path)


def _map(path: Path, dtype: np.dtype, offset: int, length: int) -> np.ndarray:
    if length == 0:  # mmap cannot map zero bytes
        empty = np.empty(0, dtype=dtype)
        empty.flags.writeable = False
        return empty
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(length,))
