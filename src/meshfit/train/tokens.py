"""A run's data as `meshfit train` reads it: [data]'s tokenizer and token splits (text
files, a ``datasets`` dataset or the built-in corpus, cached by `meshfit.data`; or the
fine-tuning examples of a format of `meshfit.data.formats`)."""

from __future__ import annotations

from pathlib import Path

from meshfit.data import DataSpec, data_format
from meshfit.models.factory import check_folder_code

__all__ = ["data_spec", "load_tokens", "tokenizer", "vocab_size"]


def tokenizer(cfg):
    """The run's tokenizer: bytes ([data] tokenizer "" or "bytes"), or a Hugging Face
    tokenizer folder or tokenizer.json."""
    # Imported here: this module is read by the config checks before torch loads (TORCH_FREE
    # in tests/test_architecture.py), and the tokenizer module is not kept torch-free.
    from meshfit.data import ByteTokenizer, load_tokenizer

    name = cfg.data.tokenizer
    if name in ("", "bytes"):
        return ByteTokenizer()
    if Path(name).expanduser().is_dir():  # its own tokenizer code runs only if the user says
        check_folder_code(Path(name).expanduser(), trust_code=cfg.model.trust_code,
                          field="data.tokenizer", how="model.trust_code = true "
                          "(--model.trust_code=true)", factories=False)
    return load_tokenizer(name, trust_code=cfg.model.trust_code)


def vocab_size(cfg) -> int:
    """Token ids the run's tokenizer gives (the reference GPT's vocabulary)."""
    return int(tokenizer(cfg).vocab_size)


def data_spec(cfg) -> DataSpec:
    """What the run's data format reads, from its [data] section: where the rows are, the
    format's columns, and how examples are made."""
    d = cfg.data
    return DataSpec(format=d.format, path=d.path, hf_dataset=d.hf_dataset,
                    cache_dir=d.cache_dir, chat_template=d.chat_template,
                    columns={key: getattr(d, key) for key in data_format(d.format).column_keys},
                    train_on_prompt=d.train_on_prompt, packing=d.packing)


def load_tokens(cfg):
    """The run's token splits through the run's tokenizer, by its format's loader: the
    cached token stream (`meshfit.data.TokenSplits`) for "text", the examples with their
    loss masks (`meshfit.data.examples.ExampleSplits`) for "completion" and "chat"."""
    return data_format(cfg.data.format).load(data_spec(cfg), tokenizer=tokenizer(cfg),
                                             seq_len=cfg.train.seq_len)
