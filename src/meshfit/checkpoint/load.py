"""Loading a checkpoint: DCP's index read without unpickling anything but its own classes,
and `state` filled in place, resharded to whatever layout it has, each data file checked
against the manifest before any of its bytes is used (`meshfit.checkpoint._reader`, imported
at the first load: it imports DCP).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from meshfit.checkpoint.manifest import CheckpointError, Manifest
from meshfit.distributed import is_initialized

__all__ = ["load_dcp", "read_index", "read_whole", "saved_keys"]


def read_index(folder: Path):
    """The checkpoint's DCP index (`Metadata`), read through the restricted unpickler."""
    from meshfit.checkpoint._reader import SafeReader  # (imports DCP: ~2 s, at the first load)

    return SafeReader(folder).read_metadata()


def saved_keys(folder: Path) -> set[str]:
    """The flattened keys the checkpoint in `folder` holds (read from its DCP index)."""
    return set(read_index(folder).state_dict_metadata)


def load_dcp(state: dict[str, Any], folder: Path, *, process_group=None,
             on_missing: Callable[[str], str] | None = None, index=None,
             manifest: Manifest | None = None) -> None:
    """Fill `state` in place from the DCP files in `folder` (checked with `verify` first, or,
    with `manifest`, `start_verify(..., hash_files=False)` first and each file as it is
    opened), resharding DTensors to whatever layout `state` has. Keys of `state` absent from
    the checkpoint are an error naming the first one."""
    # DCP: ~2 s of imports (it imports DTensor, which imports sympy), at the first load
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from meshfit.checkpoint._reader import SafePlanner, SafeReader

    try:
        with warnings.catch_warnings():  # the single-process notice, as in save_dcp
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=SafeReader(folder, index, manifest),
                     planner=SafePlanner(), process_group=process_group,
                     no_dist=not is_initialized())
    except CheckpointError:
        raise
    except (CheckpointException, Exception) as err:  # (DCP's is a BaseException)
        raise _load_error(err, folder, on_missing) from None


def _load_error(err: BaseException, folder: Path,
                on_missing: Callable[[str], str] | None) -> CheckpointError:
    """DCP's failure of a load as one line: a rank's CheckpointError (gathered to every rank
    by DCP), or a missing key (a RuntimeError on every rank) named with `on_missing`'s hint."""
    from torch.distributed.checkpoint.api import CheckpointException  # (DCP: as in load_dcp)

    if isinstance(err, CheckpointException):
        for failure in err.failures.values():
            found = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(found, CheckpointError):
                return CheckpointError(str(found))
        return CheckpointError(f"{folder}: cannot be loaded into this job "
                               f"({str(err).strip().splitlines()[-1][:200]})")
    text = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
    missing = re.search(r"Missing key in checkpoint state_dict: ([^\s.]+(?:\.[^\s]+)?)", text)
    if missing:
        name = missing.group(1).rstrip(".")
        hint = on_missing(name) if on_missing else ""
        return CheckpointError(f"{folder}: the checkpoint has no {name!r}{hint}")
    return CheckpointError(f"{folder}: cannot be loaded into this job ({text[:200]})")


def read_whole(folder: Path, key: str) -> dict[str, Any]:
    """Entry `key` of the checkpoint in `folder` (checked with `verify` first), every tensor
    whole on the CPU, in one process without a process group: its template built from the
    index alone (each tensor empty, of its global shape and dtype), then filled by DCP's load,
    which reads every shard of every rank into it."""
    import torch.distributed.checkpoint as dcp  # (DCP: as in load_dcp)
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from meshfit.checkpoint._reader import SafePlanner, SafeReader, put

    index = read_index(folder)
    state: dict[str, Any] = {}
    for name, meta in index.state_dict_metadata.items():
        path = (index.planner_data or {}).get(name, (name,))
        if path[0] == key:
            put(state, path, torch.empty(meta.size, dtype=meta.properties.dtype)
                if isinstance(meta, TensorStorageMetadata) else None)
    if key not in state:
        raise CheckpointError(f"{folder}: holds no {key!r}")
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=SafeReader(folder, index), planner=SafePlanner(),
                 no_dist=True)
    return state[key]
