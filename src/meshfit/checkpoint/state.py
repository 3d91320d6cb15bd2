"""The state a training job must keep to continue exactly: model and optimizer states keyed by
parameter name (so a checkpoint loads into another layout or world size), and each rank's
random-number generators.

Model and optimizer states go through `torch.distributed.checkpoint.state_dict`, which reads
DDP, FSDP2 and tensor-parallel modules alike: plain tensors where every rank holds the same,
DTensors where each holds a shard (DCP writes each shard once and reshards on load). Two
cases need help:

- ZeRO-1 (`ZeroRedundancyOptimizer`): each rank's optimizer holds the state of its own
  partition of whole parameters. It is written by parameter name from the rank that owns
  it, and read back by whichever rank owns that parameter in the loading job.
- A pipeline rank holds one or more stage modules, each keyed with the full model's names;
  they are read as one module with an index prefix that is removed again.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import numpy as np
import torch
from torch import nn

from meshfit.distributed.tensors import local_tensor

__all__ = ["load_optimizer_state", "model_state", "optimizer_state", "rng_state",
           "saved_form", "set_model_state", "set_rng_state"]


# ---------------------------------------------------------------------------- RNG
def rng_state() -> dict[str, Any]:
    """This rank's generators: Python's, NumPy's, torch's CPU one and every CUDA device's,
    as tensors and integers (nothing that needs unpickling)."""
    version, ints, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    out: dict[str, Any] = {
        "python": torch.tensor(ints, dtype=torch.int64), "python_version": version,
        "python_gauss": -1.0 if gauss is None else float(gauss),
        "python_has_gauss": gauss is not None,
        "numpy": torch.from_numpy(keys.astype(np.int64)), "numpy_pos": int(pos),
        "numpy_has_gauss": int(has_gauss), "numpy_gauss": float(cached),
        "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            out[f"cuda_{i}"] = state
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` took (CUDA devices only where both jobs have them)."""
    gauss = state["python_gauss"] if state["python_has_gauss"] else None
    random.setstate((state["python_version"], tuple(int(x) for x in state["python"]), gauss))
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32),
                         state["numpy_pos"], state["numpy_has_gauss"], state["numpy_gauss"]))
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            if f"cuda_{i}" in state:
                torch.cuda.set_rng_state(state[f"cuda_{i}"], i)


# ---------------------------------------------------------------------------- models
def _root(modules: list[nn.Module]) -> tuple[nn.Module, str]:
    """One module to read, and the prefix its names carry beyond the full model's."""
    if len(modules) == 1:
        return modules[0], ""
    return nn.ModuleList(modules), "*"


def _strip(key: str, prefix: str) -> str:
    return key.split(".", 1)[1] if prefix == "*" else key


def _quantized_base(root: nn.Module) -> bool:
    """Whether `root` holds frozen parameters of a tensor subclass (QLoRA's 4-bit base,
    `meshfit.peft.qlora`), directly or as a DTensor's shard."""
    for p in root.parameters():
        local = local_tensor(p)
        if not p.requires_grad and type(local) not in (torch.Tensor, nn.Parameter):
            return True
    return False


def model_state(modules: list[nn.Module]) -> dict[str, Any]:
    """The model's state by full-model parameter name (a pipeline rank: its stages').

    A model with a 4-bit base (QLoRA) keeps its trainable parameters and buffers only: its
    frozen base is a function of the pretrained folder, rebuilt (and quantized again, the
    same way) by the job that loads the checkpoint."""
    # DCP's state dicts: ~2 s of imports (DTensor's sympy), at the first save or load
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    root, prefix = _root(modules)
    options = StateDictOptions(ignore_frozen_params=_quantized_base(root))
    return {_strip(k, prefix): v for k, v in get_model_state_dict(root, options=options).items()}


def set_model_state(modules: list[nn.Module], state: dict[str, Any]) -> None:
    """Load `state` (from `model_state`) into `modules`: every key, strictly; with a 4-bit
    base, every key but its frozen parameters."""
    from torch.distributed.checkpoint.state_dict import (  # (DCP: as in model_state)
        StateDictOptions, get_model_state_dict, set_model_state_dict)

    root, prefix = _root(modules)
    if prefix:
        state = {f"{i}.{k}": v for i, m in enumerate(modules) for k, v in state.items()
                 if k in m.state_dict()}
    if not _quantized_base(root):
        set_model_state_dict(root, state, options=StateDictOptions(strict=True))
        return
    wanted = set(get_model_state_dict(root, options=StateDictOptions(ignore_frozen_params=True)))
    if set(state) != wanted:
        missing, extra = sorted(wanted - set(state)), sorted(set(state) - wanted)
        raise ValueError(f"the checkpoint does not fit this model: missing {missing[:3]}, "
                         f"unexpected {extra[:3]}")
    set_model_state_dict(root, state, options=StateDictOptions(strict=False))


# ---------------------------------------------------------------------------- optimizers
def _zero(optimizer):
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    if zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer):
        return optimizer
    return None


def _names(modules: list[nn.Module]) -> dict[int, str]:
    return {id(p): n for m in modules for n, p in m.named_parameters()}


def optimizer_state(modules: list[nn.Module], optimizer: torch.optim.Optimizer, *,
                    loading: bool = False) -> dict:
    """The optimizer's state keyed by full-model parameter name:
    ``{"state": {name: {...}}, "param_groups": [{..., "params": [names]}]}``; under ZeRO-1
    only this rank's partition is in "state" (each name is written by its owner). For a
    checkpoint, drop the groups' "params" (`saved_form`): they differ between ranks that hold
    different parts of the model. `loading`: the template a load fills in place (offload="disk"
under ZeRO-1: maps written through, sealed by the load's finish)."""
    zero = _zero(optimizer)
    if zero is not None:
        names, local = _names(modules), zero.optim
        # (offload="disk": the moments as memory maps of their files)
        whole = (local.mapped_state(lend=loading) if hasattr(local, "mapped_state")
                 else local.state)
        state = {names[id(p)]: dict(s) for p, s in whole.items()}
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [names[id(p)] for p in g["params"]]} for g in zero.param_groups]
        return {"state": state, "param_groups": groups}
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict  # (DCP)

    root, prefix = _root(modules)
    out = get_optimizer_state_dict(root, optimizer)
    if prefix:
        out = {"state": {_strip(k, prefix): v for k, v in out["state"].items()},
               "param_groups": [{**g, "params": [_strip(n, prefix) for n in g["params"]]}
                                for g in out["param_groups"]]}
    return out


def saved_form(state: dict) -> dict:
    """`optimizer_state` as it is written: the groups' hyper-parameters without their lists
    of parameter names (a pipeline rank's or a ZeRO-1 rank's own), which `load_optimizer_state`
    takes from the loading job."""
    return {"state": state["state"],
            "param_groups": [{k: v for k, v in g.items() if k != "params"}
                             for g in state["param_groups"]]}


def _init_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the lazily built state (a step with zero gradients and a learning rate of 0,
    which leaves the parameters as they are), so that loading has tensors to fill."""
    saved = []
    for group in optimizer.param_groups:
        saved.append(group["lr"])
        group["lr"] = 0.0 if not isinstance(group["lr"], torch.Tensor) else group["lr"] * 0
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, saved):
        group["lr"] = lr
        for p in group["params"]:
            p.grad = None


def load_optimizer_state(modules: list[nn.Module], optimizer: torch.optim.Optimizer,
                         load, alias=None) -> None:
    """Fill `optimizer` from a checkpoint: `load(template)` fills a state dict shaped like
    `optimizer_state`'s in place (DCP reads only the entries this rank needs). `alias(name)`:
    the name under which the checkpoint holds a parameter's state, when it differs (a tied
    weight is one parameter with two names, or one copy per pipeline stage)."""
    template, finish = optimizer_load_plan(modules, optimizer, alias)
    load(template)
    finish()


def optimizer_load_plan(modules: list[nn.Module], optimizer: torch.optim.Optimizer,
                        alias=None):
    """`load_optimizer_state` in two halves, so that one read can fill several objects:
    (template, finish): fill `template` in place (one DCP load, with other parts beside
    it), then call `finish()` to put it into `optimizer`."""
    zero = _zero(optimizer)
    target = zero.optim if zero is not None else optimizer
    if not target.state:
        _init_state(target)
    template = optimizer_state(modules, optimizer, loading=True)
    names = [g["params"] for g in template["param_groups"]]
    template = saved_form(template)
    renamed = {n: alias(n) if alias else n for n in template["state"]}
    template["state"] = {renamed[n]: v for n, v in template["state"].items()}
    return template, lambda: _finish_optimizer_load(modules, optimizer, template, renamed,
                                                    names)


def _finish_optimizer_load(modules, optimizer, template, renamed, names) -> None:
    zero = _zero(optimizer)
    target = zero.optim if zero is not None else optimizer
    back = {v: k for k, v in renamed.items()}
    template["state"] = {back[n]: v for n, v in template["state"].items()}
    for group, params in zip(template["param_groups"], names):
        group["params"] = params
    if zero is not None:
        by_id = _names(modules)
        for p, s in target.state.items():
            for k, v in template["state"][by_id[id(p)]].items():
                if k not in s:  # offload="disk": loaded in place into its file's memory map
                    continue
                if isinstance(s[k], torch.Tensor):
                    s[k].copy_(v)
                else:
                    s[k] = v
        for group, saved in zip(zero.param_groups, template["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        for group, outer in zip(target.param_groups, zero.param_groups):
            group.update({k: v for k, v in outer.items() if k != "params"})
        if hasattr(target, "seal"):  # offload="disk": its files as the load wrote them
            target.seal()
        return
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict  # (DCP)

    root, prefix = _root(modules)
    if prefix:
        owner = {n: i for i, m in enumerate(modules) for n, _ in m.named_parameters()}
        template = {"state": {f"{owner[k]}.{k}": v for k, v in template["state"].items()},
                    "param_groups": [{**g, "params": [f"{owner[n]}.{n}" for n in g["params"]]}
                                     for g in template["param_groups"]]}
    set_optimizer_state_dict(root, optimizer, template)
