"""Offline export: a checkpoint of any layout and world size, read whole in one process.

    meshfit export CKPT_OR_RUN --to safetensors OUT   # OUT/model.safetensors
    meshfit export CKPT_OR_RUN --to hf OUT            # + config.json: transformers loads it

No process group is needed: DCP's index says where every shard of every tensor lies, and
the tensors are rebuilt whole from it (`meshfit.checkpoint.load.read_whole`), with the same
checks and the same refusal to unpickle as `load_state`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import safetensors.torch
import torch

from meshfit._files import fsync_path, new_file_mode, remove_stale_temps, temp_sibling
from meshfit.checkpoint import weight_digests
from meshfit.checkpoint.load import read_whole
from meshfit.checkpoint.manifest import CheckpointError, Manifest, verify
from meshfit.checkpoint.store import latest
from meshfit.models.plans.regroup import canonical_state

__all__ = ["export", "read_model", "resolve", "write_safetensors"]


def resolve(path) -> Path:
    """A checkpoint folder, or the newest complete one of a `meshfit train` run folder."""
    path = Path(path)
    if (path / "manifest.json").is_file():
        return path
    found = latest(path / "checkpoints") if path.is_dir() else None
    if found is None:
        raise CheckpointError(f"{path} is neither a checkpoint (no manifest.json) nor a run "
                              "folder with a complete checkpoint in checkpoints/")
    return found


def read_model(folder, index: int = 0) -> tuple[dict[str, torch.Tensor], Manifest]:
    """The whole state dict of model `index` of the checkpoint in `folder` (on CPU)."""
    folder = Path(folder)
    manifest = verify(folder)
    state = read_whole(folder, "model" if index == 0 else f"model_{index}")
    return canonical(dict(state), manifest, index, folder), manifest


def canonical(state: dict[str, torch.Tensor], manifest: Manifest, index: int,
              folder: Path) -> dict[str, torch.Tensor]:
    """The model's own layout: fused q|k|v weights that tensor parallel stored head-grouped
    (GPT-2's c_attn; the manifest lists them) are put back as the plain model has them."""
    tp = manifest.model.get("regrouped_for_tp", 1)
    names = (manifest.model.get("regrouped") or [{}] * (index + 1))[index]
    if tp != 1 and not names:  # written before the manifest listed them
        raise CheckpointError(f"{folder}: its fused q|k|v weights are stored head-grouped for "
                              f"tp={tp} and the manifest does not say which; resume it with "
                              f"tp={tp} and save again to export it")
    return canonical_state(state, {k: tuple(v) for k, v in names.items()})


def write_safetensors(state: dict[str, torch.Tensor], path: Path) -> Path:
    """Write `state` as safetensors, atomically (a temporary file, fsync, rename, fsync of
    the folder; the temporary files of a killed earlier save are removed first), and its
    digests beside it (`meshfit.checkpoint.weight_digests`: every meshfit reader checks
    them). Tensors sharing storage (tied weights) are written as separate copies, which
    safetensors requires; both names load back into the tied model."""
    seen: set[int] = set()
    tensors = {}
    for name, tensor in state.items():
        tensor = tensor.detach().cpu()
        storage = tensor.untyped_storage().data_ptr()
        tensors[name] = tensor.clone() if storage in seen else tensor.contiguous()
        seen.add(storage)
    path = Path(path)
    remove_stale_temps(path)  # of a save that was killed
    weight_digests.forget(path)  # (a write killed before `record`: unchecked, not refused)
    # safetensors writes its own ".tmpXXXXXX" beside the file it is given and renames it
    # (mode 0600, no fsync): inside a temporary folder of ours, a kill leaves it where
    # remove_stale_temps finds it.
    folder = temp_sibling(path)
    try:
        tmp = folder / path.name
        safetensors.torch.save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.chmod(tmp, new_file_mode(path))
        fsync_path(tmp)
        os.replace(tmp, path)
        fsync_path(path.parent)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    weight_digests.record(path)
    return path


def export(source, to: str, out_dir) -> Path:
    """Write model 0 of a checkpoint (or of a run's newest one) into `out_dir`:
    ``model.safetensors``, and with ``to="hf"`` the transformers ``config.json`` beside it."""
    if to not in ("safetensors", "hf"):
        raise ValueError(f"--to={to!r} is not one of safetensors, hf")
    folder = resolve(source)
    hf = None
    if to == "hf":
        hf = (Manifest.read(folder).model.get("hf_config") or [None])[0]
        if hf is None:
            raise CheckpointError(f"{folder}: --to hf needs a checkpoint of a transformers model;"
                                  " this one holds another model (use --to safetensors)")
    state, _ = read_model(folder)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = write_safetensors(state, out_dir / "model.safetensors")
    if hf is not None:
        (out_dir / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True))
    return path
