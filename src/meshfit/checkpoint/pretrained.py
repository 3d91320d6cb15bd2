"""A local Hugging Face model folder loaded rank-efficiently.

`meta_model(folder)` builds the model's structure on the meta device (no memory, no random
init; buffers such as rotary tables are real) and marks it with its folder.
`Accelerator.prepare` (and `prepare_pipeline`) then lay it out first and fill each rank's
parameters afterwards with `load_into`: a parameter sharded by FSDP2 or tensor parallel reads
only its own slice of the safetensors file (``safe_open(...).get_slice``, memory-mapped), so
a rank's peak memory is its shard plus one tensor, not the whole model. A rank that holds
whole parameters (DDP, ZeRO-1, one process, a pipeline stage before sharding) reads whole
tensors, but only those of its modules.

Folders: ``model.safetensors`` or sharded ``model.safetensors.index.json`` + shards, as
``save_pretrained`` writes them; ``pytorch_model.bin`` (pickle) is refused. A folder meshfit
wrote (``OUT/model``) carries its files' digests (`meshfit.checkpoint.weight_digests`): each
rank checks the 1 MiB blocks under the bytes it reads before using them, and `check_weights`
checks every byte before launch.

Mixture-of-experts checkpoints. transformers 5 holds the routed experts of Mixtral, Qwen2-MoE
and the models sharing their layout fused, ``mlp.experts.gate_up_proj`` [E, 2F, d] (gate rows,
then up rows) and ``mlp.experts.down_proj`` [E, d, F], but ``save_pretrained`` writes, and
hub folders hold, one tensor per expert, converted by transformers' own loader
(``transformers/conversion_mapping.py``, entries "mixtral" and "qwen2_moe": MergeModulelist(0)
then Concatenate(1)). That table is internal to transformers and has changed within 5.x, so
meshfit keeps its own copy of the two layouts (`_EXPERT_PARTS`, `_MODULE_RENAMES`):

    Mixtral     block_sparse_moe.experts.{e}.w1/w3.weight -> mlp.experts.gate_up_proj
                block_sparse_moe.experts.{e}.w2.weight    -> mlp.experts.down_proj
                block_sparse_moe.gate.weight              -> mlp.gate.weight
    Qwen2-MoE   mlp.experts.{e}.gate_proj/up_proj.weight  -> mlp.experts.gate_up_proj
                mlp.experts.{e}.down_proj.weight          -> mlp.experts.down_proj

A fused parameter is read from its per-expert tensors (`_ExpertStack`): a rank whose shard is
experts [a, b) (FSDP2 shards dim 0) reads only those experts' tensors, straight into its
shard. A folder already in the fused layout (what ``meshfit train`` writes to OUT/model) is
read by name as any other.
"""

from __future__ import annotations

import contextlib
import json
import struct
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from meshfit._compat.dcp import local_shape_and_offset
from meshfit.checkpoint import weight_digests
from meshfit.distributed.tensors import local_tensor, names_by_parameter
from meshfit.models.plans.regroup import group_columns, regrouped_params

__all__ = ["PRETRAINED_ATTR", "check_folder", "check_weights", "load_into", "meta_model",
           "pretrained_folder", "stage_filler", "tied_names", "to_empty"]

PRETRAINED_ATTR = "_meshfit_pretrained"
ADAPTER_VALUES_ATTR = "_meshfit_adapter_values"
"""On a `meta_model` under LoRA: {name in the PeftModel: initial value} of the adapters,
which the folder does not hold (`meshfit.peft.lora` draws them)."""


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
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def meta_model(folder, *, dtype: torch.dtype = torch.float32, trust_code: bool = False
               ) -> nn.Module:
    """The transformers causal LM of `folder`, parameters on the meta device, marked so that
    `Accelerator.prepare` fills them from the folder after laying the model out.
    `trust_code`: the folder's own model code (``auto_map``) may run (the caller asked the
    user: `meshfit.models.factory.check_folder_code`)."""
    import transformers

    folder = check_folder(folder)
    config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True,
                                                     trust_remote_code=trust_code)
    # (transformers' init skips parameters on the meta device; no values are drawn)
    with _params_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(
            config, dtype=dtype, **({"trust_remote_code": True} if trust_code else {}))
    setattr(model, PRETRAINED_ATTR, str(folder))
    return model


def pretrained_folder(model: nn.Module) -> str | None:
    return getattr(model, PRETRAINED_ATTR, None)


class _Files:
    """Tensor name -> file, over a single or sharded safetensors checkpoint. A folder that
    meshfit wrote carries the files' digests (`meshfit.checkpoint.weight_digests`): every
    read of a slice checks the blocks under its bytes first."""

    def __init__(self, folder: Path):
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            with safe_open(str(folder / "model.safetensors"), "pt") as fh:
                weight_map = {k: "model.safetensors" for k in fh.keys()}
        self.folder, self.weight_map, self._open = folder, weight_map, {}
        self._checker = weight_digests.Checker(folder)
        self._headers: dict[str, tuple[int, dict]] = {}

    def key(self, name: str, prefix: str) -> str | None:
        """The file's key for the model's `name` (with or without the base model prefix)."""
        for candidate in (name, name.removeprefix(prefix + "."), f"{prefix}.{name}"):
            if candidate in self.weight_map:
                return candidate
        return None

    def slice(self, key: str):
        file = self.weight_map[key]
        if file not in self._open:
            self._open[file] = safe_open(str(self.folder / file), "pt")
        found = self._open[file].get_slice(key)
        if file not in self._checker.files:
            return found
        return _CheckedSlice(found, lambda index: self._check(file, key, index))

    def _check(self, file: str, key: str, index) -> None:
        """Check the blocks of `file` under the bytes of tensor `key`'s region `index`."""
        if file not in self._headers:
            self._headers[file] = _header(self.folder / file)
        base, header = self._headers[file]
        start, end = header[key]["data_offsets"]
        shape = header[key]["shape"]
        lo, hi = _region_bytes(shape, index, end - start)
        self._checker.check(file, base + start + lo, base + start + hi)


class _CheckedSlice:
    """A safetensors slice whose reads are checked first (`_Files.slice`)."""

    def __init__(self, inner, check):
        self._inner, self._check = inner, check

    def get_shape(self):
        return self._inner.get_shape()

    def get_dtype(self):
        return self._inner.get_dtype()

    def __getitem__(self, index):
        self._check(index)
        return self._inner[index]


def _header(path: Path) -> tuple[int, dict]:
    """(offset of the data, header) of the safetensors file `path`."""
    with path.open("rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        return 8 + length, json.loads(fh.read(length))


def _region_bytes(shape: list[int], index, nbytes: int) -> tuple[int, int]:
    """[lo, hi): the bytes of a row-major tensor of `shape` (`nbytes` in all) that its region
    `index` (a slice or a tuple of slices, as safetensors takes them) lies within."""
    index = index if isinstance(index, tuple) else (index,)
    numel = 1
    for n in shape:
        numel *= n
    if not shape or numel == 0:
        return 0, nbytes
    first = last = 0
    stride = numel
    for i, n in enumerate(shape):
        stride //= n
        part = index[i] if i < len(index) and isinstance(index[i], slice) else slice(None)
        lo, hi, step = part.indices(n)
        if hi <= lo:
            return 0, 0  # an empty region: nothing is read
        first += lo * stride
        last += (lo + (hi - 1 - lo) // step * step) * stride
    item = nbytes // numel
    return first * item, (last + 1) * item


# The per-expert tensors a fused expert parameter is made of, in the order transformers
# concatenates them (rows of each expert: gate then up), one tuple per checkpoint layout.
_EXPERT_PARTS = {
    "gate_up_proj": (("w1.weight", "w3.weight"),              # Mixtral
                     ("gate_proj.weight", "up_proj.weight")),  # Qwen2-MoE, Qwen3-MoE, OLMoE, ...
    "down_proj": (("w2.weight",), ("down_proj.weight",)),
}
# Module names that differ between the model (left) and its checkpoints (right).
_MODULE_RENAMES = ((".mlp.", ".block_sparse_moe."),)  # Mixtral's MoE block


def _renamed(name: str) -> list[str]:
    """`name` and its checkpoint spellings (`_MODULE_RENAMES`); a name inside a PeftModel
    (``base_model.model.`` ahead, ``.base_layer`` in an adapted linear) as the base model's."""
    # (a pipeline stage cut from the model inside a PeftModel has the inner names)
    name = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
    return [name, *(name.replace(a, b, 1) for a, b in _MODULE_RENAMES if a in name)]


class _ExpertStack:
    """A fused expert tensor of `shape` [E, R, C] read from per-expert tensors: expert e is
    the concatenation over rows of ``keys[e]``, equal parts of [R / len(keys[e]), C] each
    (gate and up: the experts' forward chunks the fused rows in two). Read in any
    contiguous region (`read_into`), opening only the tensors it covers (and their files)."""

    def __init__(self, files: _Files, keys: list[list[str]], shape, name: str):
        parts = len(keys[0])
        if shape[1] % parts:
            raise ValueError(f"{name} has shape {list(shape)}: {shape[1]} rows do not split "
                             f"into {parts} per-expert tensors")
        self.files, self.keys, self.name = files, keys, name
        self.shape, self.part = tuple(shape), (shape[1] // parts, shape[2])

    def read_into(self, out: torch.Tensor, index: tuple[slice, ...] | None = None) -> None:
        """Copy the region `index` (contiguous slices; None: everything) into `out`."""
        index = tuple(index or ())
        index += (slice(None),) * (3 - len(index))
        (e0, e1, es), (r0, r1, rs), (c0, c1, cs) = (
            i.indices(n) for i, n in zip(index, self.shape))
        if (es, rs, cs) != (1, 1, 1):
            raise ValueError(f"{self.name}: an expert tensor is read in contiguous blocks only")
        n = self.part[0]
        for i, e in enumerate(range(e0, e1)):
            for j, key in enumerate(self.keys[e]):
                lo, hi = max(r0, j * n), min(r1, (j + 1) * n)
                if lo >= hi:
                    continue
                source = self.files.slice(key)
                if tuple(source.get_shape()) != self.part:
                    raise ValueError(f"{self.name} {list(self.shape)} needs {key} of shape "
                                     f"{list(self.part)}; the file's is "
                                     f"{list(source.get_shape())}")
                out[i, lo - r0:hi - r0].copy_(source[lo - j * n:hi - j * n, c0:c1])


def _experts_source(files: _Files, model: nn.Module, name: str, prefix: str,
                    shape) -> _ExpertStack | None:
    """The per-expert tensors of the fused expert parameter `name` (``...experts.
    gate_up_proj`` / ``...experts.down_proj``), when the files hold that layout."""
    owner, _, leaf = name.rpartition(".")
    if leaf not in _EXPERT_PARTS or not owner.endswith("experts") or len(shape) != 3:
        return None
    for module in _renamed(owner):
        for parts in _EXPERT_PARTS[leaf]:
            if files.key(f"{module}.0.{parts[0]}", prefix) is None:
                continue
            if getattr(model.get_submodule(owner), "is_transposed", False):
                raise ValueError(f"{name}: the model holds its experts transposed; reading "
                                 "them from per-expert tensors is not supported")
            keys = [[files.key(f"{module}.{e}.{part}", prefix) for part in parts]
                    for e in range(shape[0])]
            absent = [f"{module}.{e}.{part}" for e, row in enumerate(keys)
                      for part, k in zip(parts, row) if k is None]
            if absent:
                raise ValueError(f"{name}: the safetensors hold {module}.0.{parts[0]} but no "
                                 f"{', '.join(absent[:3])}{' ...' if len(absent) > 3 else ''}")
            if files.key(f"{module}.{shape[0]}.{parts[0]}", prefix) is not None:
                raise ValueError(f"{name} has {shape[0]} experts; the safetensors hold more "
                                 f"({module}.{shape[0]}.{parts[0]})")
            return _ExpertStack(files, keys, shape, name)
    return None


def _copy(source, out: torch.Tensor, index: tuple[slice, ...] | None = None) -> None:
    """`out` = the region `index` (None: all) of a safetensors slice or an `_ExpertStack`."""
    if isinstance(source, _ExpertStack):
        source.read_into(out, index)
    else:
        out.copy_(source[index if index is not None else slice(None)].to(out.dtype))


def _whole(source, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(source, _ExpertStack):
        full = torch.empty(source.shape, dtype=dtype)
        source.read_into(full)
        return full
    return source[:].to(dtype)


def _local_region(tensor) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(shape, offset) of this rank's part of a DTensor in the global tensor, when it is one
    contiguous block (Shard/Replicate placements); None for other placements."""
    from torch.distributed.tensor import Replicate, Shard  # (DTensor: ~2 s of imports, sympy)

    if not all(type(p) in (Shard, Replicate) for p in tensor.placements):
        return None
    return local_shape_and_offset(tensor)


_FLOATING = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3",
             "F6_E3M2"}


def _check_files(folder: Path) -> None:
    """Each safetensors file holds all the bytes its header promises (a truncated copy is
    refused here, not as a read error half-way through loading)."""
    index = folder / "model.safetensors.index.json"
    try:
        names = (set(json.loads(index.read_text())["weight_map"].values()) if index.is_file()
                 else {"model.safetensors"})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"model.hf_model={str(folder)!r}: model.safetensors.index.json is not "
                         f"a readable index ({type(err).__name__}); copy it again") from None
    for name in sorted(names):
        path = folder / name
        if not path.is_file():
            raise ValueError(f"model.hf_model={str(folder)!r}: {name}, named in "
                             "model.safetensors.index.json, does not exist")
        size = path.stat().st_size
        try:
            with path.open("rb") as fh:
                (length,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(length)) if 8 + length <= size else None
        except (OSError, struct.error, ValueError, UnicodeDecodeError):
            header = None
        if not isinstance(header, dict):
            raise ValueError(f"model.hf_model={str(folder)!r}: {name} is not a safetensors file "
                             f"({size} bytes, no readable header); copy it again")
        end = max((t["data_offsets"][1] for k, t in header.items()
                   if k != "__metadata__" and isinstance(t, dict)), default=0)
        if 8 + length + end > size:
            raise ValueError(f"model.hf_model={str(folder)!r}: {name} is truncated: {size} bytes, its "
                             f"header describes {8 + length + end}; copy it again")


def check_weights(model: nn.Module, folder) -> None:
    """Before launch, from the safetensors headers (no tensor read): every parameter of
    `model` (built from the folder's config.json, on the meta device) is in the files, with
    its shape and a floating dtype, and no file is truncated; in a folder meshfit wrote,
    every file matches its digests. One line naming the first tensor (or bytes) that
    differs."""
    folder = check_folder(folder)
    _check_files(folder)
    try:  # every byte of the files, when meshfit wrote them (their digests beside them)
        weight_digests.check_files(folder)
    except ValueError as err:
        raise ValueError(f"model.hf_model={str(folder)!r}: {err}") from None
    files = _Files(folder)
    prefix = getattr(model, "base_model_prefix", "") or "model"
    tied = tied_names(model)
    missing = []
    for name, param in model.named_parameters():
        key = next((k for n in (name, tied.get(name, name)) for m in _renamed(n)
                    if (k := files.key(m, prefix)) is not None), None)
        if key is None:
            if _experts_source(files, model, name, prefix, param.shape) is None:
                missing.append(name)
            continue
        source = files.slice(key)
        dtype, shape = source.get_dtype(), list(source.get_shape())
        if param.is_floating_point() and dtype not in _FLOATING:
            raise ValueError(f"model.hf_model={str(folder)!r}: {key} is stored as {dtype}, not a "
                             "floating-point type; a weight must be F32, F16 or BF16 (the files "
                             "do not hold this model's weights)")
        if shape != list(param.shape):
            raise ValueError(f"model.hf_model={str(folder)!r}: {key} has shape {shape} in the "
                             f"safetensors, the model its config.json describes needs "
                             f"{list(param.shape)}; the folder's weights do not match its "
                             "config.json")
    if missing:
        raise ValueError(f"model.hf_model={str(folder)!r}: the safetensors hold no "
                         f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}; the "
                         "folder's weights do not match its config.json")


@torch.no_grad()
def load_into(model: nn.Module, folder, *, buffers: dict[str, torch.Tensor] | None = None,
              aliases: dict[str, str] | None = None) -> None:
    """Fill `model`'s parameters (already on their device, values undefined: `to_empty`)
    from the safetensors of `folder`, each rank reading only its part of each tensor.
    `buffers`: values for buffers the files do not hold (non-persistent ones: rotary
    tables), by name, taken before `to_empty`; `aliases`: name -> another name of the same
    tied tensor in the full model (a pipeline stage holding the head but not the embedding
    it is tied to; default: the ties within `model`)."""
    from torch.distributed.tensor import DTensor, distribute_tensor  # (~2 s of imports, sympy)

    folder = check_folder(folder)
    files = _Files(folder)
    prefix = getattr(model, "base_model_prefix", "") or "model"
    regrouped = regrouped_params(model)
    missing = []
    tied_sources = tied_names(model) if aliases is None else aliases
    params = dict(model.named_parameters())
    adapters = getattr(model, ADAPTER_VALUES_ATTR, None) or {}
    for name, tensor in [*params.items(), *model.named_buffers()]:
        key = next((k for n in (name, tied_sources.get(name, name)) for m in _renamed(n)
                    if (k := files.key(m, prefix)) is not None), None)
        adapter = adapters.get(name, adapters.get("base_model.model." + name))
        source = files.slice(key) if key is not None else adapter if adapter is not None \
            else _experts_source(files, model, name, prefix, tensor.shape) \
            if name in params else None
        if source is None:
            if buffers is not None and name in buffers:
                local_tensor(tensor).copy_(buffers[name])
                continue
            if name in params:
                missing.append(name)
            continue
        if not isinstance(tensor, DTensor):
            _copy(source, tensor)
            continue
        region = _local_region(tensor) if name not in regrouped else None
        local = tensor.to_local()
        if region is not None:
            shape, offset = region
            _copy(source, local, tuple(slice(o, o + s) for o, s in zip(offset, shape)))
            continue
        # Head-grouped (GPT-2's fused c_attn) or strided placements: the whole tensor,
        # re-laid out as the layout holds it, then this rank's part of it (no communication).
        full = _whole(source, local.dtype)
        if name in regrouped:
            chunks, tp, dim = regrouped[name]
            full = group_columns(full, chunks, tp, dim)
        part = distribute_tensor(full.to(local.device), tensor.device_mesh, tensor.placements,
                                 src_data_rank=None)
        local.copy_(part.to_local())
    if missing:
        raise ValueError(f"hf_model={str(folder)!r}: the safetensors hold no "
                         f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}; the "
                         "folder's weights do not match its config.json")


def stage_filler(model: nn.Module) -> Callable[[nn.Module, torch.device], None] | None:
    """For a model built by `meta_model`: ``fill(stage, device)``, which materialises a
    pipeline stage cut from it on `device` and reads only that stage's tensors from the
    folder (`meshfit.parallel.pp.build_pipeline(fill_stage=...)`); None for other models."""
    folder = pretrained_folder(model)
    if folder is None:
        return None
    aliases = tied_names(model)  # a stage may hold a tied head without its embedding

    def fill(stage: nn.Module, device: torch.device) -> None:
        buffers = {n: b.detach().clone() for n, b in stage.named_buffers() if not b.is_meta}
        to_empty(stage, device)
        load_into(stage, folder, buffers=buffers, aliases=aliases)

    return fill


def to_empty(model: nn.Module, device) -> None:
    """`model.to_empty(device=...)` keeping tied parameters tied (moving a meta tensor makes
    a new parameter per module, which would untie a tied head from its embedding)."""
    groups = names_by_parameter(model)
    model.to_empty(device=device)
    for names in groups:
        first = model.get_parameter(names[0])
        for other in names[1:]:
            owner, _, attr = other.rpartition(".")
            setattr(model.get_submodule(owner) if owner else model, attr, first)


def tied_names(model: nn.Module) -> dict[str, str]:
    """name -> the other name of the same parameter (a tied head reads the embedding)."""
    out = {}
    for names in names_by_parameter(model):
        for a in names:
            for b in names:
                if a != b:
                    out.setdefault(a, b)
    return out
