"""Token data: the built-in corpus (the Python standard library), user text, Hugging Face
datasets and tokenizers, an atomically written memory-mapped token cache, next-token windows,
and packed windows streamed from text too big to cache.

    splits = load_tokens()                      # stdlib *.py, bytes, cached
    train = TokenDataset(splits.train, seq_len=256)

    splits = load_tokens(hf_dataset="my_ds", tokenizer="my_tokenizer/")  # datasets on disk
    stream = TokenStream(lambda: read_texts(), "my_tokenizer/", seq_len=256)  # no cache
"""

from meshfit.data.cache import DEFAULT_CACHE_DIR, DEFAULT_VAL_FRACTION, TokenSplits, load_tokens
from meshfit.data.corpus import stdlib_corpus_files
from meshfit.data.dataset import TokenDataset
from meshfit.data.stream import TokenStream
from meshfit.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    as_tokenizer,
    document_separator,
    load_tokenizer,
)

__all__ = [
    "DEFAULT_CACHE_DIR",
    "DEFAULT_VAL_FRACTION",
    "ByteTokenizer",
    "HFTokenizer",
    "TokenDataset",
    "TokenSplits",
    "TokenStream",
    "Tokenizer",
    "as_tokenizer",
    "document_separator",
    "load_tokenizer",
    "load_tokens",
    "stdlib_corpus_files",
]
