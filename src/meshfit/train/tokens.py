"""A run's data as `meshfit train` reads it: [data]'s tokenizer and token splits (text
files, a ``datasets`` dataset or the built-in corpus, cached by `meshfit.data`)."""

from __future__ import annotations

__all__ = ["load_tokens", "tokenizer", "vocab_size"]


def tokenizer(cfg):
    """The run's tokenizer: bytes ([data] tokenizer "" or "bytes"), or a Hugging Face
    tokenizer folder or tokenizer.json."""
    from meshfit.data import ByteTokenizer, load_tokenizer

    name = cfg.data.tokenizer
    return ByteTokenizer() if name in ("", "bytes") else load_tokenizer(name)


def vocab_size(cfg) -> int:
    """Token ids the run's tokenizer gives (the reference GPT's vocabulary)."""
    return int(tokenizer(cfg).vocab_size)


def load_tokens(cfg):
    """The run's token splits, through the run's tokenizer; cached. With [data] format
    "completion" or "chat": the examples with their loss masks (`ExampleSplits`)."""
    from meshfit.data import load_tokens as load

    d = cfg.data
    if d.format != "text":  # instructions or conversations, one example per row
        from meshfit.data import DEFAULT_VAL_FRACTION
        from meshfit.data.examples import load_examples

        return load_examples(d, tokenizer=tokenizer(cfg), seq_len=cfg.train.seq_len,
                             val_fraction=DEFAULT_VAL_FRACTION)
    return load(d.path or None, cache_dir=d.cache_dir or None, tokenizer=tokenizer(cfg),
                hf_dataset=d.hf_dataset or None, text_column=d.text_column)
