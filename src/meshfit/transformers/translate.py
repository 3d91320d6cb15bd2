"""transformers' own sharding requests read as meshfit's `LayoutRequest`: ``fsdp=`` with
``fsdp_config`` (PyTorch FSDP, Zhao et al. 2023) and ``deepspeed=`` (a DeepSpeed ZeRO config,
Rajbhandari et al. 2020). Both name a ZeRO stage, which is what meshfit's layouts are made
of; each translation returns the request and the one line that says what it became. What
has no meshfit counterpart is refused in one line naming the key.

FSDP's sharding strategies are ZeRO stages: ``full_shard`` (parameters, gradients and
optimizer state sharded, parameters re-gathered for the backward) is ZeRO-3,
``shard_grad_op`` (parameters kept gathered between forward and backward:
``reshard_after_forward=False`` in FSDP2) ZeRO-2, ``no_shard`` DDP; the hybrid ones shard
within a node and replicate across nodes (HSDP). Wrapping policies (``auto_wrap``,
``transformer_layer_cls_to_wrap``, ...) have nothing to translate: meshfit shards each
transformer block as a unit.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from meshfit.parallel.request import LayoutRequest

__all__ = ["from_deepspeed", "from_fsdp"]

_FSDP_STAGES = {"full_shard": 3, "shard_grad_op": 2, "no_shard": 0, "hybrid_shard": 3,
                "hybrid_shard_zero2": 2}
_FSDP_FLAGS = ("offload", "auto_wrap")


def _load(value: Any, name: str) -> dict:
    """A JSON config given as a dict or a path."""
    if isinstance(value, dict):
        return dict(value)
    path = Path(os.fspath(value)).expanduser()
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"TrainingArguments({name}={str(value)!r}): cannot read it as a JSON "
                         f"config ({type(err).__name__}: {err}); pass a dict or a JSON "
                         "file's path") from None


def _true(value: Any) -> bool:
    return str(value).strip().lower() in ("true", "1", "yes")


def from_fsdp(fsdp: Any, fsdp_config: Any) -> tuple[LayoutRequest, str] | None:
    """``fsdp`` (True, or transformers' option words: ``"full_shard offload"``, a list) and
    ``fsdp_config`` as a request and its line; None when FSDP is off."""
    if not fsdp:
        return None
    words = fsdp.split() if isinstance(fsdp, str) else \
        [getattr(w, "value", w) for w in fsdp] if isinstance(fsdp, (list, tuple)) else []
    config = {k[5:] if k.startswith("fsdp_") else k: v
              for k, v in (_load(fsdp_config, "fsdp_config") if fsdp_config else {}).items()}
    unknown = [w for w in words if w not in _FSDP_STAGES and w not in _FSDP_FLAGS]
    if unknown:
        raise ValueError(f"TrainingArguments(fsdp={fsdp!r}): {unknown[0]!r} is not an FSDP "
                         f"option; use {', '.join([*_FSDP_STAGES, *_FSDP_FLAGS])}")
    if _true(config.get("xla", False)):
        raise ValueError("fsdp_config['xla']=True (PyTorch/XLA's FSDP) is not available in "
                         "meshfit; drop it")
    strategies = [w for w in words if w in _FSDP_STAGES] or ["full_shard"]
    strategy = strategies[0]
    stage = _FSDP_STAGES[strategy]
    if strategy == "full_shard" and not _true(config.get("reshard_after_forward", True)):
        stage = 2  # FSDP2's reshard_after_forward=False keeps the parameters gathered: ZeRO-2
    offload = "cpu" if "offload" in words or _true(config.get("cpu_offload", False)) \
        else "none"
    if strategy.startswith("hybrid"):
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        sizes = dict(dp_replicate=-1, dp_shard=local)
    else:
        sizes = dict(dp_replicate=1, dp_shard=-1) if stage else {}
    request = _request(f"fsdp={fsdp!r}", sizes, stage, offload)
    return request, (f"fsdp={fsdp!r} runs as meshfit's {_words(stage, offload)} "
                     f"(parallel={_text(request)!r}), on FSDP2")


def from_deepspeed(deepspeed: Any) -> tuple[LayoutRequest, str] | None:
    """A DeepSpeed config (a dict or a JSON file's path) as a request and its line; None when
    there is none. Its ``zero_optimization`` is read; the rest of DeepSpeed's config
    (batch sizes, optimizer, scheduler, precision, mostly "auto") is the Trainer's own
    arguments' under transformers too."""
    if not deepspeed:
        return None
    config = _load(deepspeed, "deepspeed")
    zero = config.get("zero_optimization", {}) or {}
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"deepspeed zero_optimization.stage={stage!r} must be 0, 1, 2 or 3")
    devices = {key: (zero.get(key) or {}).get("device", "none") or "none"
               for key in ("offload_optimizer", "offload_param")}
    offload = "none"
    for key, device in devices.items():
        if device == "nvme":
            raise ValueError(f"deepspeed zero_optimization.{key}.device='nvme' has no "
                             "translation here; use parallel='zero_stage=...,offload=disk' "
                             "(meshfit's disk offload, in <output_dir>/offload)")
        if device == "cpu":
            offload = "cpu"
        elif device != "none":
            raise ValueError(f"deepspeed zero_optimization.{key}.device={device!r} must be "
                             "'cpu' or 'none'")
    if offload == "cpu" and stage != 3:
        raise ValueError(f"deepspeed zero_optimization offloads to 'cpu' at stage {stage}: "
                         "meshfit offloads to the CPU at stage 3 only (FSDP2 moves the sharded "
                         "parameters and their state); set stage 3 or drop the offload")
    sizes = dict(dp_replicate=1, dp_shard=-1) if stage else {}
    request = _request("deepspeed", sizes, stage, offload)
    return request, (f"deepspeed ZeRO stage {stage} runs as meshfit's "
                     f"{_words(stage, offload)} (parallel={_text(request)!r})")


def _request(what: str, sizes: dict, stage: int, offload: str) -> LayoutRequest:
    try:
        return LayoutRequest(**sizes, zero_stage=stage, offload=offload)
    except ValueError as err:
        raise ValueError(f"TrainingArguments({what}): {err}") from None


def _words(stage: int, offload: str) -> str:
    text = f"ZeRO-{stage}" if stage else "DDP"
    return text + (" + CPU offload" if offload == "cpu" else "")


def _text(request: LayoutRequest) -> str:
    """The request as ``parallel=``'s text (the fields that differ from their defaults)."""
    defaults = LayoutRequest()
    return ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}"
                    for k, v in request.fields_dict().items()
                    if v != getattr(defaults, k)) or "dp_replicate=-1"
