"""Fine-tuning data: instructions and conversations as examples with a loss mask.

`[data] format` says how a row of the dataset becomes training tokens:

    "text"        documents packed back to back (`meshfit.data.cache`; every token trained)
    "completion"  a prompt and its completion (columns ``prompt``, ``completion``): the text
                  is prompt + completion + EOS (unless it ends with EOS already), tokenized
                  with the tokenizer's special tokens; the loss counts the completion only
    "chat"        a conversation (column ``messages``: a list of ``{"role", "content"}``,
                  the content a string or a list of text parts, tool calls where the
                  template renders them: `meshfit.data.chat`), rendered by the tokenizer's
                  chat template (``apply_chat_template``); the loss counts the assistant's
                  turns only

The masks are the ones TRL's ``SFTTrainer`` makes for the same rows and tokenizer
(``completion_only_loss``, ``assistant_only_loss``): for "completion", the tokens after the
longest common prefix of the tokenized prompt and the tokenized whole; for "chat", every
token overlapping an assistant turn. Where the assistant's text is, in that order:
1. a template with ``{% generation %}`` markers says it (transformers'
   ``return_assistant_tokens_mask``);
2. for a model's own template without them, TRL's training version of it with the markers
   (``trl.chat_template_utils.get_training_chat_template``), when TRL is installed and knows
   the template, as ``SFTTrainer`` does: the same masks to the token;
3. otherwise an assistant turn is the text the template adds when the turn is appended to
   the conversation so far rendered with the generation prompt. This needs a template that
   renders the beginning of a conversation the same whatever follows (refused in one line
   otherwise), and it leaves out what the generation prompt already holds (Qwen2.5's
   template ends it with a newline that TRL's training version counts as the assistant's).
``train_on_prompt = true`` trains on every token instead.

Each example is one row of ``seq_len + 1`` tokens (`ExampleDataset`): truncated when longer
(counted; only as much of its text is tokenized as the row keeps,
`meshfit.data.tokenizer.encode_head`), padded when shorter, padding never trained and
attending to nothing after it (attention is causal, the padding comes last), so examples
never see each other. With
``packing = true`` consecutive examples share a row until the next would not fit; each
token carries its position in its own example, and the model's attention gets a causal
mask that is block-diagonal by example (`meshfit.models.gpt.document_causal_mask`; for a
transformers model `meshfit.models.packing.packed_forward`), so a packed example computes
exactly what it computes alone. An
example none of whose trained tokens fits in the row is left out (counted); a split where
that leaves nothing is refused in one line.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from meshfit.data.cache import DEFAULT_VAL_FRACTION
from meshfit.data.chat import chat_example, conversation, has_generation_markers, template_traits
from meshfit.data.formats import FORMATS, DataSpec, data_format
from meshfit.data.hf import open_hf_dataset
from meshfit.data.tokenizer import encode_head

__all__ = ["FORMATS", "ExampleDataset", "ExampleSplits", "chat_example", "completion_example",
           "load_chats", "load_completions", "load_examples", "training_template"]

IGNORE_INDEX = -100
Example = tuple[list[int], list[int]]
"""One example's token ids and loss mask (1: a trained token)."""


def completion_example(hf: Any, prompt: str, completion: str, *,
                       limit: int | None = None) -> tuple[list[int], list[int]]:
    """(ids, mask) of one prompt and completion: the whole tokenized with the tokenizer's
    special tokens and EOS added to the completion; mask 1 after the common prefix of the
    tokenized prompt and the tokenized whole. Only the first `limit` tokens (None: all),
    tokenizing no more of the text than they need (`encode_head`)."""
    eos = hf.eos_token
    if eos is not None and not completion.endswith(eos):
        completion = completion + eos
    prompt_ids, _ = encode_head(hf, prompt, limit, add_special_tokens=True, offsets=False)
    ids, _ = encode_head(hf, prompt + completion, limit, add_special_tokens=True,
                         offsets=False)
    common = 0
    for a, b in zip(prompt_ids, ids):
        if a != b:
            break
        common += 1
    return list(ids), [0] * common + [1] * (len(ids) - common)


@dataclass
class ExampleSplits:
    """Examples as rows of ``seq_len + 1`` tokens with their loss masks, train and
    validation, and what was done to fit them (`load_examples`)."""

    train: "ExampleDataset"
    val: "ExampleDataset"
    vocab_size: int
    tokenizer: Any
    stats: dict = field(default_factory=dict)

    def windows(self, split: str, seq_len: int, **_) -> "ExampleDataset":
        return self.train if split == "train" else self.val

    @property
    def train_tokens(self) -> int:
        """Tokens of the training examples (padding left out)."""
        return int(self.train.lengths.sum())

    def describe(self) -> str:
        """One line for the banner: the examples and the shares of padding and masked
        tokens, truncations and examples left out."""
        s = self.stats
        rows = (f"packed into {s['rows'][0]} / {s['rows'][1]} rows of {s['row']} tokens, "
                "attention kept inside each example" if s["packing"] else
                f"of up to {s['row']} tokens, one per row (packing off)")
        return (f"{s['format']} ({'trained: ' + s['masks']}): {s['train']} training / "
                f"{s['val']} validation examples {rows}: padding "
                f"{s['padding']:.0%} of the rows' tokens, not trained {s['masked']:.0%} of the "
                f"examples' tokens; {s['truncated']} truncated, {s['dropped']} left out "
                "(no trained token fits)")


class ExampleDataset(Dataset):
    """Row i as ``(x, y)``: ``x`` the row's first ``seq_len`` tokens, ``y[t]`` the token
    after ``x[t]`` where it is trained, else -100 (prompt, padding). Packed rows
    (`positions` given) add a third tensor, each token's position in its own example
    (restarting at 0 where an example begins), and never train a target that begins the
    next example."""

    def __init__(self, ids: np.ndarray, mask: np.ndarray, lengths: np.ndarray,
                 positions: np.ndarray | None = None):
        self.ids, self.mask, self.lengths, self.positions = ids, mask, lengths, positions
        self.seq_len = ids.shape[1] - 1

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, index: int):
        if not -len(self) <= index < len(self):
            raise IndexError(f"ExampleDataset index {index} out of range for length {len(self)}")
        row = torch.from_numpy(self.ids[index].astype(np.int64))
        keep = torch.from_numpy(self.mask[index][1:].astype(bool))
        if self.positions is None:
            y = torch.where(keep, row[1:], torch.full_like(row[1:], IGNORE_INDEX))
            return row[:-1], y
        pos = torch.from_numpy(self.positions[index].astype(np.int64))
        keep &= pos[1:] != 0  # the next example's first token is not this one's target
        y = torch.where(keep, row[1:], torch.full_like(row[1:], IGNORE_INDEX))
        return row[:-1], y, pos[:-1]


def _rows(examples: list[tuple[list[int], list[int]]], seq_len: int, pad_id: int,
          what: str, packing: bool = False) -> tuple[ExampleDataset, dict]:
    row = seq_len + 1
    kept, truncated, dropped = [], 0, 0
    for ids, mask in examples:
        if len(ids) > row:
            truncated += 1
            ids, mask = ids[:row], mask[:row]
        if not any(mask[1:]):  # no trained target fits (a target is a token after the first)
            dropped += 1
            continue
        kept.append((ids, mask))
    if not kept and examples:
        raise ValueError(f"train.seq_len={seq_len}: none of the {len(examples)} {what} examples "
                         f"has a trained token within its first {row} tokens ({truncated} are "
                         "longer than that); raise train.seq_len")
    groups = [[e] for e in kept]
    if packing:  # in order, each row filled until the next example would not fit
        groups = []
        for e in kept:
            if groups and sum(len(a) for a, _ in groups[-1]) + len(e[0]) <= row:
                groups[-1].append(e)
            else:
                groups.append([e])
    ids = np.full((len(groups), row), pad_id, dtype=np.int32)
    mask = np.zeros((len(groups), row), dtype=np.uint8)
    positions = np.zeros((len(groups), row), dtype=np.int32) if packing else None
    lengths = np.zeros(len(groups), dtype=np.int64)
    for i, group in enumerate(groups):
        at = 0
        for a, m in group:
            ids[i, at:at + len(a)] = a
            mask[i, at:at + len(m)] = m
            if packing:
                positions[i, at:at + len(a)] = np.arange(len(a))
            at += len(a)
        if packing:  # the padding: an example of its own, never trained
            positions[i, at:] = np.arange(row - at)
        lengths[i] = at
    trained = int(sum(sum(m[1:]) for _, m in kept))
    stats = {"truncated": truncated, "dropped": dropped, "tokens": int(lengths.sum()),
             "trained": trained, "examples": len(kept)}
    return ExampleDataset(ids, mask, lengths, positions), stats


def _records(source: Any, what: str, columns: dict[str, str]) -> list[dict]:
    """The rows' `columns` ({setting: column name}); a missing column refused by name."""
    for setting, column in columns.items():
        if column not in source.column_names:
            raise ValueError(f"data.{setting}={column!r} is not a column of data.hf_dataset="
                             f"{what!r} (its columns: {', '.join(source.column_names)}); name "
                             f"the column with data.{setting}")
    return [{c: row[c] for c in columns.values()} for row in source]


def load_examples(spec: DataSpec, *, tokenizer: Any, seq_len: int,
                  val_fraction: float = DEFAULT_VAL_FRACTION) -> ExampleSplits:
    """The examples of `spec` (a `DataSpec` whose format is "completion" or "chat") through
    `tokenizer` (a meshfit HFTokenizer over a transformers tokenizer) as rows of
    ``seq_len + 1`` tokens; validation: the dataset's "validation" (or "test") split, else
    the last `val_fraction` of the rows (at least one). The format's own loader
    (`meshfit.data.formats`): `load_completions` or `load_chats`."""
    return data_format(spec.format).load(spec, tokenizer=tokenizer, seq_len=seq_len,
                                         val_fraction=val_fraction)


def load_completions(spec: DataSpec, *, tokenizer: Any, seq_len: int,
                     val_fraction: float = DEFAULT_VAL_FRACTION) -> ExampleSplits:
    """The loader of format "completion" (`load_examples`): each row's prompt and
    completion columns through `completion_example`."""
    hf, _ = _transformers_tokenizer(spec, tokenizer)
    prompt, completion = spec.column("prompt_column"), spec.column("completion_column")

    def encode(row: dict, where: str) -> Example:
        for key, column in (("prompt_column", prompt), ("completion_column", completion)):
            if not isinstance(row[column], str):
                raise ValueError(f"{where}: data.{key}={column!r} holds "
                                 f"{type(row[column]).__name__}, not a string")
        return completion_example(hf, row[prompt], row[completion], limit=seq_len + 2)

    return _load(spec, tokenizer, encode, how="prompt and completion", seq_len=seq_len,
                 val_fraction=val_fraction)


def load_chats(spec: DataSpec, *, tokenizer: Any, seq_len: int,
               val_fraction: float = DEFAULT_VAL_FRACTION) -> ExampleSplits:
    """The loader of format "chat" (`load_examples`): each row's conversation checked and
    put in the form the template renders (`meshfit.data.chat.conversation`), then through
    `chat_example` with the template `training_template` gives; a split where the template
    marks no assistant token at all is refused."""
    hf, template = _transformers_tokenizer(spec, tokenizer)
    template, how = training_template(hf, template)
    column = spec.column("messages_column")
    parts, tools = template_traits(hf, template)

    def encode(row: dict, where: str) -> Example:
        messages = conversation(row[column], where, parts=parts, tools=tools,
                                every_token=spec.train_on_prompt)
        # seq_len + 2: the row's tokens and one more, which tells a truncated example
        return chat_example(hf, messages, template=template, limit=seq_len + 2, where=where)

    def check(examples: list[Example], split: str) -> None:
        # (an example cut at the row may hold no assistant token yet: only whole ones tell)
        whole = any(len(ids) <= seq_len + 1 for ids, _ in examples)
        if not spec.train_on_prompt and whole and not any(any(m) for _, m in examples):
            raise ValueError(f"data.format={spec.format!r}: the chat template marks no "
                             f"assistant token in any of the {len(examples)} {split} "
                             "conversations; give data.chat_template a template that renders "
                             "the assistant's turns")

    return _load(spec, tokenizer, encode, how=how, seq_len=seq_len, val_fraction=val_fraction,
                 check=check)


def _transformers_tokenizer(spec: DataSpec, tokenizer: Any) -> tuple[Any, str | None]:
    """(the transformers tokenizer `tokenizer` wraps, data.chat_template's text or None),
    refused in one line where the format cannot use them."""
    hf = getattr(tokenizer, "hf", None)  # HFTokenizer's; the byte tokenizer has none
    if hf is None or not hasattr(hf, "apply_chat_template"):
        raise ValueError(f"data.format={spec.format!r} needs a transformers tokenizer folder "
                         "(data.tokenizer=path/to/folder), not the byte tokenizer")
    if not data_format(spec.format).chat_template:
        return hf, None
    template = _template(spec.chat_template)
    if not (template or getattr(hf, "chat_template", None)):
        raise ValueError(f"data.tokenizer={getattr(hf, 'name_or_path', '')!r} has no chat "
                         "template; give one with data.chat_template (a .jinja file or the "
                         "template text)")
    if template and not has_generation_markers(template) \
            and "{%" not in template and "{{" not in template:
        raise ValueError(f"data.chat_template={spec.chat_template!r} is neither a template file "
                         "nor template text ({% ... %} / {{ ... }})")
    return hf, template


def _load(spec: DataSpec, tokenizer: Any, encode: Callable[[dict, str], Example], *, how: str,
          seq_len: int, val_fraction: float,
          check: Callable[[list[Example], str], None] | None = None) -> ExampleSplits:
    """The rows of data.hf_dataset as examples (``encode(row, where)`` -> ids, mask, `where`
    naming the file, the split when it has its own and the row; every token trained with
    data.train_on_prompt), each split passed to ``check(examples, split)``; without a
    validation split, the last `val_fraction` of the training rows."""
    if not spec.hf_dataset:
        raise ValueError(f"data.format={spec.format!r} reads data.hf_dataset (a datasets folder "
                         "or a .json/.jsonl file of rows); data.path is for format='text'")
    source = open_hf_dataset(spec.hf_dataset, None)
    keys = data_format(spec.format).column_keys
    named = {key: spec.column(key) for key in keys}
    splits = {}
    for name, ds in (("train", source.train), ("val", source.validation)):
        if ds is None:
            continue
        examples = []
        split = "" if source.validation is None else f" of split {name!r}"
        for i, row in enumerate(_records(ds, spec.hf_dataset, named)):
            ids, mask = encode(row, f"data.hf_dataset={spec.hf_dataset!r}, row {i}{split}")
            examples.append((ids, [1] * len(ids) if spec.train_on_prompt else mask))
        if check is not None:
            check(examples, name)
        splits[name] = examples
    if "val" not in splits:
        examples = splits["train"]
        n_val = max(1, round(len(examples) * val_fraction)) if len(examples) > 1 else 0
        splits["train"], splits["val"] = examples[:len(examples) - n_val], \
            examples[len(examples) - n_val:]
    return _example_splits(spec, tokenizer, splits["train"], splits["val"],
                           how="every token" if spec.train_on_prompt else how, seq_len=seq_len)


def _example_splits(spec: DataSpec, tokenizer: Any, train_examples: list[Example],
                    val_examples: list[Example], *, how: str, seq_len: int) -> ExampleSplits:
    """The examples as rows (`_rows`), with the banner's figures (`ExampleSplits.describe`)."""
    hf = tokenizer.hf
    pad = hf.pad_token_id if hf.pad_token_id is not None else tokenizer.eos_id or 0
    train, st = _rows(train_examples, seq_len, pad, "training", spec.packing)
    val, sv = _rows(val_examples, seq_len, pad, "validation", spec.packing)
    row = seq_len + 1
    total = max(1, st["tokens"] + sv["tokens"])
    stats = {"format": spec.format, "masks": how,
             "train": st["examples"], "val": sv["examples"], "row": row,
             "rows": (len(train), len(val)), "packing": spec.packing,
             "truncated": st["truncated"] + sv["truncated"],
             "dropped": st["dropped"] + sv["dropped"],
             "padding": 1 - total / max(1, row * (len(train) + len(val))),
             "masked": 1 - (st["trained"] + sv["trained"]) / total}
    return ExampleSplits(train=train, val=val, vocab_size=int(tokenizer.vocab_size),
                         tokenizer=tokenizer, stats=stats)


def training_template(hf: Any, template: str | None) -> tuple[str | None, str]:
    """The template to render conversations with (None: the tokenizer's) and how it finds
    the assistant's tokens (the module docstring's order)."""
    if has_generation_markers(hf.get_chat_template(template)):
        return template, "the template's {% generation %} markers"
    if template is None:
        try:
            from trl.chat_template_utils import get_training_chat_template
        except ImportError:
            pass
        else:
            try:
                patched = get_training_chat_template(hf)
            except (ValueError, TypeError):
                patched = None  # a template TRL does not know
            if patched is not None and has_generation_markers(patched):
                return patched, "TRL's training version of the template"
    return template, "the assistant turns, rendered turn by turn"


def _template(value: str) -> str | None:
    """data.chat_template: a file's text, or the text itself; None when empty."""
    if not value:
        return None
    path = Path(value).expanduser()
    if len(value) < 4096 and "\n" not in value and path.is_file():
        return path.read_text()
    return value
