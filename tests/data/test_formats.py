"""The data formats' registry (`meshfit.data.formats`): what [data] is checked against, what
the trainer's masked flag and a run's loader come from, so that a new format is an entry
in `meshfit.data` and nothing else."""

from __future__ import annotations

import dataclasses
import importlib
import json
import types

import pytest

from meshfit.data import formats
from meshfit.train.config import DataConfig
from meshfit.train.configfile import build_config


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A word-level transformers tokenizer (one token a word, EOS "</s>") and six prompt /
    completion rows."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    tmp = tmp_path_factory.mktemp("formats")
    words = "the quick brown fox jumps over a lazy dog".split()
    vocab = {w: i for i, w in enumerate(["<unk>", "<pad>", "</s>", *words])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>",
                                         pad_token="<pad>",
                                         unk_token="<unk>").save_pretrained(tmp / "tok")
    rows = [{"prompt": " ".join(words[i:i + 2]), "completion": " " + " ".join(words[i + 2:i + 5])}
            for i in range(6)]
    (tmp / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp, rows, vocab


def test_the_format_list_and_the_column_defaults_are_the_documented_ones():
    """One list, in the order messages give it; each column key a [data] field whose
    default is the documented column name."""
    from meshfit.data import examples

    assert formats.FORMATS == examples.FORMATS == ("text", "completion", "chat")
    fields = {f.name: f.default for f in dataclasses.fields(DataConfig)}
    assert formats.column_keys() == {"text_column": "text", "prompt_column": "prompt",
                                     "completion_column": "completion",
                                     "messages_column": "messages"}
    assert {key: fields[key] for key in formats.column_keys()} == formats.column_keys()
    for fmt in formats.DATA_FORMATS.values():  # each loader is there, by the name given
        module, _, name = fmt.loader.partition(":")
        assert callable(getattr(importlib.import_module(module), name)), fmt.loader
    with pytest.raises(ValueError, match="data.format='dialogue' must be one of 'text', "
                                         "'completion', 'chat'$"):
        DataConfig(format="dialogue")
    with pytest.raises(ValueError, match='data.messages_column=\'\' must be a column name, '
                                         'e.g. "messages"'):
        DataConfig(messages_column="")


@pytest.mark.parametrize("fmt", ["text", "completion", "chat"])
@pytest.mark.parametrize("document_mask", [False, True])
def test_the_masked_flag_is_the_rule_the_trainer_used(folder, fmt, document_mask):
    """DataConfig.masked (the trainer's "weigh every trained token alike") is what
    `format != "text" or document_mask` gave before the registry; document_mask stays
    refused with examples."""
    tmp, _, _ = folder
    kwargs = {} if fmt == "text" else {"hf_dataset": str(tmp / "rows.jsonl"),
                                       "tokenizer": str(tmp / "tok")}
    if document_mask and fmt != "text":
        with pytest.raises(ValueError, match="data.document_mask=true is for "
                                             "data.format='text'; with format="):
            DataConfig(format=fmt, document_mask=True, **kwargs)
        return
    data = DataConfig(format=fmt, document_mask=document_mask, **kwargs)
    assert data.masked == (fmt != "text" or document_mask)
    assert data.examples == (fmt != "text")


def test_a_new_format_is_one_entry_in_meshfit_data(folder, monkeypatch):
    """A trial format, registered in `meshfit.data.formats` only, reusing the completion
    columns: the config checks it (a dataset and a Hugging Face tokenizer needed), the
    trainer's masked flag follows it, and a run's loader gives each row's prompt words
    untrained, its completion words and EOS trained."""
    from meshfit.train import tokens

    tmp, rows, vocab = folder
    trial = formats.DataFormat(name="trial", columns=(("prompt_column", "prompt"),
                                        ("completion_column", "completion")),
                               loader="meshfit.data.examples:load_completions", masked=True,
                               examples=True, hf_tokenizer=True, dataset=True)
    monkeypatch.setattr(formats, "DATA_FORMATS",
                        types.MappingProxyType({**formats.DATA_FORMATS, "trial": trial}))
    with pytest.raises(ValueError, match="data.format='trial' reads data.hf_dataset"):
        DataConfig(format="trial", tokenizer=str(tmp / "tok"))
    with pytest.raises(ValueError, match="data.format='trial' needs a Hugging Face tokenizer"):
        DataConfig(format="trial", hf_dataset=str(tmp / "rows.jsonl"))
    cfg = build_config({"data": {"format": "trial", "hf_dataset": str(tmp / "rows.jsonl"),
                                 "tokenizer": str(tmp / "tok")}, "train": {"seq_len": 15}})
    assert cfg.data.masked and cfg.data.examples
    splits = tokens.load_tokens(cfg)
    assert (len(splits.train), len(splits.val)) == (5, 1)  # no validation split: the last row
    for i, row in enumerate(rows):
        prompt, completion = row["prompt"].split(), row["completion"].split()
        ids = [vocab[w] for w in prompt + completion] + [vocab["</s>"]]
        mask = [0] * len(prompt) + [1] * (len(completion) + 1)
        rows_of = splits.train if i < 5 else splits.val
        at = i if i < 5 else 0
        assert rows_of.ids[at, :len(ids)].tolist() == ids
        assert rows_of.mask[at].tolist() == mask + [0] * (16 - len(ids))
    assert splits.stats["format"] == "trial"
