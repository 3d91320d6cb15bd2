"""Text from a Hugging Face ``datasets`` dataset on local disk, as documents for the cache.

``open_hf_dataset(path, text_column)`` accepts, never downloading anything:

* a folder written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``
  (read with ``datasets.load_from_disk``);
* any other local folder or data file that ``datasets.load_dataset`` reads (a folder of
  ``.txt``/``.json(l)``/``.csv``/``.parquet`` files, split by file name such as
  ``train.txt``/``validation.txt``; a single such file), read with
  ``HF_DATASETS_OFFLINE=1`` so a name that is not a local path can never reach the Hub.

From a ``DatasetDict`` the ``train`` split is the training text and ``validation`` (else
``test``) the validation text; without one of those (and for a plain ``Dataset``) the rows
are split like files are, by a stable hash of the row index (see ``corpus.is_validation``).
Every row's ``text_column`` value is one document.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshfit.data.corpus import _slug
from meshfit.data.datafiles import check_files, load_error

__all__ = ["HFSource", "open_hf_dataset"]

_BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json",
             ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}
_ROWS_PER_BATCH = 1024


@dataclass(frozen=True, kw_only=True)
class HFSource:
    """The splits of a dataset that ``load_tokens`` reads, and what identifies them."""

    path: Path
    description: str
    slug: str
    text_column: str
    train: Any
    """``datasets.Dataset`` of training rows."""
    validation: Any
    """``datasets.Dataset`` of validation rows, or None (then rows are split by hash)."""
    identity: str
    """Hash of the splits' fingerprints (+ files for ``load_from_disk``) and the column."""

    @property
    def n_rows(self) -> int:
        return len(self.train) + (0 if self.validation is None else len(self.validation))

    def rows(self, split: str) -> Iterator[tuple[int, list[Any]]]:
        """``(first row index, values of text_column)`` in batches, for ``"train"`` or
        ``"validation"``; only the text column is read."""
        ds = self.train if split == "train" else self.validation
        if ds is None:
            return
        ds = ds.select_columns([self.text_column])
        start = 0
        for batch in ds.iter(batch_size=_ROWS_PER_BATCH):
            values = batch[self.text_column]
            yield start, list(values)
            start += len(values)


def open_hf_dataset(path: str | os.PathLike[str], text_column: str | None = "text", *,
                    cache_dir: Path | None = None) -> HFSource:
    """Open the dataset at ``path`` (see the module docstring); errors name the field
    (``data.hf_dataset``, ``data.text_column``) and say how to fix it."""
    text = os.fspath(path)
    try:
        import datasets
    except ImportError:
        raise ValueError(f"data.hf_dataset={text!r} needs the datasets library, which is not "
                         'installed; pip install "meshfit[data]"') from None
    if text_column is not None and (not isinstance(text_column, str) or not text_column):
        raise ValueError(f"data.text_column={text_column!r} must be the name of a column of "
                         "strings, e.g. \"text\"")
    p = Path(text).expanduser()
    if not text or not p.exists():
        raise ValueError(f"data.hf_dataset={text!r} does not exist; give a folder written by "
                         "save_to_disk, or a local data folder/file that datasets.load_dataset "
                         "reads")
    p = p.resolve()
    with _quiet(datasets):
        if p.is_dir() and ((p / "dataset_dict.json").is_file() or (p / "state.json").is_file()):
            loaded, how = datasets.load_from_disk(str(p)), "load_from_disk"
        else:
            loaded, how = _load_offline(datasets, p, text, cache_dir), "load_dataset"
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise ValueError(f"data.hf_dataset={text!r} has splits {sorted(loaded)} but no "
                             "'train' split; name the training split 'train'")
        train = loaded["train"]
        validation = next((loaded[s] for s in ("validation", "test") if s in loaded), None)
    elif isinstance(loaded, datasets.Dataset):
        train, validation = loaded, None
    else:
        raise ValueError(f"data.hf_dataset={text!r} loaded as {type(loaded).__name__}; give a "
                         "Dataset or DatasetDict saved on disk")
    for ds in (train, validation):
        if ds is not None and text_column is not None:  # None: the caller checks its columns
            _check_column(ds, text_column, text)
    parts: list[Any] = [how, text_column]
    for ds in (train, validation):
        if ds is None:
            parts.append(None)
            continue
        files = []
        if how == "load_from_disk":
            # The fingerprint comes from state.json; the arrow files' sizes and times also
            # catch data rewritten in place under an unchanged state.json.
            for entry in ds.cache_files:
                st = Path(entry["filename"]).stat()
                files.append([Path(entry["filename"]).name, st.st_size, st.st_mtime_ns])
        parts.append([ds._fingerprint, len(ds), files])
    identity = hashlib.sha256(json.dumps(parts).encode("utf-8")).hexdigest()
    rows = f"{len(train)} train rows" + ("" if validation is None
                                         else f", {len(validation)} validation rows")
    return HFSource(path=p, description=f"hf_dataset {p} ({how}, column {text_column!r}, "
                    f"{rows})", slug="hf-" + _slug(p.name), text_column=text_column,
                    train=train, validation=validation, identity=identity)


def _check_column(ds: Any, column: str, text: str) -> None:
    if column not in ds.column_names:
        raise ValueError(f"data.text_column={column!r} is not a column of data.hf_dataset="
                         f"{text!r}; its columns are {ds.column_names}")
    feature = ds.features[column]
    dtype = getattr(feature, "dtype", None) if type(feature).__name__ == "Value" else None
    if dtype not in ("string", "large_string"):
        held = dtype or type(feature).__name__
        raise ValueError(f"data.text_column={column!r} of data.hf_dataset={text!r} holds "
                         f"{held}, not strings; choose a text column of {ds.column_names}")


def _load_offline(datasets: Any, p: Path, text: str, cache_dir: Path | None) -> Any:
    kwargs: dict[str, Any] = {}
    if cache_dir is not None:
        kwargs["cache_dir"] = str(cache_dir)
    if p.is_file():
        builder = _BUILDERS.get(p.suffix.lower())
        if builder is None:
            raise ValueError(f"data.hf_dataset={text!r} is a file datasets cannot read by its "
                             f"suffix; use one of {sorted(_BUILDERS)} or a folder")
        args: tuple[Any, ...] = (builder,)
        kwargs["data_files"] = {"train": str(p)}
    else:
        args = (str(p),)
    check_files(p, text)  # empty files, bytes that are not UTF-8: named before loading
    library = logging.getLogger("datasets")  # (it logs a failed file, which the error names)
    level = library.level
    with _offline(datasets):
        try:
            library.setLevel(logging.CRITICAL)
            return datasets.load_dataset(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - any loader failure becomes one line
            raise ValueError(load_error(p, text, err)) from None
        finally:
            library.setLevel(level)


@contextlib.contextmanager
def _offline(datasets: Any):
    """``HF_DATASETS_OFFLINE=1`` for one call. ``datasets`` reads the variable once, at
    import, into ``datasets.config``; so the config values are switched too."""
    config = datasets.config
    names = [n for n in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") if hasattr(config, n)]
    saved = {n: getattr(config, n) for n in names}
    saved_env = os.environ.get("HF_DATASETS_OFFLINE")
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    for n in names:
        setattr(config, n, True)
    try:
        yield
    finally:
        for n, v in saved.items():
            setattr(config, n, v)
        if saved_env is None:
            os.environ.pop("HF_DATASETS_OFFLINE", None)
        else:
            os.environ["HF_DATASETS_OFFLINE"] = saved_env


@contextlib.contextmanager
def _quiet(datasets: Any):
    """No progress bars while meshfit reads a dataset (it reports its own progress)."""
    check = getattr(datasets, "are_progress_bars_disabled", None)
    was_off = check is None or check()
    if not was_off:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_off:
            datasets.enable_progress_bars()
