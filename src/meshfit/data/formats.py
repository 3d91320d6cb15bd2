"""Data formats: how a row of the data becomes training tokens, declared once.

`[data] format` names an entry of `DATA_FORMATS`. The entry says everything the rest of
meshfit asks of a format, so adding one is an entry here and its loader (in this package):

* its **columns**: which [data] keys name them, and the column each names by default (the
  [data] key itself is a field of `meshfit.train.config.DataConfig`, the TOML surface; a
  format reusing existing keys adds none);
* its **loader**: ``"module:function"``, imported on use, called as
  ``function(spec, tokenizer=..., seq_len=...)`` with a `DataSpec` and returning splits
  with ``windows``, ``train_tokens``, ``vocab_size`` and ``tokenizer``
  (`meshfit.data.cache.TokenSplits` or `meshfit.data.examples.ExampleSplits`);
* whether it is **masked**: targets may be ignored (a prompt, padding), so the trainer
  weighs every trained token the same within a step, whatever micro-batch holds it (the
  mean of micro-batch means would depend on how full each micro-batch is, so on the layout);
* whether its rows are **examples** (one per row, with a loss mask: ``data.train_on_prompt``
  and ``data.packing`` apply) or **documents** packed back to back into one stream
  (``data.document_mask`` applies);
* what else it **needs**: a Hugging Face tokenizer (special tokens, a chat template), a
  dataset (``data.hf_dataset``) rather than ``data.path``, a chat template (the tokenizer's
  or ``data.chat_template``).

`meshfit.train.config.DataConfig` validates [data] against these entries before torch
loads, so this module imports the standard library only; the loaders import numpy, torch
and the optional ``datasets``/``transformers`` when a run reads its data.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = ["DATA_FORMATS", "FORMATS", "DataFormat", "DataSpec", "column_keys", "data_format",
           "format_names"]


@dataclass(frozen=True, kw_only=True)
class DataFormat:
    """One entry of `DATA_FORMATS` (the module docstring says what each field means)."""

    name: str
    columns: tuple[tuple[str, str], ...]
    """([data] key, its default column name) for each column the format reads."""
    loader: str
    """``"module:function"`` building the splits from a `DataSpec` (imported on use)."""
    masked: bool
    """Targets may be ignored: every trained token weighs the same in a step."""
    examples: bool
    """One example per row with a loss mask; False: documents packed into one stream."""
    hf_tokenizer: bool = False
    """Needs a Hugging Face tokenizer folder (not the byte tokenizer)."""
    dataset: bool = False
    """Reads ``data.hf_dataset`` (a datasets folder or a .json/.jsonl file of rows)."""
    chat_template: bool = False
    """Renders rows with a chat template: the tokenizer's, or ``data.chat_template``."""

    @property
    def column_keys(self) -> tuple[str, ...]:
        return tuple(key for key, _ in self.columns)

    def load(self, spec: DataSpec, **kwargs: Any) -> Any:
        """The splits of `spec` through this format's loader; `kwargs`: ``tokenizer``,
        ``seq_len`` (and optionally ``val_fraction``)."""
        module, _, name = self.loader.partition(":")
        return getattr(importlib.import_module(module), name)(spec, **kwargs)


DATA_FORMATS: Mapping[str, DataFormat] = MappingProxyType({f.name: f for f in (
    # documents packed back to back, every token trained
    DataFormat(name="text", columns=(("text_column", "text"),),
               loader="meshfit.data.cache:load_text", masked=False, examples=False),
    # a prompt and its completion: only the completion (and EOS) trained
    DataFormat(name="completion",
               columns=(("prompt_column", "prompt"), ("completion_column", "completion")),
               loader="meshfit.data.examples:load_completions", masked=True, examples=True,
               hf_tokenizer=True, dataset=True),
    # a conversation through the chat template: only the assistant's turns trained
    DataFormat(name="chat", columns=(("messages_column", "messages"),),
               loader="meshfit.data.examples:load_chats", masked=True, examples=True,
               hf_tokenizer=True, dataset=True, chat_template=True),
)})
"""Every data format by name, in the order messages list them."""

FORMATS = tuple(DATA_FORMATS)
"""The format names ("text", "completion", "chat")."""


def data_format(name: Any) -> DataFormat:
    """The entry of `name`; a one-line ValueError naming ``data.format`` otherwise."""
    if not isinstance(name, str) or name not in DATA_FORMATS:
        raise ValueError(f"data.format={name!r} must be one of {format_names()}")
    return DATA_FORMATS[name]


def format_names(*, examples: bool | None = None) -> str:
    """The formats' names as messages list them ('text', 'completion', 'chat'); with
    `examples`, those whose rows are (True) or are not (False) examples, joined by "or"."""
    if examples is None:
        return ", ".join(map(repr, DATA_FORMATS))
    return " or ".join(repr(f.name) for f in DATA_FORMATS.values() if f.examples == examples)


def column_keys() -> dict[str, str]:
    """Every format's column keys with their default column names ([data] key -> column)."""
    return {key: column for f in DATA_FORMATS.values() for key, column in f.columns}


@dataclass(frozen=True, kw_only=True)
class DataSpec:
    """What a format's loader reads: the [data] settings that say where the rows are and how
    they become tokens (`meshfit.train.tokens` builds it from a run's config)."""

    format: str = "text"
    """A name of `DATA_FORMATS`."""
    path: str = ""
    """A text file or folder of text files; empty: the built-in corpus (`meshfit.data.corpus`)."""
    hf_dataset: str = ""
    """A `datasets` dataset on local disk, or a .json/.jsonl file of rows."""
    cache_dir: str = ""
    """Where token caches are kept; empty: the default (`meshfit.data.cache`)."""
    columns: Mapping[str, str] = field(default_factory=dict)
    """[data] key -> column name; a key left out names the registry's default column."""
    chat_template: str = ""
    """A Jinja template (a file, or the text) instead of the tokenizer's; empty: its own."""
    train_on_prompt: bool = False
    """Train on every token of an example, not only the answer."""
    packing: bool = False
    """Several examples per row, attention kept inside each."""

    def __post_init__(self) -> None:
        data_format(self.format)
        unknown = sorted(set(self.columns) - set(column_keys()))
        if unknown:
            raise ValueError(f"DataSpec columns={dict(self.columns)!r}: {unknown[0]!r} is not a "
                             f"column key of any format; use one of "
                             f"{', '.join(column_keys())}")
        object.__setattr__(self, "columns", MappingProxyType(dict(self.columns)))

    def column(self, key: str) -> str:
        """The column the [data] key `key` names (its registry default when not given)."""
        return self.columns[key] if key in self.columns else column_keys()[key]
