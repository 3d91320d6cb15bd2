"""A run's data as [data] names it: its tokenizer and its token splits (through
`meshfit.data`, cached), and the name of its source as errors spell it.

Takes the [data] section (`meshfit.train.config.DataConfig`); `RunConfig.tokenizer` and
`RunConfig.load_tokens` call these.
"""

from __future__ import annotations

__all__ = ["load_run_tokens", "run_tokenizer", "source_name"]


def run_tokenizer(data):
    """The tokenizer of [data] tokenizer: bytes ("" or "bytes"), or a Hugging Face
    tokenizer folder or tokenizer.json."""
    from meshfit.data import ByteTokenizer, load_tokenizer

    if data.tokenizer in ("", "bytes"):
        return ByteTokenizer()
    return load_tokenizer(data.tokenizer)


def load_run_tokens(data):
    """The token splits of [data]: text files, a datasets dataset or the built-in corpus,
    through the run's tokenizer (`meshfit.data.load_tokens`; cached)."""
    from meshfit.data import load_tokens

    return load_tokens(data.path or None, cache_dir=data.cache_dir or None,
                       tokenizer=run_tokenizer(data), hf_dataset=data.hf_dataset or None,
                       text_column=data.text_column)


def source_name(data) -> str:
    """The [data] key that names the run's text, as an error message spells it
    (`meshfit.data.corpus.data_source`: the one rule for a run's data source)."""
    from meshfit.data.corpus import data_source

    return data_source(data.path, data.hf_dataset)
