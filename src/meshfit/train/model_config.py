"""[model] of a run's config: what to train (`ModelConfig`). No torch: a bad value is refused
before torch loads (a `hf_model` folder's check is the exception: it reads the folder)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from meshfit.models.config import AttentionBackend, GPTConfig
from meshfit.train.checks import check_choice, check_number, check_positive

__all__ = ["MOE_FIELDS", "ModelConfig"]


MOE_FIELDS = ("n_experts", "top_k", "moe_every", "moe_d_ff", "shared_experts", "router",
              "capacity_factor", "aux_loss_coef", "router_z_loss_coef")
"""[model]'s mixture-of-experts fields (see `meshfit.models.GPTConfig`)."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """[model]: what to train. One source: a reference GPT `preset` (size fields left unset
    take the preset's), a Hugging Face `hf_config` (random weights from the seed) or
    `hf_model` (its weights), or the user's own `factory`."""

    preset: str = "tiny"
    """A `GPTConfig.preset` name: tiny, gpt2, llama-1b, llama-7b, llama-70b (used when none of
    hf_config, hf_model and factory is given)."""
    hf_config: str = ""
    """A Hugging Face config.json (or a folder holding one): that causal LM, built with
    random weights (transformers' init, from train.seed). No download."""
    hf_model: str = ""
    """A local Hugging Face model folder (config.json + safetensors, as save_pretrained
    writes it): built on the meta device, each rank reading only the slices its layout
    needs."""
    factory: str = ""
    """"module:function" returning your own nn.Module (module importable from the current
    folder or PYTHONPATH); called with the keyword arguments it declares among vocab_size and
    max_seq_len. Its forward takes token ids [B, T] and returns logits [B, T, V] (or an
    object with .logits)."""
    tp_plan: str = ""
    """"module:PLAN" — the tensor-parallel plan of a model without a built-in one: a
    `meshfit.models.plans.TPPlan`, a {module pattern: style} dict, or a function of the model
    returning either (built-in: the reference GPT, Llama, Qwen2, Mistral, GPT-2)."""
    pipeline_plan: str = ""
    """"module:PLAN" — where pipeline stages are cut for a model without a built-in plan: a
    `meshfit.models.plans.PipelinePlan` or a function of the model returning one."""
    n_layer: int | None = None
    """Transformer blocks (None: the preset's)."""
    n_head: int | None = None
    """Attention heads (None: the preset's)."""
    d_model: int | None = None
    """Hidden size (None: the preset's)."""
    d_ff: int | None = None
    """MLP hidden size (None: the preset's)."""
    dropout: float | None = None
    """Dropout probability (None: the preset's)."""
    n_experts: int | None = None
    """Mixture of experts: routed experts per MoE block (0: dense; None: the preset's, e.g.
    moe-tiny's 8). See `meshfit.models.GPTConfig` for this and the next fields."""
    top_k: int | None = None
    """Experts each token is routed to (<= n_experts)."""
    moe_every: int | None = None
    """Every this many blocks is an MoE block (1: all)."""
    moe_d_ff: int | None = None
    """Hidden width of each expert (None: d_ff)."""
    shared_experts: int | None = None
    """0 or 1: a dense expert every token also passes through."""
    router: str | None = None
    """"softmax_topk" or "sigmoid_topk"."""
    capacity_factor: float | None = None
    """> 0: each expert keeps at most capacity_factor x its even share of the assignments
    (the rest are dropped and counted); unset: dropless."""
    aux_loss_coef: float | None = None
    """Weight of the load-balancing loss (Switch / GShard)."""
    router_z_loss_coef: float | None = None
    """Weight of the router z-loss (ST-MoE)."""
    attention_backend: str = "auto"
    """SDPA kernel: auto, math, flash, efficient or cudnn (checked on the device before
    launch; the reference GPT only)."""

    def __post_init__(self) -> None:
        if self.preset not in GPTConfig.preset_names():
            raise ValueError(f"model.preset={self.preset!r} is not a preset; use one of "
                             f"{', '.join(GPTConfig.preset_names())}")
        for name in ("n_layer", "n_head", "d_model", "d_ff"):
            if getattr(self, name) is not None:
                check_positive("model", name, getattr(self, name))
        if self.dropout is not None:
            check_number("model", "dropout", self.dropout, 0.0, 0.99)
        check_choice("model", "attention_backend", self.attention_backend,
                     get_args(AttentionBackend))
        for name in ("hf_config", "hf_model", "factory", "tp_plan", "pipeline_plan"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"model.{name}={getattr(self, name)!r} must be a string")
        given = [n for n in ("hf_config", "hf_model", "factory") if getattr(self, n)]
        if len(given) > 1:
            raise ValueError(f"model.{given[0]} and model.{given[1]} are both set; give one "
                             "source of the model")
        sized = [n for n in ("n_layer", "n_head", "d_model", "d_ff", "dropout", *MOE_FIELDS)
                 if getattr(self, n) is not None]
        if given and sized:
            raise ValueError(f"model.{sized[0]}={getattr(self, sized[0])!r} sizes the reference "
                             f"GPT, but the model comes from model.{given[0]}; change the size "
                             "in that model's config instead")
        if self.hf_config:
            path = Path(self.hf_config).expanduser()
            if not (path.is_file() or (path / "config.json").is_file()):
                raise ValueError(f"model.hf_config={self.hf_config!r} is neither a config.json "
                                 "file nor a folder holding one")
        if self.hf_model:
            from meshfit.checkpoint.pretrained import check_folder

            check_folder(self.hf_model, "model.hf_model")
        for name in ("factory", "tp_plan", "pipeline_plan"):
            spec = getattr(self, name)
            module, sep, attr = spec.partition(":")
            if spec and not (sep and module and attr):
                raise ValueError(f"model.{name}={spec!r} must look like module:attribute, e.g. "
                                 "mymodels:build_model")
        if not given:
            self._check_preset()

    def _check_preset(self) -> None:
        """The GPTConfig's own checks (top_k <= n_experts, ...), named as [model] keys."""
        try:
            gpt = GPTConfig.preset(self.preset, **{n: getattr(self, n) for n in MOE_FIELDS
                                                   if getattr(self, n) is not None})
        except (ValueError, TypeError) as err:
            raise ValueError(str(err).replace("GPTConfig.", "model.")) from None
        routed = [n for n in MOE_FIELDS if n != "n_experts" and getattr(self, n) is not None]
        if routed and not gpt.n_experts:
            raise ValueError(f"model.{routed[0]}={getattr(self, routed[0])!r} configures "
                             f"mixture-of-experts blocks, but model.preset={self.preset!r} "
                             "has none (n_experts=0); set model.n_experts or use the "
                             "moe-tiny preset")

    @property
    def source(self) -> str:
        """Which field gives the model: preset, hf_config, hf_model or factory."""
        return next((n for n in ("hf_config", "hf_model", "factory") if getattr(self, n)),
                    "preset")

    def overrides(self) -> dict[str, Any]:
        """The reference GPT's fields this section sets (over its preset's)."""
        keep = ("n_layer", "n_head", "d_model", "d_ff", "dropout", "attention_backend",
                *MOE_FIELDS)
        return {name: getattr(self, name) for name in keep if getattr(self, name) is not None}
