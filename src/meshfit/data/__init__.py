"""Token data: the built-in corpus (the Python standard library), user text, tokenizers,
an atomically written memory-mapped token cache, and next-token windows.

    splits = load_tokens()                      # stdlib *.py, bytes, cached
    train = TokenDataset(splits.train, seq_len=256)
"""

from meshfit.data.cache import DEFAULT_CACHE_DIR, DEFAULT_VAL_FRACTION, TokenSplits, load_tokens
from meshfit.data.corpus import stdlib_corpus_files
from meshfit.data.dataset import TokenDataset
from meshfit.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, as_tokenizer

__all__ = [
    "DEFAULT_CACHE_DIR",
    "DEFAULT_VAL_FRACTION",
    "ByteTokenizer",
    "HFTokenizer",
    "TokenDataset",
    "TokenSplits",
    "Tokenizer",
    "as_tokenizer",
    "load_tokens",
    "stdlib_corpus_files",
]
