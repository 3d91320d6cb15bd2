"""A local Hugging Face model folder loaded rank-efficiently.

`meta_model(folder)` builds the model's structure on the meta device (no memory, no random
init; buffers such as rotary tables are real) and marks it with its folder. `Accelerator.prepare`
(and `prepare_pipeline`) then lay it out first and fill each rank's parameters afterwards with
`load_into`: a parameter sharded by FSDP2 or tensor parallel reads only its own slice of the
safetensors file (``safe_open(...).get_slice``, memory-mapped), so a rank's peak memory is its
shard plus one tensor, not the whole model. A rank that holds whole parameters (DDP, ZeRO-1,
one process, a pipeline stage before sharding) reads whole tensors, but only those of its
modules.

Folders: ``model.safetensors`` or sharded ``model.safetensors.index.json`` + shards, as
``save_pretrained`` writes them; ``pytorch_model.bin`` (pickle) is refused.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from torch import nn

__all__ = ["PRETRAINED_ATTR", "check_folder", "load_into", "meta_model", "pretrained_folder",
           "tied_names", "to_empty"]

PRETRAINED_ATTR = "_meshfit_pretrained"


def check_folder(folder, field: str = "hf_model") -> Path:
    """The folder, after checking it holds a config.json and safetensors weights (one line
    naming `field` otherwise)."""
    folder = Path(folder).expanduser()
    if not (folder / "config.json").is_file():
        raise ValueError(f"{field}={str(folder)!r} holds no config.json; give a folder written "
                         "by save_pretrained (a local Hugging Face model)")
    if not (folder / "model.safetensors").is_file() and not (
            folder / "model.safetensors.index.json").is_file():
        extra = (" (it has pytorch_model.bin: convert it with model.save_pretrained(folder, "
                 "safe_serialization=True))") if (folder / "pytorch_model.bin").exists() else ""
        raise ValueError(f"{field}={str(folder)!r} holds no model.safetensors nor "
                         f"model.safetensors.index.json{extra}")
    return folder


@contextlib.contextmanager
def _params_on_meta():
    """Parameters created inside are on the meta device; buffers stay where they are made
    (the CPU), so non-persistent buffers computed at construction keep their values."""
    original = nn.Module.register_parameter

    def register(module, name, param):
        original(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.to("meta"),
                                                    requires_grad=param.requires_grad)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def meta_model(folder, *, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The transformers causal LM of `folder`, parameters on the meta device, marked so that
    `Accelerator.prepare` fills them from the folder after laying the model out."""
    import transformers

    folder = check_folder(folder)
    config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    # (transformers' init skips parameters on the meta device; no values are drawn)
    with _params_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    setattr(model, PRETRAINED_ATTR, str(folder))
    return model


def pretrained_folder(model: nn.Module) -> str | None:
    return getattr(model, PRETRAINED_ATTR, None)


class _Files:
    """Tensor name -> file, over a single or sharded safetensors checkpoint."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            with safe_open(str(folder / "model.safetensors"), "pt") as fh:
                weight_map = {k: "model.safetensors" for k in fh.keys()}
        self.folder, self.weight_map, self._open = folder, weight_map, {}

    def key(self, name: str, prefix: str) -> str | None:
        """The file's key for the model's `name` (with or without the base model prefix)."""
        for candidate in (name, name.removeprefix(prefix + "."), f"{prefix}.{name}"):
            if candidate in self.weight_map:
                return candidate
        return None

    def slice(self, key: str):
        from safetensors import safe_open

        file = self.weight_map[key]
        if file not in self._open:
            self._open[file] = safe_open(str(self.folder / file), "pt")
        return self._open[file].get_slice(key)


def _local_region(tensor) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(shape, offset) of this rank's part of a DTensor in the global tensor, when it is one
    contiguous block (Shard/Replicate placements); None for other placements."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not all(type(p) in (Shard, Replicate) for p in tensor.placements):
        return None
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh,
                                                          tensor.placements)
    return tuple(shape), tuple(offset)


@torch.no_grad()
def load_into(model: nn.Module, folder, *, buffers: dict[str, torch.Tensor] | None = None,
              aliases: dict[str, str] | None = None) -> None:
    """Fill `model`'s parameters (already on their device, values undefined: `to_empty`)
    from the safetensors of `folder`, each rank reading only its part of each tensor.
    `buffers`: values for buffers the files do not hold (non-persistent ones: rotary
    tables), by name, taken before `to_empty`; `aliases`: name -> another name of the same
    tied tensor in the full model (a pipeline stage holding the head but not the embedding
    it is tied to; default: the ties within `model`)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from meshfit.parallel.tp.styles import _fuse_order, regrouped_params

    folder = check_folder(folder)
    files = _Files(folder)
    prefix = getattr(model, "base_model_prefix", "") or "model"
    regrouped = regrouped_params(model)
    missing = []
    tied_sources = tied_names(model) if aliases is None else aliases
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        key = files.key(name, prefix) or files.key(tied_sources.get(name, name), prefix)
        if key is None:
            if buffers is not None and name in buffers:
                (tensor.to_local() if isinstance(tensor, DTensor) else tensor).copy_(
                    buffers[name])
                continue
            if name in dict(model.named_parameters()):
                missing.append(name)
            continue
        source = files.slice(key)
        if not isinstance(tensor, DTensor):
            tensor.copy_(source[:].to(tensor.dtype))
            continue
        region = _local_region(tensor) if name not in regrouped else None
        local = tensor.to_local()
        if region is not None:
            shape, offset = region
            index = tuple(slice(o, o + s) for o, s in zip(offset, shape))
            local.copy_(source[index].to(local.dtype))
            continue
        # Head-grouped (GPT-2's fused c_attn) or strided placements: the whole tensor,
        # re-laid out as the layout holds it, then this rank's part of it (no communication).
        full = source[:].to(local.dtype)
        if name in regrouped:
            chunks, tp, dim = regrouped[name]
            full = _fuse_order(full, chunks, tp, dim, inverse=False)
        part = distribute_tensor(full.to(local.device), tensor.device_mesh, tensor.placements,
                                 src_data_rank=None)
        local.copy_(part.to_local())
    if missing:
        raise ValueError(f"hf_model={str(folder)!r}: the safetensors hold no "
                         f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}; the "
                         "folder's weights do not match its config.json")


def to_empty(model: nn.Module, device) -> None:
    """`model.to_empty(device=...)` keeping tied parameters tied (moving a meta tensor makes
    a new parameter per module, which would untie a tied head from its embedding)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    model.to_empty(device=device)
    for names in by_id.values():
        first = model.get_parameter(names[0])
        for other in names[1:]:
            owner, _, attr = other.rpartition(".")
            setattr(model.get_submodule(owner) if owner else model, attr, first)


def tied_names(model: nn.Module) -> dict[str, str]:
    """name -> the other name of the same parameter (a tied head reads the embedding)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    out = {}
    for names in by_id.values():
        for a in names:
            for b in names:
                if a != b:
                    out.setdefault(a, b)
    return out
