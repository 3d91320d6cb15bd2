"""The token cache's integrity: a content checksum written with the cache and verified on
every open, and a sidecar checked against the tokenizer. Damage of any kind is one warning
line naming the file and the reason, then a rebuild from the source; an intact cache opens
without either."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import warnings
from pathlib import Path

import numpy as np
import pytest

from meshfit.data import cache as cache_mod
from meshfit.data import load_tokens
from meshfit.data.cache import CHECKSUM


def _corpus(root: Path) -> Path:
    data = root / "corpus"
    (data / "sub").mkdir(parents=True)
    (data / "a.txt").write_text("alpha ünïcødé\n" * 50, encoding="utf-8")
    (data / "sub" / "b.md").write_text("beta 日本語 🚀\n" * 50, encoding="utf-8")
    (data / "c.txt").write_text("gamma\n" * 50, encoding="utf-8")
    return data


class SmallVocab:
    """A tokenizer of 100 ids (uint8 on disk): byte values folded into [0, 99)."""

    name, vocab_size, eos_id = "small-vocab-test", 100, 99

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8) % 99

    def decode(self, ids) -> str:
        return "".join(chr(32 + int(i)) for i in ids)


@pytest.fixture
def built(tmp_path, monkeypatch):
    """(corpus, cache folder, the first load, a counter of rebuilds after it)."""
    data, cache = _corpus(tmp_path), tmp_path / "cache"
    first = load_tokens(data, cache_dir=cache)
    builds = []
    real = cache_mod._build
    monkeypatch.setattr(cache_mod, "_build", lambda *a: builds.append(1) or real(*a))
    return data, cache, first, builds


def _load_quietly(data, cache, **kw):
    """load_tokens, with the warnings it gave (asserted one line each)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        splits = load_tokens(data, cache_dir=cache, **kw)
    messages = [str(w.message) for w in caught]
    assert all("\n" not in m for m in messages), messages
    return splits, messages


def _sidecar(splits) -> Path:
    return splits.path.with_suffix(".json")


def test_checksum_is_blake2b_128_of_the_file_and_an_intact_cache_opens(built):
    data, cache, first, builds = built
    recorded = first.meta["checksum"][CHECKSUM]
    raw = first.path.read_bytes()
    assert recorded == hashlib.blake2b(raw, digest_size=16).hexdigest()
    if shutil.which("b2sum"):  # the same digest as the coreutils tool's
        out = subprocess.run(["b2sum", "-l", "128", str(first.path)], capture_output=True,
                             text=True, check=True).stdout
        assert out.split()[0] == recorded
    again, messages = _load_quietly(data, cache)  # negative control: no warning, no build
    assert messages == [] and builds == [] and again.train.tobytes() == first.train.tobytes()


@pytest.mark.parametrize("damage", ["flip", "zeros"])
def test_same_size_damage_is_caught_and_rebuilt(built, damage):
    data, cache, first, builds = built
    good = first.path.read_bytes()
    size = first.path.stat().st_size
    with open(first.path, "r+b") as fh:  # in place: same inode, same size
        if damage == "flip":
            fh.seek(size // 2)
            byte = fh.read(1)
            fh.seek(size // 2)
            fh.write(bytes([byte[0] ^ 0x01]))
        else:
            fh.seek(100)
            fh.write(b"\0" * 64)
    assert first.path.stat().st_size == size and first.path.read_bytes() != good
    again, messages = _load_quietly(data, cache)
    assert len(messages) == 1 and str(first.path) in messages[0]
    assert "failed its checksum" in messages[0] and "rebuilding it" in messages[0]
    assert builds == [1] and again.path.read_bytes() == good
    _, messages = _load_quietly(data, cache)
    assert messages == [] and builds == [1]  # the rebuilt cache is trusted again


@pytest.mark.parametrize("field, value, said", [
    ("vocab_size", 50, "records vocab_size=50 where the tokenizer has 256"),
    ("tokenizer", "gpt2-abc", "records tokenizer='gpt2-abc'"),
    ("dtype", "uint16", "records dtype='uint16' where the tokenizer has 'uint8'"),
    ("separator", [0], "records separator=[0]"),
    ("n_train", 10, "n_train=10 + n_val="),
    ("n_tokens", "many", "damaged sidecar (ValueError"),
    ("checksum", "x", "records no blake2b-128 checksum"),
    ("checksum", None, "without a checksum"),  # None: the field removed (an older cache)
])
def test_edited_sidecar_is_one_line_then_rebuilt(built, field, value, said):
    data, cache, first, builds = built
    meta = json.loads(_sidecar(first).read_text())
    if value is None:
        del meta[field]
    else:
        meta[field] = value
    _sidecar(first).write_text(json.dumps(meta))
    again, messages = _load_quietly(data, cache)
    assert len(messages) == 1 and said in messages[0] and str(first.path) in messages[0]
    assert builds == [1] and again.vocab_size == 256
    assert again.train.tobytes() == first.train.tobytes()
    assert again.meta["checksum"] == first.meta["checksum"]


def test_ids_beyond_the_vocabulary_are_caught_even_with_a_matching_checksum(tmp_path):
    data, cache = _corpus(tmp_path), tmp_path / "cache"
    tok = SmallVocab()
    first = load_tokens(data, tokenizer=tok, cache_dir=cache)
    assert first.meta["dtype"] == "uint8" and int(np.max(first.train)) < 100
    raw = bytearray(first.path.read_bytes())
    raw[7] = 200  # fits uint8, not the vocabulary; the sidecar "fixed up" to match
    first.path.write_bytes(bytes(raw))
    meta = json.loads(_sidecar(first).read_text())
    meta["checksum"][CHECKSUM] = hashlib.blake2b(bytes(raw), digest_size=16).hexdigest()
    _sidecar(first).write_text(json.dumps(meta))
    again, messages = _load_quietly(data, cache, tokenizer=tok)
    assert len(messages) == 1 and "holds id 200, outside tokenizer.vocab_size=100" in messages[0]
    assert int(np.max(again.train)) < 100


def test_cache_problem_reads_every_chunk(built, monkeypatch):
    """Damage in the last of several chunks is found: the whole file is hashed."""
    data, cache, first, builds = built
    monkeypatch.setattr(cache_mod, "_CHUNK", 64)  # the file is ~1.5 kB: ~25 chunks
    assert cache_mod.cache_problem(first.path, first.meta, first.tokenizer, 0.02) is None
    size = first.path.stat().st_size
    with open(first.path, "r+b") as fh:
        fh.seek(size - 1)
        last = fh.read(1)
        fh.seek(size - 1)
        fh.write(bytes([last[0] ^ 0x80]))
    problem = cache_mod.cache_problem(first.path, first.meta, first.tokenizer, 0.02)
    assert problem is not None and "failed its checksum" in problem


@pytest.mark.parametrize("text, said", [("{", "is not JSON"), ("[1, 2]", "not a JSON object")])
def test_unreadable_sidecar_is_one_line_then_rebuilt(built, text, said):
    data, cache, first, builds = built
    _sidecar(first).write_text(text)
    again, messages = _load_quietly(data, cache)
    assert len(messages) == 1 and said in messages[0] and str(first.path) in messages[0]
    assert builds == [1] and again.train.tobytes() == first.train.tobytes()
