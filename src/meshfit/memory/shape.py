"""`ModelShape`: what the memory estimate and the layout planner need to know of a model,
read from the model itself built on the meta device (no memory, no weights, no download).

    ModelShape.of("gpt2")                     # a reference GPT preset (vocabulary kept)
    ModelShape.of("configs/llama.json")       # a transformers config.json (or its folder)
    ModelShape.of("mymodels:build")           # your nn.Module, from a factory
    ModelShape.from_module(model)             # any model on the meta device

Parameter counts are exact (each tensor once, a tied head once); the block structure, the
parts only the first and last pipeline stages hold and the share tensor parallel splits come
from the model's own pipeline and tensor-parallel plans (`meshfit.models.plans`). For the
reference GPT's mixture of experts, the active parameters per token and the routed experts'
parameters (what expert parallelism splits, `expert_params`) come from its `GPTConfig`; for
a transformers mixture of experts (Mixtral, Qwen2/3-MoE, GLM-4-MoE, DeepSeek-V3) the active
parameters come from its config's expert counts and its ``*Experts`` modules, and the routed
experts' parameters from those modules' fused ``gate_up_proj`` / ``down_proj``.
"""

from __future__ import annotations

import fnmatch
import inspect
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from meshfit.distributed.tensors import names_by_parameter
from meshfit.models.config import GPTConfig
from meshfit.models.factory import import_object
from meshfit.models.gpt import GPT
from meshfit.models.plans import has_builtin_plans, pipeline_plan_for, plan_for

__all__ = ["ModelShape", "block_linears"]


def _count(module: nn.Module | None, seen: set[int]) -> int:
    if module is None:
        return 0
    total = 0
    for p in module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The sizes of a decoder-only transformer that decide its memory and its cost."""

    name: str
    params: int
    """Unique parameters (a tied embedding/head once)."""
    block_params: int
    """Parameters of one transformer block (the largest, if they differ)."""
    n_layer: int
    first_params: int
    """Parameters only the first pipeline stage holds (token/position embeddings)."""
    last_params: int
    """Parameters only the last stage holds (final norm, head); a tied head counts here too,
    because with pp > 1 the last stage keeps its own copy."""
    tied: bool
    d_model: int
    n_head: int
    n_kv_head: int
    d_ff: int
    vocab_size: int
    max_seq_len: int | None
    gated_mlp: bool
    """SwiGLU-style MLP (gate and up projections) rather than one up projection."""
    dropout: bool
    """Whether dropout layers are active (their masks are saved for backward)."""
    tp_split: float
    """Share of the parameters that tensor parallel splits (linear weights, column-parallel
    biases, the vocabulary-parallel embedding and head); the rest is replicated."""
    divisible: tuple[tuple[str, int, str], ...] = ()
    """Sizes the tensor-parallel degree must divide (the TP plan's: heads, widths, vocab)."""
    active_params: int | None = None
    """Parameters used per token when they differ from `params` (mixture of experts)."""
    n_experts: int = 0
    """Routed experts per mixture-of-experts block that expert parallelism can split (the
    reference GPT's `GPTConfig.n_experts`, a transformers MoE's experts modules'
    ``num_experts``); 0: none (a dense model)."""
    expert_params: int = 0
    """Parameters of those routed experts in the whole model: n_moe_layers x n_experts x
    one expert's weights (`ep` divides them; the router and a shared expert are not
    among them)."""
    block_expert_params: int = 0
    """Routed-expert parameters of one MoE block (n_experts x one expert's weights)."""
    block_linears: tuple[tuple[int, int], ...] = ()
    """(in, out) features of every linear layer inside the blocks, all blocks
    (`block_linears`): what LoRA adapts by default (`meshfit.memory.Adapters.lora`)."""

    @property
    def moe_layers(self) -> int:
        """Blocks holding routed experts."""
        return self.expert_params // self.block_expert_params if self.block_expert_params else 0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_dim(self) -> int:
        return self.n_kv_head * self.head_dim

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward): PaLM's 6N + 12·L·d·T, N the
        parameters used in matmuls (every parameter but the embedding lookups)."""
        matmul = (self.active_params or self.params) - self.first_params
        if self.tied:
            matmul += self.vocab_size * self.d_model  # the head's matmul uses the embedding
        return 6.0 * matmul + 12.0 * self.n_layer * self.d_model * seq_len

    # ------------------------------------------------------------------ construction
    @classmethod
    def of(cls, spec: str, *, vocab_size: int | None = None, trust_code: bool = False
           ) -> ModelShape:
        """From a preset name, a transformers config.json (or a folder holding one), or a
        ``module:function`` factory (called with no arguments, or with `vocab_size`)."""
        if not isinstance(spec, str) or not spec:
            raise ValueError(f"MODEL={spec!r} must be a preset name, a config.json path or "
                             "module:function")
        if spec in GPTConfig.preset_names():
            overrides = {"vocab_size": vocab_size} if vocab_size else {}
            with torch.device("meta"):
                return cls.from_module(GPT(GPTConfig.preset(spec, **overrides)), name=spec)
        path = Path(spec).expanduser()
        if path.suffix == ".json" or path.is_dir() or path.exists():
            config = path / "config.json" if path.is_dir() else path
            if not config.is_file():
                raise ValueError(f"MODEL={spec!r} is not a file nor a folder holding "
                                 "config.json; give a preset "
                                 f"({', '.join(GPTConfig.preset_names())}), a config.json or "
                                 "module:function")
            import transformers  # optional: a config.json names a transformers model

            # trust_code: the folder's own model code (auto_map) runs; the caller asked the
            # user (`meshfit.models.factory.check_folder_code`); never transformers' prompt
            hf_config = transformers.AutoConfig.from_pretrained(str(config),
                                                                trust_remote_code=trust_code)
            with torch.device("meta"):
                model = transformers.AutoModelForCausalLM.from_config(
                    hf_config, **({"trust_remote_code": True} if trust_code else {}))
            return cls.from_module(model, name=str(spec))
        if ":" in spec:
            factory = import_object(spec, "MODEL")
            kwargs = {}
            if vocab_size and "vocab_size" in inspect.signature(factory).parameters:
                kwargs["vocab_size"] = vocab_size
            with torch.device("meta"):
                return cls.from_module(factory(**kwargs), name=spec)
        raise ValueError(f"MODEL={spec!r} is not a preset ({', '.join(GPTConfig.preset_names())}"
                         "), an existing config.json or folder, nor module:function")

    @classmethod
    def from_module(cls, model: nn.Module, name: str | None = None) -> ModelShape:
        """From a model (on the meta device is enough) with a decoder-block structure: the
        built-in plans' (reference GPT, Llama, Qwen2, Mistral, GPT-2) or, for another model,
        its largest ModuleList of blocks and a config with the usual size names."""
        name = name or type(model).__name__
        params = _count(model, set())
        blocks = list(_children(_blocks(model)[1]))
        if has_builtin_plans(model):
            pp_plan = pipeline_plan_for(model)
            first = sum(_count(_get(model, n), set()) for n in pp_plan.first)
            last_seen: set[int] = set()
            last = sum(_count(_get(model, n), last_seen) for n in pp_plan.last)
            tp_plan = plan_for(model)
            tp_styles, divisible = tp_plan.styles, tuple(tp_plan.divisible)
        else:
            first = last = 0
            tp_styles, divisible = {}, ()
        block = max(_count(b, set()) for b in blocks)
        tied = any(len(names) > 1 for names in names_by_parameter(model))
        sizes = _sizes(model)
        tp_split = _tp_split(model, tp_styles, params) if tp_styles else 0.0
        dropout = any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())
        gated = isinstance(model, GPT) and model.config.mlp == "swiglu" or _has_gate(blocks[0])
        active, experts = None, {}
        if isinstance(model, GPT) and model.config.n_experts:
            active = model.config.num_active_params()  # top_k (+ shared) experts per token
            experts = _routed_experts(model.config)
        else:  # transformers' MoE: the routed experts meshfit's ep splits (`meshfit.parallel.
            active = _hf_active_params(model, params)  # ep_hf`), and the active parameters
            experts = _hf_routed_experts(model)
        return cls(name=name, params=params, block_params=block, n_layer=len(blocks),
                   first_params=first, last_params=last, tied=tied, gated_mlp=gated,
                   dropout=dropout, tp_split=tp_split, divisible=divisible,
                   active_params=active, **experts, **sizes,
                   block_linears=tuple(_features(m) for m in block_linears(model).values()))


def _blocks(model: nn.Module) -> tuple[str, nn.Module]:
    """(name, container) of `model`'s blocks: its built-in pipeline plan's, else its largest
    ModuleList (or ModuleDict); ValueError where it has none."""
    if has_builtin_plans(model):
        plan = pipeline_plan_for(model)
        return plan.blocks, plan.blocks_of(model)
    best: tuple[str, nn.Module] | None = None
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and \
                (best is None or len(module) > len(best[1])):
            best = name, module
    if best is None or not len(best[1]):
        raise ValueError(f"{type(model).__name__}: found no ModuleList of blocks; the estimate "
                         "needs a decoder-block model")
    return best


def _is_linear(module: nn.Module) -> bool:
    # transformers' Conv1D (GPT-2's projections) is a linear layer with its weight transposed
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def _features(module: nn.Module) -> tuple[int, int]:
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    return module.weight.shape[0], module.weight.shape[1]  # Conv1D: weight (in, out)


def block_linears(model: nn.Module) -> dict[str, nn.Module]:
    """{full name: module} of every linear layer inside `model`'s blocks (`nn.Linear` and
    transformers' ``Conv1D``), in model order: the attention and MLP projections of a dense
    decoder (a mixture of experts' router too), never the embeddings or the output head.
    The one rule of what LoRA adapts by default: `meshfit.peft.lora` targets these and
    `meshfit.memory.Adapters.lora` counts them (QLoRA, after Dettmers et al. 2023, who find
    adapting every block linear matches full fine-tuning better than q and v alone)."""
    name, container = _blocks(model)
    return {f"{name}.{inner}": module for inner, module in container.named_modules()
            if _is_linear(module)}


def _routed_experts(c) -> dict:
    """The routed experts of a reference GPT config (`meshfit.models.moe.Experts`: bias-free
    stacked weights, w1/w3/w2 for SwiGLU, w_in/w_out for GELU), in closed form."""
    one = (3 if c.mlp == "swiglu" else 2) * c.d_model * c.expert_d_ff
    block = c.n_experts * one
    return dict(n_experts=c.n_experts, expert_params=c.n_moe_layers * block,
                block_expert_params=block)


def _hf_routed_experts(model: nn.Module) -> dict:
    """The routed experts of a transformers mixture of experts, as expert parallel splits
    them (`meshfit.parallel.ep_hf`): its fused experts modules (``gate_up_proj`` [E, 2F, d],
    ``down_proj`` [E, d, F]), one per MoE layer, counted exactly; the routers, shared experts
    and dense layers (``first_k_dense_replace``, ``mlp_only_layers``) are not among them.
    {} for a model without such modules."""
    blocks = [m for m in model.modules()
              if getattr(getattr(m, "gate_up_proj", None), "ndim", 0) == 3
              and isinstance(getattr(m, "num_experts", None), int)]
    if not blocks:
        return {}
    sizes = [sum(p.numel() for p in m.parameters(recurse=False)) for m in blocks]
    return dict(n_experts=blocks[0].num_experts, expert_params=sum(sizes),
                block_expert_params=max(sizes))


def _hf_active_params(model: nn.Module, params: int) -> int | None:
    """Parameters used per token by a transformers mixture of experts (Mixtral, Qwen2-MoE,
    ...: a config with ``num_experts_per_tok`` and ``num_local_experts`` or ``num_experts``,
    whose routed experts are modules named ``*Experts`` holding [n_experts, ...] weights);
    None for any other model. A token uses top_k of n_experts routed experts; shared
    experts and routers are always active."""
    config = getattr(model, "config", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    n_experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts",
                                                                       None)
    if not isinstance(top_k, int) or not isinstance(n_experts, int) or n_experts <= 1:
        return None
    blocks = []
    for module in model.modules():
        if not type(module).__name__.endswith("Experts"):
            continue
        own = list(module.parameters(recurse=False))
        if own and all(p.dim() >= 2 and p.shape[0] == n_experts for p in own):
            blocks.append(sum(p.numel() for p in own))
    if not blocks:
        return None
    routed = sum(blocks)
    return params - routed + routed * min(top_k, n_experts) // n_experts


def _children(container: nn.Module):
    return container.values() if isinstance(container, nn.ModuleDict) else iter(container)


def _get(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _has_gate(block: nn.Module) -> bool:
    return any(n.endswith(("gate_proj", "w1", "w3")) for n, _ in block.named_modules())


def _sizes(model: nn.Module) -> dict:
    if isinstance(model, GPT):
        c = model.config
        return dict(d_model=c.d_model, n_head=c.n_head, n_kv_head=c.kv_heads, d_ff=c.d_ff,
                    vocab_size=c.vocab_size, max_seq_len=c.max_seq_len)
    c = getattr(model, "config", None)

    def first(*names, default=None):
        for n in names:
            value = getattr(c, n, None)
            if value is not None:
                return value
        return default

    d = first("hidden_size", "n_embd", "d_model")
    heads = first("num_attention_heads", "n_head")
    if d is None or heads is None:
        raise ValueError(f"{type(model).__name__}: its config names no hidden size and head "
                         "count (hidden_size / num_attention_heads)")
    return dict(d_model=d, n_head=heads,
                n_kv_head=first("num_key_value_heads", default=heads),
                d_ff=first("intermediate_size", "n_inner", default=4 * d),
                vocab_size=first("vocab_size", default=0),
                max_seq_len=first("max_position_embeddings", "n_positions"))


def _tp_split(model: nn.Module, styles: dict, params: int) -> float:
    """Share of the parameters in modules a TP style splits (rowwise biases replicated)."""
    split, seen = 0, set()
    for name, module in model.named_modules():
        style = next((s for pattern, s in styles.items() if fnmatch.fnmatchcase(name, pattern)),
                     None)
        kind = getattr(style, "kind", "")
        if kind not in ("colwise", "rowwise", "conv1d_colwise", "conv1d_rowwise"):
            continue
        for p_name, p in module.named_parameters(recurse=False):
            if id(p) in seen or (p_name == "bias" and "rowwise" in kind):
                continue
            seen.add(id(p))
            split += p.numel()
    return split / params if params else 0.0
