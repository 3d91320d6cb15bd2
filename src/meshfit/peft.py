"""LoRA fine-tuning through the Hugging Face `peft` library (Hu et al. 2021, "LoRA").

    from meshfit.peft import lora, save_adapter, load_adapter
    model = lora(GPT(GPTConfig.preset("tiny")), r=8, alpha=16)   # base frozen, adapters trainable
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ...
    save_adapter(model, "out/adapter")                              # adapter tensors + config only
    model = load_adapter(GPT(GPTConfig.preset("tiny")), "out/adapter")

LoRA itself is peft's: each targeted `nn.Linear` W (out x in) becomes W x + (alpha / r) B A x
with A (r x in) and B (out x r, zero at init), so an adapted linear adds r * (in + out)
trainable parameters and the model's output is unchanged at step 0.

`lora` returns peft's `PeftModel`, which also wraps plain `nn.Module`s: its forward passes
every argument through, so `model(idx, targets)` still returns the loss for meshfit's GPT.
Apply LoRA first, then wrap in DDP and build the optimizer (STYLE.md 4): DDP registers only
parameters with requires_grad, so its buckets and the optimizer state hold adapters alone.
The functions below accept a DDP-wrapped model where they need the PeftModel inside.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from pathlib import Path

from meshfit._quiet import quiet_logs

with quiet_logs():  # peft imports torchao, whose CPU-only import logs warnings
    import peft
from peft.tuners.lora import LoraLayer  # noqa: E402
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from meshfit._files import atomic_write_dir
from meshfit._torchao import torchao_error
from meshfit.checkpoint import weight_digests
from meshfit.checkpoint.pretrained import ADAPTER_VALUES_ATTR, pretrained_folder
from meshfit.distributed import is_initialized
from meshfit.distributed.tensors import local_tensor
from meshfit.memory.shape import block_linears
from meshfit.models.plans import adapted_model

try:
    from peft.utils.error import NoMatchingPeftModuleError
except ImportError:  # older peft raises a plain ValueError when no target module matches
    NoMatchingPeftModuleError = ValueError

__all__ = ["GPT_TARGET_MODULES", "NF4_BLOCK", "dequantize_base", "dequantized", "is_quantized", "load_adapter",
           "lora", "merge", "check_quantized_layout", "nf4_blocks", "qlora", "quantize_after_load", "quantize_base",
           "quantized_linears",
           "save_adapter", "trainable_parameters"]

# meshfit's GPT: every linear of a dense block (attention q/k/v/o and the GeLU or SwiGLU MLP):
# what `lora` adapts by default (every linear inside the blocks, `_default_targets`), kept as
# the names to pass explicitly. Names match as suffixes of module paths, so absent ones (w1..w3
# in a GeLU model) are harmless.
GPT_TARGET_MODULES = ("wq", "wk", "wv", "wo", "w_in", "w_out", "w1", "w2", "w3")

_WEIGHTS = "adapter_model.safetensors"  # the file name PeftModel.save_pretrained writes
# Config fields that must agree for saved adapter weights to mean the same thing in a model.
_MUST_MATCH = ("r", "lora_alpha", "target_modules", "use_rslora", "use_dora", "rank_pattern",
               "alpha_pattern")


def _peft_wrap(model: nn.Module, config) -> nn.Module:
    """``peft.get_peft_model``, without the FutureWarning it raises by reading the model's
    ``is_gradient_checkpointing`` (deprecated by transformers 5): a warning about code neither
    the user nor meshfit wrote, once per process."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated",
                                category=FutureWarning)
        return peft.get_peft_model(model, config)


def lora(model: nn.Module, r: int = 8, alpha: float = 16,
         target_modules: list[str] | str | None = None, dropout: float = 0.0,
         **kwargs) -> peft.PeftModel:
    """Freeze `model` and add LoRA adapters of rank `r` to its `target_modules`.

    `target_modules`: module-name suffixes (peft matches "name" or "...name"), or one regex
    string matched against full names, or "all-linear". None means every linear layer inside
    the model's blocks (`meshfit.memory.shape.block_linears`: q, k, v, o and the MLP's; for
    meshfit's GPT `GPT_TARGET_MODULES`), for any model, as the memory estimate counts them;
    not peft's per-architecture default (q_proj, v_proj for Llama). `alpha` is peft's
    `lora_alpha` (scale alpha / r); `dropout` is `lora_dropout`. Other keyword arguments go to
    `peft.LoraConfig` unchanged (e.g. use_rslora, bias, modules_to_save, task_type).

    The model is changed in place (its targeted linears are replaced) and wrapped; use the
    returned model. Only adapter weights (and any `modules_to_save`) keep requires_grad.
    """
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"lora: r={r!r} is not a positive int; pass the adapter rank, e.g. r=8")
    if not alpha > 0:
        raise ValueError(f"lora: alpha={alpha!r} must be > 0; pass e.g. alpha=2*r (scale alpha/r)")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"lora: dropout={dropout!r} must be in [0, 1); pass e.g. dropout=0.05")
    if target_modules is None:
        target_modules = _default_targets(model)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=target_modules,
                             lora_dropout=dropout, **kwargs)
    on_meta = pretrained_folder(model) is not None
    if on_meta and config.init_lora_weights not in (True, False, "gaussian"):
        raise ValueError(f"lora: init_lora_weights={config.init_lora_weights!r} derives the "
                         "adapters from the base weights, which a model from meta_model(folder) "
                         "does not hold yet; use the default (True) or 'gaussian'")
    try:
        wrapped = _peft_wrap(model, config)
    except NoMatchingPeftModuleError as e:
        # Raised before any module is replaced, so `model` is left untouched.
        raise ValueError(f"lora: target_modules={target_modules!r} matches no module of "
                         f"{type(model).__name__}; pass names of its nn.Linear modules, "
                         f"e.g. {_linear_names(model)[:8]}") from e
    if on_meta:
        _draw_meta_adapters(wrapped)
    return wrapped


def _draw_meta_adapters(model: peft.PeftModel) -> None:
    """Adapters added to a `meta_model` (its weights still in the folder) are on the meta
    device too, without values. Draw them now, on the CPU, as peft draws them (its own
    `reset_lora_parameters`, from the global generator: every rank seeded alike draws the
    same), and keep them where `load_into` finds them when it fills the model."""
    initial = {}
    for prefix, layer in model.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        for name in layer.lora_A.keys() | layer.lora_embedding_A.keys():
            parts = [m[name] for m in (layer.lora_A, layer.lora_B) if name in m]
            for part in parts:
                part.to_empty(device="cpu")
            for table in (layer.lora_embedding_A, layer.lora_embedding_B):
                if name in table:
                    table[name] = nn.Parameter(torch.empty_like(table[name], device="cpu"))
            layer.reset_lora_parameters(name, model.peft_config[name].init_lora_weights)
            for local, value in layer.named_parameters():
                if value.device.type == "cpu":
                    initial[f"{prefix}.{local}"] = value.detach().clone()
            layer.to("meta")
    setattr(model.base_model.model, ADAPTER_VALUES_ATTR, initial)


def _default_targets(model: nn.Module) -> list[str]:
    """Every linear layer inside the blocks (`meshfit.memory.shape.block_linears`, the rule
    the memory estimate counts), not peft's per-architecture default (q_proj and v_proj for
    Llama): named by their last components where those name no other linear of the model
    (what a user writes, and what adapter_config.json then holds), else by full names."""
    try:
        inside = block_linears(model)
    except ValueError:
        inside = {}
    if not inside:
        raise ValueError(f"lora: target_modules=None has no default for "
                         f"{type(model).__name__}: it has no linear layer inside a ModuleList "
                         "of blocks, which is what LoRA adapts by default; pass names of its "
                         f"linear modules, e.g. target_modules={_linear_names(model)[:8]}")
    short = list(dict.fromkeys(n.rsplit(".", 1)[-1] for n in inside))
    other = [n for n, _ in model.named_modules() if n and n not in inside and
             n.rsplit(".", 1)[-1] in short]  # a module peft would match by the short name
    return short if not other else list(inside)


def _linear_names(model: nn.Module) -> list[str]:
    """Distinct last components of the model's nn.Linear names, in model order."""
    names = [n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    return list(dict.fromkeys(names))


def trainable_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter elements; a tied or shared tensor counts once.

    Counted from `requires_grad` directly rather than with peft's
    `get_nb_trainable_parameters`, so it works for any module, DDP-wrapped ones included.
    """
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def _peft_model(model: nn.Module) -> peft.PeftModel:
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    if not isinstance(inner, peft.PeftModel):
        raise TypeError(f"expected the model returned by meshfit.peft.lora (a peft.PeftModel), "
                        f"got {type(inner).__name__}; apply lora(model, ...) first")
    return inner


def save_adapter(model: nn.Module, directory: str | os.PathLike) -> Path:
    """Write the adapter alone to `directory`: adapter_model.safetensors + adapter_config.json.

    Base weights are not written. Written atomically (`meshfit._files.atomic_write_dir`): a
    failure part-way leaves an existing adapter there intact. Replicated adapters (one process,
    DDP, ZeRO-1): call on one process. Sharded ones (ZeRO-2/3 or tensor parallel: DTensor
    parameters): call on every rank — the adapter's tensors alone are gathered (a collective)
    and the first rank writes them. Returns the directory.
    """
    pm = _peft_model(model)
    state = None
    if any(isinstance(p, DTensor) for p in pm.parameters()):
        state = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
                 for k, v in pm.state_dict().items() if "lora_" in k}
        if is_initialized() and dist.get_rank() != 0:
            return Path(directory)

    def fill(tmp: Path) -> None:
        pm.save_pretrained(str(tmp), safe_serialization=True, state_dict=state)
        weight_digests.record(tmp / _WEIGHTS)  # checked by load_adapter (a file peft ignores)

    return atomic_write_dir(Path(directory), fill)


def load_adapter(model: nn.Module, directory: str | os.PathLike) -> peft.PeftModel:
    """Load an adapter written by `save_adapter` and return the model with it.

    `model` is either the same base already passed through `lora(...)` with the same settings
    (its adapter weights are overwritten), or a fresh base model (LoRA is applied first with
    the saved config). Either way the result matches `lora(...)` plus the saved weights: the
    adapter is trainable and the base frozen. The base weights must be the ones the adapter
    was trained on; they are not stored. Mismatched settings or tensor names raise ValueError.
    """
    directory = Path(directory)
    saved = peft.LoraConfig.from_pretrained(str(directory))
    if isinstance(model, (peft.PeftModel, DistributedDataParallel)):
        pm = _peft_model(model)
        _check_config(pm.peft_config[pm.active_adapter], saved, directory)
    else:
        saved.inference_mode = False  # save_pretrained stores True, which would freeze adapters
        pm = _peft_wrap(model, saved)
    weight_digests.check_files(directory, [_WEIGHTS])  # (none: an adapter from elsewhere)
    state = load_file(str(directory / _WEIGHTS))
    expected = set(peft.get_peft_model_state_dict(pm).keys())
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ValueError(f"load_adapter: {directory} does not fit this model: missing "
                         f"{missing[:3]}, unexpected {extra[:3]}; load it into the base model it "
                         "was trained on")
    peft.set_peft_model_state_dict(pm, state)
    return pm


def _check_config(current: peft.PeftConfig, saved: peft.PeftConfig, directory: Path) -> None:
    def norm(v):  # target_modules is a set in memory and a list in the JSON file
        return sorted(v) if isinstance(v, (set, list, tuple)) else v

    pairs = {f: (norm(getattr(saved, f, None)), norm(getattr(current, f, None)))
             for f in _MUST_MATCH}
    diff = {f: pair for f, pair in pairs.items() if pair[0] != pair[1]}
    if diff:
        raise ValueError(f"load_adapter: {directory} was saved with different LoRA settings "
                         f"(field: (saved, model)) {diff}; build the model with the saved "
                         "settings, or pass the bare base model to load_adapter")


def merge(model: nn.Module) -> nn.Module:
    """Fold the adapters into the base weights (W += alpha/r B A) and return the plain base
    model, e.g. a GPT again, for inference or export with no peft dependency. A 4-bit base
    (`qlora`) is dequantized first: the merged weights are the ones the adapters were trained
    against."""
    pm = _peft_model(model)
    dequantize_base(pm)
    return pm.merge_and_unload()


# ---------------------------------------------------------------------------- QLoRA
# QLoRA (Dettmers et al. 2023): the frozen base's linear weights in 4-bit NormalFloat (NF4),
# one absmax scale per block of 64 values, the scales themselves quantized to 8 bits in
# groups of 256 ("double quantization"), and LoRA adapters in full precision on top. The
# arithmetic is torchao's NF4Tensor: it runs on any device (CPU included, so the layouts
# are tested here), dequantizes in the linear's forward and backward, and FSDP2 shards and
# all-gathers it in its 4-bit form. bitsandbytes' kernels are CUDA-first and its 4-bit
# parameters are not FSDP2 tensors, so torchao is the one library that serves every layout.
NF4_BLOCK = 64
"""Values per absmax scale (QLoRA's block size)."""
NF4_SCALER_BLOCK = 256
"""Scales per second-level scale (QLoRA's double quantization), where a weight's blocks make
a multiple of 8 such groups; otherwise the largest power of two below it that does (finer,
never coarser), so that the 4-bit form splits over 2, 4 or 8 ZeRO-3 ranks (a shard must
hold whole groups). The choice depends on the weight alone, never on the layout."""
_GROUPS_MULTIPLE = 8
QUANTIZE_ATTR = "_meshfit_quantize_base"
"""On a `meta_model` under `qlora`: its base is quantized once `prepare` has filled it."""
_OUTPUT_NAMES = ("lm_head", "output", "head")  # output projections stay in full precision


def _nf4():
    """torchao's (NF4Tensor, to_nf4), wherever this release keeps them (0.17 moved them
    from torchao.dtypes.nf4tensor to torchao.quantization)."""
    if importlib.util.find_spec("torchao") is None:
        raise ValueError("qlora: the 4-bit (NF4) base needs torchao; pip install "
                         "'meshfit[qlora]' (or pip install torchao), or use LoRA on a "
                         "full-precision base")
    try:
        with quiet_logs():
            try:
                from torchao.quantization import NF4Tensor, to_nf4
            except ImportError:  # torchao < 0.17
                from torchao.dtypes.nf4tensor import NF4Tensor, to_nf4
    except Exception as err:  # noqa: BLE001 - a torchao that does not import with this torch
        raise torchao_error("qlora", err) from None
    return NF4Tensor, to_nf4


def is_quantized(tensor) -> bool:
    """Whether `tensor` (a parameter, or a DTensor's local shard of one) is a 4-bit weight."""
    tensor = local_tensor(tensor)
    module = sys.modules.get("torchao.quantization")
    nf4 = getattr(module, "NF4Tensor", None) if module is not None else None
    if nf4 is None:
        old = sys.modules.get("torchao.dtypes.nf4tensor")
        nf4 = getattr(old, "NF4Tensor", None) if old is not None else None
    return nf4 is not None and isinstance(tensor, nf4)


def nf4_blocks(numel: int) -> tuple[int, int] | None:
    """(block_size, scaler_block_size) of a weight of `numel` values in NF4, or None where
    `numel` is not a multiple of `NF4_BLOCK` (the weight stays in full precision)."""
    if numel % NF4_BLOCK:
        return None
    blocks = numel // NF4_BLOCK
    for rule in (_GROUPS_MULTIPLE, 1):  # groups a multiple of 8, else any whole number
        scaler = NF4_SCALER_BLOCK
        while scaler > 1 and blocks % (scaler * rule):
            scaler //= 2
        if blocks % (scaler * rule) == 0:
            return NF4_BLOCK, scaler
    return NF4_BLOCK, 1


def quantized_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """{name: linear} of the linears whose weights `qlora` keeps in 4 bits: every
    `nn.Linear` of the model (LoRA's base layers included) but the adapters themselves, the
    output head, weights shared with another module, and weights whose size is not a
    multiple of `NF4_BLOCK`."""
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    out = {}
    for name, module in model.named_modules():
        parts = name.split(".")
        if (not isinstance(module, nn.Linear) or any(p.startswith("lora_") for p in parts)
                or parts[-1] in _OUTPUT_NAMES
                or (parts[-1] == "base_layer" and len(parts) > 1
                    and parts[-2] in _OUTPUT_NAMES)):
            continue
        weight = module.weight
        if counts.get(id(weight), 0) > 1 or nf4_blocks(weight.numel()) is None:
            continue
        out[name] = module
    return out


@torch.no_grad()
def quantize_base(model: nn.Module) -> int:
    """Turn the weights of `quantized_linears(model)` into frozen NF4 tensors, in place, on
    their device; returns how many. Already quantized ones are left as they are."""
    _, to_nf4 = _nf4()
    done = 0
    for linear in quantized_linears(model).values():
        weight = linear.weight
        if is_quantized(weight):
            continue
        if weight.is_meta:
            raise ValueError("quantize_base: the weights are on the meta device; fill them "
                             "first (Accelerator.prepare does it for a meta_model)")
        block, scaler = nf4_blocks(weight.numel())
        linear.weight = nn.Parameter(to_nf4(weight.detach().contiguous(), block, scaler),
                                     requires_grad=False)
        done += 1
    return done


@torch.no_grad()
def dequantize_base(model: nn.Module) -> int:
    """Turn every NF4 weight of `model` (whole, not sharded) back into a plain frozen
    tensor of its original dtype: the values the forward used. Returns how many."""
    done = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, nn.Linear) and is_quantized(weight):
            module.weight = nn.Parameter(weight.get_original_weight(), requires_grad=False)
            done += 1
    return done


def dequantized(tensor: torch.Tensor) -> torch.Tensor:
    """A whole 4-bit weight as a plain tensor of its original dtype; other tensors as they
    are."""
    return tensor.get_original_weight() if is_quantized(tensor) else tensor


def qlora(model: nn.Module, r: int = 8, alpha: float = 16,
          target_modules: list[str] | str | None = None, dropout: float = 0.0,
          **kwargs) -> peft.PeftModel:
    """LoRA on a 4-bit base (QLoRA): `lora(model, ...)` with the same arguments, then the
    base's linear weights (`quantized_linears`) in NF4 (`quantize_base`), frozen; the
    adapters, norms, embeddings and head stay in full precision.

    A model from `meshfit.checkpoint.pretrained.meta_model(folder)` is quantized when
    `Accelerator.prepare` has read its weights (each rank reads the whole base, quantizes it,
    then the layout shards the 4-bit tensors). Layouts: one process, DDP, ZeRO-1/2/3 (FSDP2
    shards and gathers the 4-bit form); not tensor or expert parallel."""
    _nf4()  # a missing or broken torchao is one line before anything is changed
    wrapped = lora(model, r=r, alpha=alpha, target_modules=target_modules, dropout=dropout,
                   **kwargs)
    if not quantized_linears(wrapped):
        raise ValueError(f"qlora: {type(model).__name__} has no linear layer to keep in 4 "
                         f"bits (each needs a multiple of {NF4_BLOCK} weights, not the output "
                         "head nor tied); use lora(...)")
    if pretrained_folder(model) is not None:
        setattr(wrapped.base_model.model, QUANTIZE_ATTR, True)
    else:
        quantize_base(wrapped)
    return wrapped


def check_quantized_layout(model: nn.Module, *, shards: int, tp: int = 1, pp: int = 1,
                           field: str = "dp_shard") -> None:
    """One line where a model with a 4-bit base (`qlora`) cannot be laid out: tensor or
    pipeline parallel, or FSDP2 sharding over `shards` ranks that do not split every 4-bit
    weight's rows and double-quantization groups evenly (a shard must hold whole groups)."""
    if not (quantize_after_load(model) or any(is_quantized(p) for p in model.parameters())):
        return
    for name, size in (("tp", tp), ("pp", pp)):
        if size > 1:
            raise ValueError(f"qlora with {name}={size} is not available yet (4-bit weights "
                             "are sharded by FSDP2 only); use data parallel or ZeRO, or LoRA "
                             f"with {name}")
    if shards == 1:
        return
    for name, linear in quantized_linears(model).items():
        weight = linear.weight
        rows, numel = weight.shape[0], weight.numel()
        block, scaler = nf4_blocks(numel)
        groups = numel // (block * scaler)
        if rows % shards or groups % shards:
            name = name.removeprefix("base_model.model.").replace(".base_layer", "")
            raise ValueError(f"qlora with {field}={shards}: {name}.weight ({rows} rows, "
                             f"{groups} group(s) of {block}x{scaler} 4-bit values) does not "
                             f"split evenly over {shards} ranks; use a {field} that divides "
                             "both, or ZeRO-1 (whole weights on every rank)")


def quantize_after_load(model: nn.Module) -> bool:
    """Whether `model` (a `meta_model` under `qlora`) is to be quantized once filled."""
    return bool(getattr(adapted_model(model), QUANTIZE_ATTR, False))
