"""One tensor-parallel plan source for every transformers decoder: the model's own plan
(``model.tp_plan``: the class's ``_tp_plan``, e.g. the head, merged with
``config.base_model_tp_plan``, the decoder's linears), read as data and turned into a
meshfit `TPPlan` of meshfit's `Style`s.

transformers' plans name which linears split by columns and which by rows; what they leave
out -- sequence parallel, the norms, the embedding, the head, the experts -- is found from
the module tree, as meshfit's hand-written Llama plan did it:

- ``colwise`` / ``rowwise``: Megatron-LM's column and row split (Shoeybi et al. 2019); under
  sequence parallel (Korthikanti et al. 2022) the row-parallel output of a decoder layer's
  attention and MLP is reduce-scattered onto the sequence and the layer's norms run on a
  sequence shard; the attention and MLP gather their hidden-state input first.
- ``colwise_gather_output`` / ``rowwise_split_input`` (Phi-3's fused ``qkv_proj`` with GQA
  sizes and ``gate_up_proj``, OLMo 2's q/k/v): the column-parallel output is gathered, so
  what follows sees the whole width (OLMo 2's q/k norm over all heads, Phi-3's split of the
  fused projection by the configuration's head counts), and the row-parallel input is
  split locally, without communication. Weights stay in the model's own layout.
- ``replicated_with_grad_allreduce`` on a per-head norm (Qwen3's and Gemma 3's q/k norms,
  weight of head_dim): each rank normalises its own heads, the weight is replicated and its
  gradient summed over the ranks (a norm on a shard of the heads dimension).
- ``embedding_rowwise`` and the input embedding of every plan: vocabulary-parallel, like the
  head (a tied embedding and head are one tensor, both sharded on the vocabulary: Gemma,
  SmolLM3); the head's logits gathered, or left sharded for loss parallel.
- ``moe_tp_experts`` (with ``packed_colwise`` / ``rowwise`` on the experts' fused weights):
  meshfit keeps the routed experts and their router whole on every tp rank
  (``replicate_local``: their data-dependent indexing cannot run on DTensors; every rank
  routes and computes the same), the shared experts split as the plan splits the dense MLP.
- a sub-layer with parameters the plan does not name at all (DeepSeek-V3's latent
  attention): kept whole and replicated on every rank.

Everything else in the model with parameters (norms, biases of split linears go with their
columns) is replicated. What is not covered is refused in one line (`tp_problem`), naming
the family and what works instead.
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn

from meshfit._compat.nn import child_slots
from meshfit.models.plans.base import (REPLICATE, SHARD_SEQ, Style, TPPlan, colwise,
                                       divisibility_problem, gather_input, gather_sequence,
                                       replicate, replicate_local, rowwise, sequence)
from meshfit.models.plans.gpt import head

__all__ = ["MAPPED_STYLES", "Unsupported", "hf_tp_problem", "meta_model", "tp_refusal",
           "transformers_tp_plan"]

MAPPED_STYLES = {
    "colwise": "column split",
    "rowwise": "row split (reduce-scattered onto the sequence under sequence parallel)",
    "colwise_gather_output": "column split, output gathered",
    "rowwise_split_input": "row split of a whole input, split locally",
    "embedding_rowwise": "vocabulary-parallel embedding",
    "replicated_with_grad_allreduce": "per-head norm on the rank's heads, gradient summed",
    "moe_tp_experts": "routed experts whole on every rank (replicate_local)",
    "packed_colwise": "(the experts' fused weights: kept whole with them)",
}
"""transformers' tensor-parallel styles meshfit maps, and what it does for each."""

_WORKS = "ZeRO (parallel.dp_shard) and DDP work for it"
_HYBRID = ("linear", "mamba", "ssm", "conv", "recurrent", "rwkv", "delta")


class Unsupported(ValueError):
    """A model meshfit's general tensor-parallel path does not cover (one line)."""


def _refuse(model, what: str) -> Unsupported:
    cfg = getattr(model, "config", model)
    family = getattr(cfg, "model_type", None) or type(model).__name__
    return Unsupported(f"tensor parallel: {family} ({type(model).__name__}) {what}; {_WORKS}")


def tp_refusal(config) -> str | None:
    """Why a transformers configuration's family cannot take the general plan, from the
    configuration alone (None: it may): encoder-decoders, vision towers, linear-attention and
    state-space hybrids, no plan shipped, a style meshfit has not mapped."""
    family = getattr(config, "model_type", type(config).__name__)
    head_ = f"tensor parallel: {family} ({type(config).__name__})"
    if getattr(config, "is_encoder_decoder", False):
        return f"{head_} is an encoder-decoder; meshfit's tp covers decoders only; {_WORKS}"
    towers = [k for k in ("vision_config", "audio_config", "vision_tower", "encoder_config")
              if getattr(config, k, None) is not None]
    if towers:
        return (f"{head_} has a {towers[0].split('_')[0]} tower ({towers[0]}); meshfit's tp "
                f"covers text decoders only (train its text_config alone); {_WORKS}")
    kinds = sorted({str(t) for t in getattr(config, "layer_types", None) or ()
                    if any(h in str(t).lower() for h in _HYBRID)})
    if kinds or any(k.startswith(("mamba_", "ssm_", "linear_")) for k in vars(config)):
        what = ", ".join(kinds) or "state-space settings"
        return (f"{head_} mixes linear-attention or state-space layers ({what}), which "
                f"meshfit's tp does not split; {_WORKS}")
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        return (f"{head_} ships no tensor-parallel plan (config.base_model_tp_plan); give "
                f"one as model.tp_plan = \"module:PLAN\"; {_WORKS}")
    return _unmapped(plan, head_)


def _unmapped(plan: dict[str, str], head_: str) -> str | None:
    unmapped = sorted({f"{s!r} ({k})" for k, s in plan.items() if s not in MAPPED_STYLES})
    if unmapped:
        return (f"{head_}'s plan uses style {', '.join(unmapped)}, which meshfit has not "
                f"mapped (mapped: {', '.join(MAPPED_STYLES)}); {_WORKS}")
    return None


# ---------------------------------------------------------------------------- reading
def _match(pattern: str, name: str) -> bool:
    p, n = pattern.split("."), name.split(".")
    return len(p) == len(n) and all(fnmatch.fnmatchcase(b, a) for a, b in zip(p, n))


def _hf_plan(model) -> dict[str, str]:
    """The model's transformers plan, keys relative to `model`: the configuration's
    (``base_model_tp_plan``, under the base model's prefix) updated with the model's public
    ``tp_plan`` (the class's head entry; a user's edits), which some models leave without
    the configuration's entries."""
    prefix = getattr(model, "base_model_prefix", "")
    plan = dict(getattr(model.config, "base_model_tp_plan", None) or {})
    if prefix and isinstance(getattr(model, prefix, None), nn.Module):
        plan = {f"{prefix}.{k}": v for k, v in plan.items()}
    own = getattr(model, "tp_plan", None)
    return {**plan, **(own if isinstance(own, dict) else {})}


def _holds_params(module: nn.Module | None) -> bool:
    return module is not None and any(True for _ in module.parameters())


def _own_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


def _layers(model, plan: dict[str, str]) -> str:
    """Path of the decoder layers: the container the plan's ``layers.*`` keys go through."""
    names = dict(model.named_modules())
    for key in plan:
        parts = key.split(".")
        for i in range(1, len(parts)):
            path = ".".join(parts[:i])
            if isinstance(names.get(path), (nn.ModuleList, nn.ModuleDict)):
                return path
    raise _refuse(model, "has no decoder-layer list its plan names (ModuleList under "
                  f"{sorted(plan)[:2]})")


# ---------------------------------------------------------------------------- a layer
def _entries(plan: dict[str, str], layers: str, index: str) -> list[tuple[str, str]]:
    """(pattern relative to layer `index`, transformers style) of the plan's keys for it."""
    out = []
    for key, style in plan.items():
        if key.startswith(layers + "."):
            atom, _, rest = key[len(layers) + 1:].partition(".")
            if rest and fnmatch.fnmatchcase(index, atom):
                out.append((rest, style))
    return out


def _planned(layer: nn.Module, entries) -> dict[str, str]:
    """Module name (in `layer`) -> transformers style, for the entries naming modules (an
    entry naming a parameter, e.g. ``experts.gate_up_proj``, matches none)."""
    names = [n for n, _ in layer.named_modules() if n]
    planned: dict[str, str] = {}
    for pattern, style in entries:
        for name in names:
            if _match(pattern, name):
                planned[name] = style
    return planned


def _split(style: str, model, name: str, *, sp_row: bool) -> Style:
    """The meshfit style of a linear the plan splits."""
    out = {"output": SHARD_SEQ, "local_output": False} if sp_row else {}
    if style == "colwise":
        return colwise()
    if style == "colwise_gather_output":
        return colwise(output=REPLICATE)
    if style == "rowwise":
        return rowwise(**out)
    if style == "rowwise_split_input":
        return rowwise(input=REPLICATE, **out)
    raise _refuse(model, f"plans {style!r} for {name}, which meshfit maps only on a module "
                  "it splits by columns or rows")


def _head_norm(model, name: str, module: nn.Module) -> Style:
    """``replicated_with_grad_allreduce``: a per-head norm on the rank's heads."""
    cfg = model.config
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    weight = getattr(module, "weight", None)
    if weight is None or weight.ndim != 1 or weight.shape[0] != hd:
        raise _refuse(model, f"plans 'replicated_with_grad_allreduce' for {name}, which is not "
                      f"a norm over one head (weight of head_dim={hd}): not mapped")
    return sequence(input="shard(2)", local_output=True)


def _mlp_leaves(entries, block: str) -> dict[str, str]:
    """Leaf name -> style of the dense MLP's linears the plan names under the MoE block's
    name (``mlp.gate_proj``: colwise, ...): how a shared expert it does not name splits."""
    return {p.rpartition(".")[2]: s for p, s in entries
            if s in ("colwise", "rowwise") and p.rpartition(".")[0] == block}


def _moe_block(model, block: str, module: nn.Module, planned, dense, sp: bool) -> dict:
    """A mixture-of-experts block: router and routed experts whole (replicate_local), shared
    experts split (all-reduced inside the block), the sequence gathered around it under SP."""
    styles: dict[str, Style] = {block: gather_sequence(local_output=False)} if sp else {}
    for child, sub in module.named_children():
        name = f"{block}.{child}"
        inner = {n: s for n, s in planned.items() if n.startswith(name + ".")}
        linears = {c: m for c, m in sub.named_children()  # (a LoRA layer wraps its linear)
                   if _plain_linear(getattr(m, "base_layer", m))}
        if not _holds_params(sub):
            continue
        if planned.get(name) == "moe_tp_experts":
            styles[name] = replicate_local()
        elif inner:
            styles |= {n: _split(s, model, n, sp_row=False) for n, s in inner.items()}
        elif linears and set(linears) <= set(dense) and not _own_params(sub):
            styles |= {f"{name}.{c}": _split(dense[c], model, c, sp_row=False)
                       for c in linears}
        elif _plain_linear(getattr(sub, "base_layer", sub)):
            styles[name] = replicate()  # e.g. Qwen2-MoE's shared-expert gate
        else:
            styles[name] = replicate_local()  # the router (PhiMoE's: a Linear that routes)
    return styles


def _plain_linear(module: nn.Module) -> bool:
    """An `nn.Linear` computing only its matmul: a subclass with a forward of its own (PhiMoE's
    router returns logits, weights and chosen experts) is not one a style may redistribute."""
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


def _sublayer(model, name: str, module: nn.Module, planned, sp: bool) -> dict:
    """An attention or dense MLP the plan splits: its linears, its per-head norms, the rest
    replicated -- refused where an unnamed module sits between split columns."""
    inner = {n: s for n, s in planned.items() if n.startswith(name + ".")}
    split_heads = any(s == "colwise" for s in inner.values())
    styles: dict[str, Style] = {name: gather_input()} if sp else {}
    for sub_name, sub in module.named_modules(prefix=name):
        style = inner.get(sub_name)
        if style is None and (not _own_params(sub) or
                              any(sub_name.startswith(n + ".") for n in inner)):
            continue  # (inside a planned module: a LoRA layer's base and adapters)
        if style == "replicated_with_grad_allreduce":
            styles[sub_name] = _head_norm(model, sub_name, sub)
        elif style is not None:
            styles[sub_name] = _split(style, model, sub_name,
                                      sp_row=sp and style.startswith("rowwise"))
        elif split_heads:
            raise _refuse(model, f"has {sub_name} ({type(sub).__name__}) between split "
                          "projections with no style in its plan: meshfit cannot tell whether "
                          "it needs all heads")
        else:
            styles[sub_name] = replicate()
    return styles


def _layer_styles(model, layer: nn.Module, entries, sp: bool) -> dict[str, Style]:
    """Styles of one decoder layer, names relative to it."""
    planned = _planned(layer, entries)
    blocks = {n.rpartition(".")[0] for n, s in planned.items() if s == "moe_tp_experts"}
    styles: dict[str, Style] = {}
    for child, module in layer.named_children():
        if child in blocks:
            styles |= _moe_block(model, child, module, planned, _mlp_leaves(entries, child), sp)
        elif any(n.startswith(child + ".") for n in planned):
            styles |= _sublayer(model, child, module, planned, sp)
        elif not _holds_params(module):
            if sp and isinstance(module, nn.Dropout) and module.p > 0:
                styles[child] = sequence()
        elif _own_params(module) and not list(module.children()):
            styles[child] = sequence() if sp else replicate()  # a norm of the residual stream
        else:  # a sub-layer the plan leaves whole (DeepSeek-V3's latent attention)
            styles[child] = replicate_local(output=SHARD_SEQ, local_output=False) if sp \
                else replicate_local()
    return styles


# ---------------------------------------------------------------------------- the model
def _ends(model, layers: str, sp: bool, loss_parallel: bool) -> tuple[dict, dict]:
    """Styles of what comes before the layers (embedding, its dropout) and after them (the
    final norm, the head), for the parts this model (or pipeline stage) holds."""
    seq = SHARD_SEQ if sp else REPLICATE
    names = {id(m): n for n, m in model.named_modules()}
    emb, out = model.get_input_embeddings(), model.get_output_embeddings()
    first: dict[str, Style] = {}
    last: dict[str, Style] = {}
    if _holds_params(emb):
        first[names[id(emb)]] = rowwise(input=REPLICATE, output=seq, local_output=not sp)
    base = layers.rpartition(".")[0]
    for child, module in (model.get_submodule(base) if base else model).named_children():
        name = f"{base}.{child}" if base else child
        if name == layers or module is emb:
            continue
        if sp and isinstance(module, nn.Dropout) and module.p > 0:
            first[name] = sequence()
        elif _holds_params(module):
            if list(module.children()) or (sp and not _is_norm(module)):
                raise _refuse(model, f"has {name} ({type(module).__name__}) beside its layers, "
                              "which meshfit's tp does not place")
            last[name] = sequence() if sp else replicate()
    if _holds_params(out) and id(out) in names:
        last[names[id(out)]] = head(loss_parallel, input=seq)
    return first, last


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


def _group(per_layer: dict[str, dict[str, Style]], layers: str) -> dict[str, Style]:
    """One ``layers.*`` pattern when every layer has the same styles, else one per index."""
    distinct = {tuple(sorted(s.items(), key=lambda kv: kv[0])) for s in per_layer.values()}
    if len(distinct) == 1:
        only = next(iter(per_layer.values()))
        return {f"{layers}.*.{k}": v for k, v in only.items()}
    return {f"{layers}.{i}.{k}": v for i, s in per_layer.items() for k, v in s.items()}


def transformers_tp_plan(model: nn.Module, *, sequence_parallel: bool = False,
                         loss_parallel: bool = False) -> TPPlan:
    """meshfit's `TPPlan` for a transformers decoder, from the model's own plan (see the
    module docstring); `Unsupported` (a ValueError, one line) where it is not covered."""
    problem = tp_refusal(model.config)
    if problem:
        raise Unsupported(problem)
    plan = _hf_plan(model)  # the configuration's plan with the class's (and a user's edits)
    problem = _unmapped(plan, f"tensor parallel: {model.config.model_type} "
                              f"({type(model).__name__})")
    if problem:
        raise Unsupported(problem)
    layers = _layers(model, plan)
    per_layer = {}
    for index, layer in child_slots(model.get_submodule(layers)).items():
        if layer is not None:  # a pipeline stage holds some of the layers
            per_layer[index] = _layer_styles(model, layer, _entries(plan, layers, index),
                                             sequence_parallel)
    first, last = _ends(model, layers, sequence_parallel, loss_parallel)
    styles = {**first, **(_group(per_layer, layers) if per_layer else {}), **last}
    split_attn = sorted({k.rpartition(".")[0] for k, s in styles.items()
                         if k.startswith(layers) and s.kind == "colwise" and s.output is None
                         and _heads_of(k)})
    return TPPlan(styles=styles, labels_kwarg="labels",
                  local_attrs={p: ("num_heads", "num_key_value_heads") for p in split_attn},
                  divisible=_divisible(model, styles, layers, split_attn))


def _heads_of(key: str) -> bool:
    """Whether a column-split linear holds attention heads (q, k, v or fused q|k|v)."""
    leaf = key.rsplit(".", 1)[-1]
    return leaf in ("q_proj", "k_proj", "v_proj", "query_key_value", "qkv_proj", "c_attn",
                    "query", "key", "value", "Wqkv", "W_pack")


def _divisible(model, styles: dict[str, Style], layers: str, split_attn: list[str]) -> tuple:
    """The sizes tp must divide: heads (where attention splits by heads), each other split
    width in the layers under its configuration name where one holds it, the vocabulary."""
    cfg, cls = model.config, type(model.config).__name__
    out: list[tuple[str, int, str]] = []
    if split_attn:
        out.append((f"{cls}.num_attention_heads", cfg.num_attention_heads, "heads"))
        kv = getattr(cfg, "num_key_value_heads", None)
        if kv not in (None, cfg.num_attention_heads):
            out.append((f"{cls}.num_key_value_heads", kv, "heads"))
    names = dict(model.named_modules())
    for key, style in styles.items():
        if style.kind not in ("colwise", "rowwise") or not key.startswith(layers + ".") or \
                key.rpartition(".")[0] in split_attn:  # heads: checked above
            continue
        for name, module in names.items():
            if isinstance(module, nn.Linear) and _match(key, name):
                width = module.out_features if style.kind == "colwise" else module.in_features
                label = f"{cls}.{_field(cfg, width, key) or key + '.features'}"
                if (label, width, "width") not in out:
                    out.append((label, width, "width"))
                break
    out.append((f"{cls}.vocab_size", cfg.vocab_size, "vocab"))
    return tuple(out)


def _field(cfg, width: int, key: str) -> str | None:
    """The configuration field holding a split width, the one that names the module's part
    where several hold the same value (a shared expert's, an expert's, the dense MLP's)."""
    fields = [k for k, v in vars(cfg).items() if k.endswith("size") and v == width
              and isinstance(v, int) and not isinstance(v, bool)]
    prefer = "shared" if "shared" in key else "moe" if "expert" in key else "intermediate"
    return min(fields, key=lambda k: (prefer not in k, len(k)), default=None)


def meta_model(config):
    """A model of `config` on the meta device: its module tree, no memory."""
    import transformers

    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def hf_tp_problem(model_or_config, tp: int) -> str | None:
    """Why the general plan cannot run a transformers model (or configuration: its module
    tree is built on the meta device) on `tp` ranks, in one line; None when it can."""
    config = getattr(model_or_config, "config", model_or_config)
    problem = tp_refusal(config)
    if problem:
        return problem
    model = model_or_config if isinstance(model_or_config, nn.Module) else None
    try:
        model = model or meta_model(config)
        plan = transformers_tp_plan(model)
    except (ValueError, KeyError, TypeError) as err:  # Unsupported, or no causal-LM class
        return str(err) if isinstance(err, Unsupported) else (
            f"tensor parallel: {getattr(config, 'model_type', '?')} has no causal-LM model "
            f"meshfit can build ({err}); {_WORKS}")
    family = getattr(config, "model_type", type(config).__name__)
    left = unplaced(model, plan)
    if left:
        return (f"tensor parallel: {family} ({type(model).__name__}) has parameters its plan "
                f"does not place ({', '.join(left[:3])}{', ...' if len(left) > 3 else ''}); "
                f"{_WORKS}")
    problem = divisibility_problem(plan.divisible, tp) if tp > 1 else None
    if problem:
        return f"{family} ({type(model).__name__}): {problem}"
    return None


_NO_PARAMS = ("prepare_input", "gather_sequence", "gather_input")  # styles placing no weight


def _match(pattern: str, name: str) -> bool:
    p, n = pattern.split("."), name.split(".")
    return len(p) == len(n) and all(fnmatch.fnmatchcase(b, a) for a, b in zip(p, n))


def unplaced(model: nn.Module, plan: TPPlan) -> list[str]:
    """The parameters of `model` that no style of `plan` places (`apply_tp` would refuse them
    at launch): neither their module nor an enclosing `replicate_local` one has a style."""
    out = []
    for full, _ in model.named_parameters():
        if ".lora_" in full or ".base_layer." in full:  # (a LoRA layer: `lora_plan` places it)
            continue
        owner = full.rpartition(".")[0]
        if any(_match(k, owner) and getattr(s, "kind", None) not in _NO_PARAMS
               for k, s in plan.styles.items()):
            continue
        parts = owner.split(".")
        if any(getattr(s, "kind", None) == "replicate_local" and _match(k, ".".join(parts[:end]))
               for end in range(len(parts)) for k, s in plan.styles.items()):
            continue
        out.append(full)
    return out

