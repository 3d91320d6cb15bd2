"""Token data: the built-in corpus (the Python standard library), user text, Hugging Face
datasets and tokenizers, an atomically written memory-mapped token cache, next-token windows,
and packed windows streamed from text too big to cache; fine-tuning rows (a prompt and its
completion, a conversation) as examples with loss masks (`meshfit.data.examples`). The data
formats ([data] format: "text", "completion", "chat") are declared in `meshfit.data.formats`.

    splits = load_tokens()                      # stdlib *.py, bytes, cached
    train = TokenDataset(splits.train, seq_len=256)

    splits = load_tokens(hf_dataset="my_ds", tokenizer="my_tokenizer/")  # datasets on disk
    stream = TokenStream(lambda: read_texts(), "my_tokenizer/", seq_len=256)  # no cache
"""

from meshfit._lazy import lazy_exports

# Names load on first use: `meshfit.data.corpus` (the data-source rule) and
# `meshfit.data.formats` (the data formats) are read by the config checks before torch loads,
# and the datasets, streams and tokenizers import torch.
_EXPORTS = {**{n: "meshfit.data.cache" for n in ("DEFAULT_CACHE_DIR", "DEFAULT_VAL_FRACTION",
                                                  "TokenSplits", "load_tokens")},
            **{n: "meshfit.data.formats" for n in ("DATA_FORMATS", "DataFormat", "DataSpec",
                                                   "column_keys", "data_format",
                                                   "format_names")},
            "stdlib_corpus_files": "meshfit.data.corpus", "TokenDataset": "meshfit.data.dataset",
            "TokenStream": "meshfit.data.stream",
            **{n: "meshfit.data.tokenizer" for n in ("ByteTokenizer", "HFTokenizer", "Tokenizer",
                                                     "as_tokenizer", "document_separator",
                                                     "load_tokenizer")}}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
