"""Data files that ``datasets.load_dataset`` reads for ``data.hf_dataset`` (a .jsonl, .json,
.csv or .txt file, or a folder of them), checked so that a bad file is one line naming the
file, the line and the fix, not the library's advice or its traceback.

Before loading (`check_files`), cheaply, for the text formats: an empty file (``datasets``
says ``StopIteration``) and bytes that are not UTF-8. The second is checked here because
pyarrow's JSON reader does not check it: the bytes are loaded as they are, and decoding the
row fails later with neither file nor row named (or, read with ``errors="replace"``, trains
on replacement characters). One pass over the bytes, decoded a block of whole lines at a
time: about a second per GB.

After a failed load (`load_error`), the reason is looked for in the file: for JSON Lines
the first line that is not one JSON object (bad syntax, a value other than an object, or a
key twice in one object, which pyarrow refuses without naming it), for a .json document its
first error. This costs nothing when the data loads.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["TEXT_SUFFIXES", "check_files", "load_error"]

TEXT_SUFFIXES = {".txt": "one text per line", ".text": "one text per line",
                 ".json": "a JSON array of objects, or one object per line",
                 ".jsonl": "one JSON object per line", ".csv": "a header line, then one row "
                 "per line"}
"""The text formats' suffixes, each with what a file of it holds."""
_BLOCK = 1 << 24
_BUILDER = {".jsonl": ".json", ".text": ".txt"}
_JSON_NAMES = {"list": "array", "str": "string", "int": "number", "float": "number",
               "bool": "true or false", "NoneType": "null"}


class _Duplicate(Exception):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _files(path: Path) -> list[Path]:
    """`path` itself, or the files under the folder `path` that ``datasets`` reads: those of
    the text format most of them have (it picks the builder so), hidden ones left out."""
    if path.is_file():
        return [path]
    found = sorted(f for f in path.rglob("*") if f.is_file() and f.suffix.lower() in
                   TEXT_SUFFIXES and not any(part.startswith((".", "_"))
                                             for part in f.relative_to(path).parts))
    builders = [_BUILDER.get(f.suffix.lower(), f.suffix.lower()) for f in found]
    common = max(set(builders), key=builders.count, default=None)
    return [f for f, b in zip(found, builders) if b == common]


def _where(text: str, path: Path, root: Path) -> str:
    return f"data.hf_dataset={text!r}" + ("" if path == root else
                                          f" (file {path.relative_to(root)})")


def check_files(root: Path, text: str) -> None:
    """One-line ValueError for the first text-format file under `root` (a file or folder;
    `text` is data.hf_dataset as given) that is empty or holds bytes that are not UTF-8."""
    for path in _files(root):
        suffix = path.suffix.lower()
        if suffix not in TEXT_SUFFIXES:
            continue
        where = _where(text, path, root)
        size, blank = _utf8(path, where)
        if blank:
            raise ValueError(f"{where}: the file is {'empty' if size == 0 else 'blank'} (no "
                             f"rows); give a file holding {TEXT_SUFFIXES[suffix]}")


def _utf8(path: Path, where: str) -> tuple[int, bool]:
    """(bytes read, whether all were whitespace); a byte that is not UTF-8 refused naming
    its line. Blocks end at a newline, which never falls inside a UTF-8 character."""
    line, size, blank, rest = 1, 0, True, b""
    with open(path, "rb") as fh:
        while True:
            block = fh.read(_BLOCK)
            data = rest + block
            if block:
                cut = data.rfind(b"\n") + 1
                if cut == 0:  # a line longer than a block: read on
                    rest = data
                    continue
                data, rest = data[:cut], data[cut:]
            try:
                data.decode("utf-8")
            except UnicodeDecodeError as err:
                before = data[:err.start]
                column, at = err.start - before.rfind(b"\n"), line + before.count(b"\n")
                raise ValueError(
                    f"{where}, line {at}: byte "
                    f"{data[err.start]:#04x} (byte {column} of the line) is not UTF-8; save "
                    "the file as UTF-8 (e.g. iconv -f cp1252 -t utf-8)") from None
            size += len(data)
            blank = blank and not data.strip()
            line += data.count(b"\n")
            if not block:
                return size, blank


def load_error(root: Path, text: str, err: BaseException) -> str:
    """The one line for a failed ``load_dataset`` of `root`: the first bad line of a JSON
    file where there is one, else the innermost error's first line."""
    for path in _files(root):
        if path.suffix.lower() in (".json", ".jsonl"):
            problem = _json_problem(path)
            if problem:
                return f"{_where(text, path, root)}{problem}"
    cause = err
    while cause.__cause__ is not None or cause.__context__ is not None:
        cause = cause.__cause__ or cause.__context__
    first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
    return (f"data.hf_dataset={text!r} could not be read offline with datasets.load_dataset "
            f"({type(cause).__name__}: {first}); give a folder written by save_to_disk, or "
            "data files datasets reads (.jsonl, .json, .csv, .txt, .parquet)")


def _json_name(value: object) -> str:
    return _JSON_NAMES.get(type(value).__name__, type(value).__name__)


def _pairs(pairs: list[tuple[str, object]]) -> dict:
    seen = set()
    for key, _ in pairs:
        if key in seen:
            raise _Duplicate(key)
        seen.add(key)
    return dict(pairs)


def _json_problem(path: Path) -> str | None:
    """", line N: what is wrong" for the first bad row of a JSON file, or None."""
    with open(path, encoding="utf-8-sig") as fh:
        head = fh.read(4096).lstrip()
    if head.startswith("["):
        return _document_problem(path)
    rows = 0
    with open(path, encoding="utf-8-sig") as fh:
        for n, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            try:
                value = json.loads(raw, object_pairs_hook=_pairs)
            except _Duplicate as dup:
                return (f", line {n}: key {dup.key!r} appears twice in one object; keep one of "
                        "them")
            except json.JSONDecodeError as bad:
                if n == 1 and raw.lstrip().startswith("{"):
                    document = _document_problem(path)  # perhaps one object over many lines
                    if document is not None and not document.startswith(", line 1:"):
                        return document
                return (f", line {n}: not valid JSON at column {bad.colno} "
                        f"({bad.msg.removesuffix(' at')}); write one JSON object per line")
            if not isinstance(value, dict):
                return (f", line {n}: a JSON {_json_name(value)} where a row must be an "
                        "object {\"column\": value, ...}; write one object per line")
            rows += 1
    return None if rows else ": no rows (only blank lines); write one JSON object per line"


def _document_problem(path: Path) -> str | None:
    """The first error of a whole JSON document (an array of row objects), or None."""
    try:
        value = json.loads(path.read_text(encoding="utf-8-sig"), object_pairs_hook=_pairs)
    except _Duplicate as dup:
        return f": key {dup.key!r} appears twice in one object; keep one of them"
    except json.JSONDecodeError as bad:
        return (f", line {bad.lineno}: not valid JSON at column {bad.colno} "
                f"({bad.msg.removesuffix(' at')}); fix the file (a JSON array of objects, or "
                "one object per line)")
    if isinstance(value, list):
        if not value:
            return ": no rows (an empty array); give the rows as objects in the array"
        for i, row in enumerate(value):
            if not isinstance(row, dict):
                return (f": item {i} of the array is a JSON {_json_name(row)}, not an "
                        "object {\"column\": value, ...}; give every row as an object")
    return None
