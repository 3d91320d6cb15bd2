"""Tests for meshfit.data: corpus discovery, tokenizers, the token cache, TokenDataset."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

import meshfit.data.cache as cache_mod
from meshfit.data import (
    ByteTokenizer,
    HFTokenizer,
    TokenDataset,
    as_tokenizer,
    load_tokens,
    stdlib_corpus_files,
)
from meshfit.data.corpus import is_validation, stdlib_root

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _cache_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _make_folder(root: Path) -> Path:
    data = root / "corpus"
    (data / "sub").mkdir(parents=True)
    (data / "a.txt").write_text("alpha ünïcødé\n", encoding="utf-8")
    (data / "sub" / "b.md").write_text("beta 日本語 🚀\n", encoding="utf-8")
    (data / "c.txt").write_text("gamma\n", encoding="utf-8")
    return data


@pytest.fixture(scope="module")
def stdlib_splits(tmp_path_factory):
    return load_tokens(cache_dir=tmp_path_factory.mktemp("stdlib-cache"))


# ---------------------------------------------------------------- corpus and tokenizer


def test_stdlib_corpus_found_and_large():
    files = stdlib_corpus_files()
    root = stdlib_root()
    rels = [f.relative_to(root).as_posix() for f in files]
    assert rels == sorted(rels) and len(set(rels)) == len(rels)
    assert all(r.endswith(".py") for r in rels)
    assert not any({"site-packages", "test", "tests"} & set(r.split("/")) for r in rels)
    assert "os.py" in rels
    assert sum(f.stat().st_size for f in files) > 5_000_000


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "plain ascii, ünïcødé, 日本語, emoji 🚀👩‍💻, combining é, \x00 nul, \r\n crlf"
    ids = tok.encode(text)
    assert ids.dtype == np.uint8 and ids.tobytes() == text.encode("utf-8")
    assert tok.decode(ids) == text
    assert tok.decode(list(ids)) == text
    assert tok.vocab_size == 256 and as_tokenizer(None).name == tok.name


def test_hf_style_tokenizer_is_wrapped():
    class FakeHF:  # the slice of the transformers tokenizer API that HFTokenizer uses
        name_or_path = "fake/char"
        eos_token_id = 0

        def __init__(self):
            self.vocab = {"<eos>": 0, **{chr(c): c - 31 for c in range(32, 127)}}

        def get_vocab(self):
            return dict(self.vocab)

        def __len__(self):
            return len(self.vocab)

        def encode(self, text, add_special_tokens=True):
            return [self.vocab[c] for c in text]

        def decode(self, ids):
            inv = {v: k for k, v in self.vocab.items()}
            return "".join(inv[i] for i in ids)

    tok = as_tokenizer(FakeHF())
    assert isinstance(tok, HFTokenizer) and tok.eos_id == 0 and tok.vocab_size == 96
    assert tok.decode(tok.encode("Hello!")) == "Hello!"
    with pytest.raises(ValueError, match="tokenizer="):
        as_tokenizer(object())


# ---------------------------------------------------------------- load_tokens


def test_stdlib_splits(stdlib_splits):
    s = stdlib_splits
    assert s.vocab_size == 256 and s.train.dtype == np.uint8 and s.meta["split"] == "by_file"
    assert isinstance(s.train, np.memmap) and isinstance(s.val, np.memmap)
    assert not s.train.flags.writeable and not s.val.flags.writeable
    assert s.train.size > 5_000_000 and s.val.size >= 100_000
    assert s.train.size + s.val.size == s.meta["n_tokens"] == s.path.stat().st_size


def test_split_deterministic_and_disjoint_by_file(stdlib_splits, tmp_path):
    s = stdlib_splits
    root = stdlib_root()
    rels = [f.relative_to(root).as_posix() for f in stdlib_corpus_files()]
    docs = {r: (root / r).read_bytes() for r in rels}
    val = [r for r in rels if is_validation(r, 0.02) and docs[r]]
    train = [r for r in rels if not is_validation(r, 0.02) and docs[r]]
    assert s.meta["val_files"] == val and not set(val) & set(train)
    # The streams are exactly the files' bytes, in sorted order, each followed by "\n\n":
    # so no file contributes to both halves.
    assert s.val.tobytes() == b"".join(docs[r] + b"\n\n" for r in val)
    assert s.train.tobytes() == b"".join(docs[r] + b"\n\n" for r in train)
    again = load_tokens(cache_dir=tmp_path)  # fresh cache: rebuilt from scratch
    assert np.array_equal(again.train, s.train) and np.array_equal(again.val, s.val)
    assert again.meta["key"] == s.meta["key"]


def test_cache_written_once_then_reused(stdlib_splits, tmp_path, monkeypatch):
    cache = stdlib_splits.path.parent
    before = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    assert sorted(before) == [stdlib_splits.path.name, stdlib_splits.path.stem + ".json"]

    def no_rebuild(*args, **kwargs):
        raise AssertionError("cache was rebuilt although a valid one exists")

    monkeypatch.setattr(cache_mod, "_build", no_rebuild)
    again = load_tokens(cache_dir=cache)
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == before
    assert np.array_equal(again.val, stdlib_splits.val)


def test_cache_invalidated_when_a_file_changes(tmp_path):
    data = _make_folder(tmp_path)
    first = load_tokens(data, cache_dir=tmp_path / "cache", val_fraction=0)
    (data / "c.txt").write_text("gamma, edited\n", encoding="utf-8")
    second = load_tokens(data, cache_dir=tmp_path / "cache", val_fraction=0)
    assert second.path != first.path
    assert b"\n\n\ngamma, edited\n\n\n" in second.train.tobytes()


def test_user_folder(tmp_path):
    data = _make_folder(tmp_path)
    (data / ".hidden").mkdir()
    (data / ".hidden" / "x.txt").write_text("hidden", encoding="utf-8")
    (data / ".DS_Store").write_bytes(b"meta")
    (data / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))  # not UTF-8
    (data / "empty.txt").write_bytes(b"")
    (data / "zeros.bin").write_bytes(bytes(4096))  # valid UTF-8, but binary: NUL bytes
    with pytest.warns(UserWarning, match=r"skipped 2 of 6 files that are not UTF-8 text \(not "
                                         r"valid UTF-8, or binary: NUL bytes\)"):
        s = load_tokens(data, cache_dir=tmp_path / "cache", val_fraction=0)
    expected = "alpha ünïcødé\n\n\ngamma\n\n\nbeta 日本語 🚀\n\n\n"  # a.txt, c.txt, sub/b.md
    assert s.tokenizer.decode(s.train) == expected
    assert s.val.size == 0 and s.meta["skipped_non_utf8"] == ["latin1.txt", "zeros.bin"]


def test_data_that_is_not_text_is_refused(tmp_path):
    """20 MB of NUL bytes used to train as "19.6M training tokens": now no text is found."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "blob.txt").write_bytes(bytes(1 << 20))
    with pytest.raises(ValueError, match=r"data.path holds no text: all 1 files of .* are "
                                         r"empty, not valid UTF-8 or binary \(NUL bytes\)"):
        load_tokens(data, cache_dir=tmp_path / "cache", val_fraction=0)


def test_user_file_splits_by_tokens(tmp_path):
    text = "".join(f"line {i} ✓\n" for i in range(200))
    f = tmp_path / "one.txt"
    f.write_text(text, encoding="utf-8")
    s = load_tokens(f, cache_dir=tmp_path / "cache", val_fraction=0.1)
    # One file cannot be split by file, so the tail of the stream is the validation part.
    assert s.meta["split"] == "by_tokens"
    n = len(text.encode("utf-8")) + 2
    assert s.val.size == round(n * 0.1) and s.train.size + s.val.size == n
    assert np.concatenate([s.train, s.val]).tobytes() == text.encode("utf-8") + b"\n\n"


def test_protocol_tokenizer_uses_wide_dtype_and_eos(tmp_path):
    class CodePoints:  # vocab > 256 forces uint16 on disk
        name, vocab_size, eos_id = "codepoints-bmp", 65536, 0

        def encode(self, text):
            return np.array([min(ord(c), 1) if ord(c) > 0xFFFF else ord(c) for c in text],
                            dtype=np.uint16)  # outside the BMP -> 1, an "unknown" id

        def decode(self, ids):
            return "".join(chr(i) for i in ids)

    data = _make_folder(tmp_path)
    s = load_tokens(data, tokenizer=CodePoints(), cache_dir=tmp_path / "cache", val_fraction=0)
    assert s.train.dtype == np.uint16 and s.vocab_size == 65536
    docs = [list(map(ord, "alpha ünïcødé\n")), list(map(ord, "gamma\n"))]
    assert s.train.tolist()[: len(docs[0]) + len(docs[1]) + 2] == docs[0] + [0] + docs[1] + [0]


def test_ids_outside_vocab_are_rejected(tmp_path):
    class TooSmall:
        name, vocab_size, eos_id = "ord-but-vocab-10", 10, None

        def encode(self, text):
            return [ord(c) for c in text]

        def decode(self, ids):
            return "".join(map(chr, ids))

    with pytest.raises(ValueError, match=r"outside tokenizer\.vocab_size=10"):
        load_tokens(_make_folder(tmp_path), tokenizer=TooSmall(), cache_dir=tmp_path / "c")
    assert _cache_files(tmp_path / "c") == []


def test_missing_path_names_the_field(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match=r"data\.path='.*nope' does not exist; give a text file"):
        load_tokens(missing, cache_dir=tmp_path / "cache")
    with pytest.raises(ValueError, match=r"data\.val_fraction=1\.5"):
        load_tokens(cache_dir=tmp_path / "cache", val_fraction=1.5)


# ---------------------------------------------------------------- crash and concurrency


def test_crash_mid_write_leaves_nothing_trusted(tmp_path, monkeypatch):
    data = _make_folder(tmp_path)
    cache = tmp_path / "cache"
    real = cache_mod._documents

    def dies_after_one(*args, **kwargs):
        gen = real(*args, **kwargs)
        yield next(gen)
        raise RuntimeError("simulated crash while writing tokens")

    monkeypatch.setattr(cache_mod, "_documents", dies_after_one)
    with pytest.raises(RuntimeError, match="simulated crash"):
        load_tokens(data, cache_dir=cache, val_fraction=0)
    assert _cache_files(cache) == []  # temp file removed, nothing renamed into place
    monkeypatch.setattr(cache_mod, "_documents", real)
    s = load_tokens(data, cache_dir=cache, val_fraction=0)
    assert s.train.size == s.meta["n_tokens"] > 0


def test_bin_without_sidecar_or_truncated_bin_is_rebuilt(tmp_path, monkeypatch):
    data = _make_folder(tmp_path)
    cache = tmp_path / "cache"
    real_write = cache_mod.atomic_write

    def crash_before_sidecar(dest, fill):
        if dest.suffix == ".json":
            raise KeyboardInterrupt  # BaseException: the temp file must still go
        real_write(dest, fill)

    monkeypatch.setattr(cache_mod, "atomic_write", crash_before_sidecar)
    with pytest.raises(KeyboardInterrupt):
        load_tokens(data, cache_dir=cache, val_fraction=0)
    monkeypatch.setattr(cache_mod, "atomic_write", real_write)
    assert [n[-4:] for n in _cache_files(cache)] == [".bin"]  # data, but no commit marker

    builds = []
    real_build = cache_mod._build
    monkeypatch.setattr(cache_mod, "_build", lambda *a: builds.append(1) or real_build(*a))
    good = load_tokens(data, cache_dir=cache, val_fraction=0)
    assert len(builds) == 1
    expected = good.train.tobytes()
    with open(good.path, "r+b") as f:  # a torn .bin under a valid sidecar
        f.truncate(5)
    again = load_tokens(data, cache_dir=cache, val_fraction=0)
    assert len(builds) == 2 and again.train.tobytes() == expected


# Subprocess roles: this file doubles as a script (see the bottom), so the code each child
# process runs is ordinary, readable functions rather than strings.


def _spawn(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, __file__, *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _barrier(name: str, rank: int, n: int, timeout: float = 120) -> None:
    """File-based barrier: no ports, no process group, works across any processes."""
    Path(f"{name}.{rank}").touch()
    end = time.monotonic() + timeout
    while not all(Path(f"{name}.{r}").exists() for r in range(n)):
        assert time.monotonic() < end, f"barrier {name} timed out"
        time.sleep(0.002)


def _rank(folder: str, cache: str, n: int, rank: int) -> str:
    """One rank of the concurrency test: load the stdlib tokens, report what it saw."""
    real_build, built = cache_mod._build, []

    def build_together(*args):
        # Every rank has found no cache and is about to write: wait for all of them, so the
        # writes really race instead of one rank finishing before the others look.
        _barrier(f"{folder}/building", rank, n)
        built.append(1)
        return real_build(*args)

    cache_mod._build = build_together
    try:
        _barrier(f"{folder}/imported", rank, n)  # start together despite slow imports
        s = load_tokens(cache_dir=cache)
    finally:
        cache_mod._build = real_build
    return f"{len(built)} {s.meta['n_tokens']} {zlib.crc32(s.train)} {zlib.crc32(s.val)}"


def _crash(folder: str, cache: str) -> None:
    """Die after the first document is written. os._exit skips every finally/except: the
    closest thing to kill -9 or a node failure."""
    real = cache_mod._documents

    def die(*args, **kwargs):
        gen = real(*args, **kwargs)
        yield next(gen)
        os._exit(17)

    cache_mod._documents = die
    load_tokens(folder, cache_dir=cache, val_fraction=0)


def test_hard_kill_mid_write_then_recovery(tmp_path):
    data = _make_folder(tmp_path)
    cache = tmp_path / "cache"
    proc = _spawn("crash", str(data), str(cache))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 17, err
    left = _cache_files(cache)
    assert len(left) == 1 and left[0].startswith(".") and left[0].endswith(".tmp")
    s = load_tokens(data, cache_dir=cache, val_fraction=0)
    assert s.tokenizer.decode(s.train).startswith("alpha ünïcødé\n\n\ngamma")


def test_concurrent_ranks_share_one_cache(stdlib_splits, tmp_path):
    cache = tmp_path / "cache"
    n = 3  # rank 0 runs in this process; each subprocess rank costs an import of torch
    procs = [_spawn("rank", str(tmp_path), str(cache), str(n), str(r)) for r in range(1, n)]
    outs = [_rank(str(tmp_path), str(cache), n, 0)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(out.strip())
    s = stdlib_splits
    # Every rank built (the race happened) and all mapped the same, complete tokens.
    assert set(outs) == {f"1 {s.meta['n_tokens']} {zlib.crc32(s.train)} {zlib.crc32(s.val)}"}
    assert _cache_files(cache) == [s.path.name, s.path.stem + ".json"]  # no temp left over


# ---------------------------------------------------------------- TokenDataset


def test_token_dataset_windows_shift_by_one_and_cover():
    tokens = np.arange(1005, dtype=np.uint16)
    ds = TokenDataset(tokens, seq_len=10)
    assert len(ds) == (1005 - 1) // 10 == 100
    xs, ys = zip(*(ds[i] for i in range(len(ds))))
    for i, (x, y) in enumerate(zip(xs, ys)):
        assert x.dtype == torch.int64 and x.shape == y.shape == (10,)
        assert torch.equal(x, torch.arange(i * 10, i * 10 + 10))
        assert torch.equal(y, x + 1)
    assert torch.equal(torch.cat(xs), torch.arange(1000))  # non-overlapping, no gaps
    assert torch.equal(ds[-1][0], xs[-1])
    with pytest.raises(IndexError):
        ds[100]
    assert len(list(iter(ds))) == 100  # plain iteration stops at IndexError


def test_token_dataset_validation():
    with pytest.raises(ValueError, match=r"TokenDataset\.seq_len=0 must be an int >= 1"):
        TokenDataset(np.arange(10), seq_len=0)
    with pytest.raises(ValueError, match=r"seq_len\+1=10 tokens.*tokens has 9"):
        TokenDataset(np.arange(9), seq_len=9)
    assert len(TokenDataset(np.arange(10), seq_len=9)) == 1


def test_token_dataset_pickles_memmap_by_reference(stdlib_splits):
    ds = TokenDataset(stdlib_splits.train, seq_len=256)
    blob = pickle.dumps(ds)
    assert len(blob) < 10_000  # the file name travels, not 12 MB of tokens
    back = pickle.loads(blob)
    assert isinstance(back.tokens, np.memmap)
    for i in (0, 7, len(ds) - 1):
        assert all(torch.equal(a, b) for a, b in zip(back[i], ds[i]))
    val = pickle.loads(pickle.dumps(TokenDataset(stdlib_splits.val, seq_len=64)))
    assert torch.equal(val[3][0], TokenDataset(stdlib_splits.val, seq_len=64)[3][0])


if __name__ == "__main__":
    if sys.argv[1] == "rank":
        print(_rank(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])))
    elif sys.argv[1] == "crash":
        _crash(sys.argv[2], sys.argv[3])
