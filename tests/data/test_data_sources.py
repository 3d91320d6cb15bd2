"""Tests for meshfit.data's sources: Hugging Face tokenizers (folder, tokenizer.json, saved
and read back), documents packed with EOS, `datasets` datasets on disk, TokenStream, and
the [data] config fields."""

from __future__ import annotations

import json
import shutil
import sys

import datasets
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

import meshfit.data.cache as cache_mod
from meshfit.data import (
    ByteTokenizer,
    HFTokenizer,
    TokenDataset,
    TokenStream,
    load_tokenizer,
    load_tokens,
)
from meshfit.data.corpus import is_validation
from meshfit.train.config import DataConfig

SENTENCES = ["the cat sat on the mat", "a dog ran far away", "the bird sang a song",
             "cats and dogs sat together", "far away the song ran on"]
DOCS = ["the cat sat", "a dog ran far away\nthe bird sang", "song and mat", "on the mat",
        "cats sat together far away", "the dog sang a song"]


def _train(sentences: list[str], specials=("[UNK]", "</s>")) -> RawTokenizer:
    tok = RawTokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(sentences, trainers.WordLevelTrainer(special_tokens=list(specials)))
    return tok


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    """A real WordLevel tokenizer saved as tokenizer.json and as a transformers folder with
    eos_token "</s>", and the reference objects to check against."""
    root = tmp_path_factory.mktemp("tokenizers")
    raw = _train(SENTENCES)
    raw.save(str(root / "tokenizer.json"))
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", unk_token="[UNK]")
    fast.save_pretrained(str(root / "hf"))
    ref = AutoTokenizer.from_pretrained(str(root / "hf"), local_files_only=True)
    return {"root": root, "json": root / "tokenizer.json", "folder": root / "hf", "raw": raw,
            "ref": ref, "eos": raw.token_to_id("</s>")}


def _packed(encode, docs, eos) -> list[int]:
    """The reference stream: each document's ids, then EOS."""
    return [i for d in docs for i in [*encode(d), eos]]


def _one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text, text
    return text


# ---------------------------------------------------------------- tokenizers


def test_load_tokenizer_reads_bytes_json_and_folder(toks):
    assert isinstance(load_tokenizer("bytes"), ByteTokenizer)
    assert isinstance(load_tokenizer(""), ByteTokenizer)  # an unset config string
    from_json = load_tokenizer(toks["json"])
    from_folder = load_tokenizer(str(toks["folder"]))
    text = "the cat ran far"
    for tok in (from_json, from_folder):
        assert isinstance(tok, HFTokenizer)
        assert tok.eos_id == toks["eos"] and tok.vocab_size == toks["raw"].get_vocab_size()
        assert tok.encode(text).tolist() == toks["raw"].encode(text).ids
        assert tok.encode(text).tolist() == toks["ref"].encode(text, add_special_tokens=False)
    assert from_folder.hf.eos_token == "</s>"


@pytest.mark.parametrize("spec", ["bytes", "json", "folder"])
def test_saved_tokenizer_reads_back(toks, tmp_path, spec):
    tok = load_tokenizer(spec if spec == "bytes" else toks[spec])
    tok.save(tmp_path / "model")
    back = load_tokenizer(tmp_path / "model")
    assert type(back) is type(tok) and back.name == tok.name and back.eos_id == tok.eos_id
    text = "the bird sang on the mat"
    assert back.encode(text).tolist() == tok.encode(text).tolist()
    if spec == "bytes":
        assert json.loads((tmp_path / "model" / "meshfit_tokenizer.json").read_text()) == \
            {"kind": "bytes"}


def test_tokenizer_json_eos_from_config_beside_it(tmp_path):
    raw = _train(SENTENCES, specials=("[UNK]", "[SEP]", "[END]"))
    raw.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError) as err:  # no EOS-like special token, nothing says which
        load_tokens(tmp_path / "tokenizer.json", tokenizer=tmp_path / "tokenizer.json",
                    cache_dir=tmp_path / "cache")
    msg = _one_line(err)
    assert "has no EOS token" in msg and "eos_token" in msg and "tokenizers" in msg
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "[END]"}))
    assert load_tokenizer(tmp_path / "tokenizer.json").eos_id == raw.token_to_id("[END]")


def test_hf_folder_without_eos_is_refused(tmp_path):
    fast = PreTrainedTokenizerFast(tokenizer_object=_train(SENTENCES), unk_token="[UNK]")
    fast.save_pretrained(str(tmp_path / "no-eos"))
    (tmp_path / "a.txt").write_text("the cat sat", encoding="utf-8")
    with pytest.raises(ValueError) as err:
        load_tokens(tmp_path / "a.txt", tokenizer=str(tmp_path / "no-eos"),
                    cache_dir=tmp_path / "cache")
    assert "no-eos" in _one_line(err) and "has no EOS token" in str(err.value)


def test_bad_tokenizer_specs_name_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"data\.tokenizer='.*missing' does not exist") as err:
        load_tokenizer(tmp_path / "missing")
    _one_line(err)
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"data\.tokenizer=.*not a tokenizers") as err:
        load_tokenizer(tmp_path / "junk.json")
    _one_line(err)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"data\.tokenizer=.*could not be read") as err:
        load_tokenizer(tmp_path / "empty")
    _one_line(err)


# ---------------------------------------------------------------- files packed with EOS


def test_cached_stream_is_each_document_encoded_then_eos(toks, tmp_path):
    data = tmp_path / "docs"
    data.mkdir()
    for i, d in enumerate(DOCS):
        (data / f"{i:02d}.txt").write_text(d, encoding="utf-8")
    s = load_tokens(data, tokenizer=str(toks["folder"]), cache_dir=tmp_path / "c",
                    val_fraction=0)
    ref = toks["ref"]
    want = _packed(lambda d: ref.encode(d, add_special_tokens=False), DOCS, ref.eos_token_id)
    assert s.train.tolist() == want and s.val.size == 0
    assert s.vocab_size == len(ref) and s.train.dtype == np.uint8
    assert isinstance(s.tokenizer, HFTokenizer) and s.meta["separator"] == [toks["eos"]]
    # The windows TokenDataset cuts run across document boundaries, EOS between them.
    x, y = TokenDataset(s.train, seq_len=5)[1]
    assert x.tolist() == want[5:10] and y.tolist() == want[6:11]


def test_changing_the_tokenizer_invalidates_the_cache(toks, tmp_path):
    data = tmp_path / "docs.txt"
    data.write_text("\n".join(DOCS), encoding="utf-8")
    tok_file = tmp_path / "tok" / "tokenizer.json"
    tok_file.parent.mkdir()
    shutil.copy(toks["json"], tok_file)
    first = load_tokens(data, tokenizer=tok_file, cache_dir=tmp_path / "c", val_fraction=0)
    copy = tmp_path / "elsewhere.json"
    shutil.copy(toks["json"], copy)  # the same tokenizer under another path: same cache
    assert load_tokens(data, tokenizer=copy, cache_dir=tmp_path / "c",
                       val_fraction=0).path == first.path
    retrained = _train([*SENTENCES, "zebra zebra zebra dances", "dances the zebra"])
    retrained.save(str(tok_file))  # same path, new vocabulary
    second = load_tokens(data, tokenizer=tok_file, cache_dir=tmp_path / "c", val_fraction=0)
    assert second.path != first.path and second.meta["key"] != first.meta["key"]
    eos = retrained.token_to_id("</s>")
    text = "\n".join(DOCS)
    assert second.train.tolist() == retrained.encode(text).ids + [eos]
    assert first.train.tolist() == toks["raw"].encode(text).ids + [toks["eos"]]
    assert second.train.tolist() != first.train.tolist()


# ---------------------------------------------------------------- datasets on disk


def test_dataset_saved_to_disk_round_trip(toks, tmp_path):
    rows = {"text": DOCS * 5, "id": list(range(len(DOCS) * 5))}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "ds"))
    s = load_tokens(hf_dataset=str(tmp_path / "ds"), tokenizer=str(toks["folder"]),
                    cache_dir=tmp_path / "c", val_fraction=0.3)
    raw, eos = toks["raw"], toks["eos"]
    val_rows = [i for i in range(len(rows["text"])) if is_validation(f"train/{i}", 0.3)]
    assert 0 < len(val_rows) < len(rows["text"])  # the same by-hash rule as files
    train = [t for i, t in enumerate(rows["text"]) if i not in val_rows]
    assert s.train.tolist() == _packed(lambda d: raw.encode(d).ids, train, eos)
    assert s.val.tolist() == _packed(lambda d: raw.encode(d).ids,
                                     [rows["text"][i] for i in val_rows], eos)
    assert s.meta["split"] == "by_file" and s.meta["n_val_files"] == len(val_rows)

    builds = []
    real = cache_mod._build
    cache_mod._build = lambda *a: builds.append(1) or real(*a)
    try:
        again = load_tokens(hf_dataset=str(tmp_path / "ds"), tokenizer=str(toks["folder"]),
                            cache_dir=tmp_path / "c", val_fraction=0.3)
        assert builds == [] and again.path == s.path  # same fingerprint: cache reused
        changed = {"text": ["a dog", *DOCS[1:]], "id": list(range(len(DOCS)))}
        shutil.rmtree(tmp_path / "ds")
        datasets.Dataset.from_dict(changed).save_to_disk(str(tmp_path / "ds"))
        third = load_tokens(hf_dataset=str(tmp_path / "ds"), tokenizer=str(toks["folder"]),
                            cache_dir=tmp_path / "c", val_fraction=0)
        assert builds == [1] and third.path != s.path
        assert third.train.tolist() == _packed(lambda d: raw.encode(d).ids, changed["text"], eos)
    finally:
        cache_mod._build = real


def test_dataset_dict_uses_train_and_validation_splits(toks, tmp_path):
    dd = datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"body": DOCS[:4]}),
        "validation": datasets.Dataset.from_dict({"body": ["", DOCS[4]]}),  # "" is skipped
        "test": datasets.Dataset.from_dict({"body": ["never used"]}),
    })
    dd.save_to_disk(str(tmp_path / "dd"))
    s = load_tokens(hf_dataset=tmp_path / "dd", text_column="body", tokenizer=toks["json"],
                    cache_dir=tmp_path / "c")
    enc, eos = (lambda d: toks["raw"].encode(d).ids), toks["eos"]
    assert s.train.tolist() == _packed(enc, DOCS[:4], eos)
    assert s.val.tolist() == _packed(enc, DOCS[4:5], eos)
    none = load_tokens(hf_dataset=tmp_path / "dd", text_column="body", tokenizer=toks["json"],
                       cache_dir=tmp_path / "c", val_fraction=0)
    assert none.val.size == 0 and none.train.tolist() == s.train.tolist()


def test_load_dataset_reads_a_data_folder_offline(tmp_path):
    folder = tmp_path / "files"
    folder.mkdir()
    (folder / "train.txt").write_text("first line\nsecond line\n", encoding="utf-8")
    (folder / "validation.txt").write_text("held out\n", encoding="utf-8")
    before = datasets.config.HF_HUB_OFFLINE
    s = load_tokens(hf_dataset=folder, cache_dir=tmp_path / "c")  # bytes: "\n\n" separates
    assert s.train.tobytes() == b"first line\n\nsecond line\n\n"
    assert s.val.tobytes() == b"held out\n\n"
    assert datasets.config.HF_HUB_OFFLINE == before  # the offline switch is undone
    assert "load_dataset" in s.meta["source"]


def test_dataset_errors_name_the_field(tmp_path, monkeypatch):
    datasets.Dataset.from_dict({"text": ["a"], "n": [1]}).save_to_disk(str(tmp_path / "ds"))
    datasets.DatasetDict({"other": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(
        str(tmp_path / "dd"))
    cases = [
        (dict(hf_dataset=tmp_path / "missing"), r"data\.hf_dataset='.*missing' does not exist"),
        (dict(hf_dataset=tmp_path / "ds", text_column="body"),
         r"data\.text_column='body' is not a column .* its columns are \['text', 'n'\]"),
        (dict(hf_dataset=tmp_path / "ds", text_column="n"),
         r"data\.text_column='n' .* holds int64, not strings"),
        (dict(hf_dataset=tmp_path / "dd"), r"data\.hf_dataset=.* has splits \['other'\] but no "
                                            r"'train' split"),
        (dict(path=tmp_path, hf_dataset=tmp_path / "ds"), r"data\.path=.* and data\.hf_dataset="
                                                         r".* are mutually exclusive"),
    ]
    for kwargs, pattern in cases:
        with pytest.raises(ValueError, match=pattern) as err:
            load_tokens(cache_dir=tmp_path / "c", **kwargs)
        _one_line(err)
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` now fails
    with pytest.raises(ValueError, match=r'data\.hf_dataset=.*pip install "meshfit\[data\]"'):
        load_tokens(hf_dataset=tmp_path / "ds", cache_dir=tmp_path / "c")


_ROW = json.dumps({"text": "a row", "n": 1})


@pytest.mark.parametrize("name, content, expected", [
    ("rows.jsonl", f"{_ROW}\n{_ROW[:-4]}\n{_ROW}\n", r"rows\.jsonl', line 2: not valid JSON at "
     r"column \d+ \(Expecting .*\); write one JSON object per line$"),
    ("rows.jsonl", f"{_ROW}\n\n{_ROW[:-1]}, \"text\": \"b\"}}\n", r"rows\.jsonl', line 3: key "
     r"'text' appears twice in one object; keep one of them$"),
    ("rows.jsonl", f"{_ROW}\n[1, 2]\n", r"rows\.jsonl', line 2: a JSON array where a row must "
     r"be an object"),
    ("rows.jsonl", "", r"rows\.jsonl': the file is empty \(no rows\); give a file holding one "
     r"JSON object per line$"),
    ("rows.jsonl", f"{_ROW}\n".encode() + b'{"text": "caf\xe9"}\n', r"rows\.jsonl', line 2: "
     r"byte 0xe9 \(byte 14 of the line\) is not UTF-8; save the file as UTF-8"),
    ("rows.json", f"[{_ROW}, 3]", r"rows\.json': item 1 of the array is a JSON number, not an "
     r"object"),
    ("texts.txt", b"caf\xe9\n", r"texts\.txt', line 1: byte 0xe9"),
    ("folder/validation.jsonl", f"{_ROW}\n{{\"text\": }}\n", r"folder' \(file "
     r"validation\.jsonl\), line 2: not valid JSON"),
], ids=["bad-json", "key-twice", "not-an-object", "empty", "not-utf8", "array-item",
        "text-not-utf8", "folder"])
def test_bad_data_files_are_one_line_naming_the_file_and_line(tmp_path, name, content,
                                                             expected):
    """A data file that `datasets` cannot read or would read wrongly -- a bad JSON line, a key
    twice in one object, a row that is not an object, an empty file, bytes that are not
    UTF-8 (pyarrow loads those unchecked, and decoding the row fails later, naming nothing)
    -- is one line naming the file, the line and the fix, before anything is tokenized;
    not "give a folder written by save_to_disk" nor "StopIteration"."""
    from meshfit.data.hf import open_hf_dataset

    path = tmp_path / name
    path.parent.mkdir(exist_ok=True)
    if name.startswith("folder/"):
        (path.parent / "train.jsonl").write_text(f"{_ROW}\n")
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    target = path.parent if name.startswith("folder/") else path
    with pytest.raises(ValueError, match=expected) as err:
        open_hf_dataset(target, None, cache_dir=tmp_path / "cache")
    assert str(err.value).startswith(f"data.hf_dataset='{target}'")
    assert "save_to_disk" not in str(err.value)
    _one_line(err)


# ---------------------------------------------------------------- TokenStream


def test_token_stream_matches_the_cached_windows(toks, tmp_path):
    texts = DOCS * 4
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "ds"))
    cached = load_tokens(hf_dataset=tmp_path / "ds", tokenizer=toks["folder"],
                         cache_dir=tmp_path / "c", val_fraction=0)
    ref = TokenDataset(cached.train, seq_len=6)
    ds = datasets.load_from_disk(str(tmp_path / "ds"))
    for source in (texts, lambda: iter(texts), ds):  # a list, a function, dataset rows
        windows = list(TokenStream(source, toks["folder"], seq_len=6))
        assert len(windows) == len(ref)
        for (x, y), (rx, ry) in zip(windows, (ref[i] for i in range(len(ref)))):
            assert torch.equal(x, rx) and torch.equal(y, ry) and x.dtype == torch.int64


def test_token_stream_refusals(toks, tmp_path):
    with pytest.raises(ValueError, match="one-shot iterator"):
        TokenStream(iter(DOCS), seq_len=4)
    with pytest.raises(ValueError, match=r"TokenStream\.seq_len=0"):
        TokenStream(DOCS, seq_len=0)
    with pytest.raises(ValueError, match="yielded a int"):
        list(TokenStream([1, 2], seq_len=4))
    fast = PreTrainedTokenizerFast(tokenizer_object=_train(SENTENCES), unk_token="[UNK]")
    with pytest.raises(ValueError, match="has no EOS token"):
        TokenStream(DOCS, fast, seq_len=4)


# ---------------------------------------------------------------- [data] config


def test_data_config_fields(toks, tmp_path):
    ok = DataConfig(tokenizer=str(toks["folder"]), hf_dataset=str(tmp_path), text_column="t")
    assert (ok.tokenizer, ok.hf_dataset, ok.text_column) == (str(toks["folder"]),
                                                             str(tmp_path), "t")
    assert (DataConfig().tokenizer, DataConfig().hf_dataset, DataConfig().text_column) == \
        ("bytes", "", "text")
    cases = [
        (dict(tokenizer=str(tmp_path / "nope")), r"data\.tokenizer='.*nope' does not exist"),
        (dict(tokenizer=3), r"data\.tokenizer=3 must be \"bytes\""),
        (dict(hf_dataset=str(tmp_path / "nope")), r"data\.hf_dataset='.*nope' does not exist"),
        (dict(path=str(tmp_path), hf_dataset=str(tmp_path)), r"mutually exclusive"),
        (dict(text_column=""), r"data\.text_column='' must be a column name"),
        (dict(text_column=3), r"data\.text_column=3"),
    ]
    for kwargs, pattern in cases:
        with pytest.raises(ValueError, match=pattern) as err:
            DataConfig(**kwargs)
        _one_line(err)
