"""A trained model as a folder: what `meshfit train` writes to ``OUT/model/`` and what
`meshfit generate` / `meshfit eval` read.

    model.safetensors   every weight, whole (gathered from the layout's shards), fp32
    meshfit-digests.json  its size and block digests, checked by every meshfit reader
    config.json         Hugging Face models: their own config (``from_pretrained`` loads the
                        folder); the reference GPT: ``{"model_type": "meshfit-gpt", ...}`` with
                        every `GPTConfig` field; a user's model: ``{"model_type":
                        "meshfit-factory", "factory": "module:function", "kwargs": {...}}``
    tokenizer files     the run's tokenizer (`meshfit.data.load_tokenizer` reads them back)

    save_model_folder(folder, state, model, tokenizer=tok)
    model, tokenizer = load_model_folder(folder)
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from meshfit._files import (atomic_write_dir, fsync_tree, remove_stale_temps, replace_dir,
                            stale_temps, temp_sibling)
from meshfit.checkpoint import export, weight_digests
from meshfit.data import load_tokenizer
from meshfit.models import GPT, GPTConfig
from meshfit.models.factory import check_folder_code, import_object

__all__ = ["GPT_TYPE", "FACTORY_TYPE", "describe_model", "fsync_tree", "hf_config",
           "load_model_folder", "model_class", "remove_stale_temps", "replace_dir",
           "save_model_folder", "stale_temps", "temp_sibling"]

GPT_TYPE = "meshfit-gpt"
FACTORY_TYPE = "meshfit-factory"


def _is_hf(model: nn.Module) -> bool:
    hf = sys.modules.get("transformers")
    return hf is not None and isinstance(model, hf.PreTrainedModel)


def model_class(model: nn.Module) -> type:
    """The model's own class: FSDP2's `fully_shard` swaps a module's class for a subclass of
    it and `FSDPModule` ("FSDPLlamaForCausalLM"), a name no other tool knows."""
    from torch.distributed.fsdp import FSDPModule  # (FSDP2: ~2 s of imports, for its class)

    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def hf_config(model: nn.Module) -> dict[str, Any] | None:
    """The transformers config.json of `model`, naming its own class in ``architectures``
    (what inference servers and converters choose the class by); None for other models."""
    if not _is_hf(model):
        return None
    config = json.loads(model.config.to_json_string())
    config["architectures"] = [model_class(model).__name__]
    return config


def describe_model(model: nn.Module, factory: str | None = None,
                   factory_kwargs: dict | None = None) -> dict[str, Any]:
    """The config.json of `model`, as the module docstring lists (`factory`: "module:function")."""
    if _is_hf(model):
        return hf_config(model)
    if isinstance(model, GPT):
        return {"model_type": GPT_TYPE, "architectures": ["GPT"],
                **dataclasses.asdict(model.config)}
    if factory is None:
        raise ValueError(f"{type(model).__name__} is neither a transformers model nor meshfit's "
                         "GPT; give the factory that builds it (module:function) so the folder "
                         "says how to rebuild it")
    return {"model_type": FACTORY_TYPE, "factory": factory, "kwargs": dict(factory_kwargs or {})}


def save_model_folder(folder, state: dict[str, torch.Tensor], model: nn.Module, *,
                      tokenizer=None, factory: str | None = None,
                      factory_kwargs: dict | None = None) -> Path:
    """Write `state` (a whole state dict, e.g. `Accelerator.get_state_dict`) with the config
    of `model` (any instance of the same architecture: the trained one, or one on the meta
    device) and `tokenizer` (an object with ``save(folder)``) into `folder`, atomically
    (`meshfit._files.atomic_write_dir`). Call on one process."""
    config = describe_model(model, factory, factory_kwargs)

    def fill(tmp: Path) -> None:
        export.write_safetensors(state, tmp / "model.safetensors")
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if _is_hf(model) and getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(str(tmp))
        if tokenizer is not None:
            tokenizer.save(tmp)

    return atomic_write_dir(Path(folder), fill)


def build_from_config(config: dict[str, Any], *, device="cpu") -> nn.Module:
    """An untrained model of the architecture a folder's config.json describes."""
    kind = config.get("model_type")
    with torch.device(device):
        if kind == GPT_TYPE:
            fields = {f.name for f in dataclasses.fields(GPTConfig)}
            return GPT(GPTConfig(**{k: v for k, v in config.items() if k in fields}))
        if kind == FACTORY_TYPE:
            factory = import_object(config["factory"], "config.json factory")
            return factory(**config.get("kwargs", {}))
        import transformers

        hf_config = transformers.AutoConfig.for_model(**config)
        return transformers.AutoModelForCausalLM.from_config(hf_config)


def load_model_folder(folder, *, device="cpu", dtype: torch.dtype | None = None,
                      trust_code: bool = False) -> tuple[nn.Module, Any]:
    """The model of a folder written by `save_model_folder` (weights loaded strictly, in
    eval mode; transformers models through their own ``from_pretrained``) and its
    tokenizer (None when the folder holds none). The weights are checked against their
    digests first (`meshfit.checkpoint.weight_digests`; a folder without them is read as it
    is). Code the folder names (a factory, transformers' remote code for the model or its
    tokenizer) runs only with `trust_code`; else one line naming it
    (`meshfit.models.factory.check_folder_code`)."""
    folder = Path(folder)
    check_folder_code(folder, trust_code=trust_code, field="folder", how="trust_code=True")
    config_path, weights = folder / "config.json", folder / "model.safetensors"
    if not config_path.is_file() or not weights.is_file():
        raise ValueError(f"{folder} holds no model: config.json and model.safetensors are "
                         "expected (a meshfit train run writes them to OUT/model/)")
    weight_digests.check_files(folder, ["model.safetensors"])  # (none: a folder of the user's)
    config = json.loads(config_path.read_text())
    if config.get("model_type") in (GPT_TYPE, FACTORY_TYPE):
        model = build_from_config(config)
        state = load_file(str(weights))
        problems = model.load_state_dict(state, strict=False)
        if problems.missing_keys or problems.unexpected_keys:
            raise ValueError(f"{weights} does not fit its config.json: missing "
                             f"{problems.missing_keys[:3]}, unexpected "
                             f"{problems.unexpected_keys[:3]}")
    else:
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=dtype or torch.float32, trust_remote_code=trust_code)
    model = model.to(device=device, dtype=dtype) if dtype else model.to(device)
    tokenizer = None
    if any((folder / name).is_file() for name in
           ("tokenizer.json", "tokenizer_config.json", "meshfit_tokenizer.json")):
        tokenizer = load_tokenizer(str(folder), trust_code=trust_code)
    return model.eval(), tokenizer
