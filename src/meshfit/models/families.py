"""Tiny models of transformers' decoder families, for tests, `meshfit verify` and the
family matrix: the family's own configuration class with its sizes shrunk, every feature
that changes how the model splits kept (grouped-query heads, q/k norms, fused projections,
sliding and full layers, softcapping, multipliers, shared experts, grouped routing).

    config = tiny_config("qwen3")                 # a Qwen3Config, 2 layers, width 64
    model = tiny_model("gemma2", seed=0)          # Gemma2ForCausalLM in float64

`shrink_config` does the same to any transformers configuration (a user's own, or one of
each model type transformers ships): every size attribute the configuration has is set to a
small value that keeps its divisibility (heads divide the width, kv heads divide heads,
experts divide by 2), every per-layer list is cut to the layer count.
"""

from __future__ import annotations

import copy

import torch

__all__ = ["FAMILIES", "MOE_FAMILIES", "shrink_config", "tiny_config", "tiny_model"]

FAMILIES = {
    "llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
    "qwen3_moe": "Qwen3MoeConfig", "mistral": "MistralConfig", "mixtral": "MixtralConfig",
    "gemma2": "Gemma2Config", "gemma3_text": "Gemma3TextConfig", "phi3": "Phi3Config",
    "olmo2": "Olmo2Config", "gpt_neox": "GPTNeoXConfig", "granite": "GraniteConfig",
    "smollm3": "SmolLM3Config", "glm4_moe": "Glm4MoeConfig", "deepseek_v3": "DeepseekV3Config",
    "qwen2_moe": "Qwen2MoeConfig",
}
"""Family name (transformers' ``model_type``) -> its configuration class in transformers."""

MOE_FAMILIES = ("qwen3_moe", "mixtral", "glm4_moe", "deepseek_v3", "qwen2_moe")

# attribute -> value, set where the configuration has the attribute
_SIZES = {
    "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128,
    "max_position_embeddings": 256, "moe_intermediate_size": 32, "intermediate_size_mlp": 96,
    "shared_expert_intermediate_size": 48, "num_local_experts": 4, "num_experts": 4,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 16, "qk_head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8,
    "decoder_sparse_step": 1, "num_nextn_predict_layers": 0,
}
_PER_LAYER = ("layer_types", "no_rope_layers")
_INDEX_LISTS = ("mlp_only_layers",)
_NO_DROPOUT = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop",
               "classifier_dropout", "dropout")


def _set(config, key: str, value) -> None:
    """``config.key = value``, unless `key` is read-only there (some are properties derived
    from other attributes, as hybrids' ``layer_types``)."""
    try:
        setattr(config, key, value)
    except AttributeError:
        pass


def shrink_config(config, *, layers: int = 2, **sizes):
    """A copy of the transformers configuration `config` at test size: `layers` decoder
    layers, the sizes above (or `sizes`) where the configuration has them, per-layer lists
    cut to `layers` (a list that would then hold one attention type gets both, alternating,
    when the full list had both; lists of layer indices keep the indices below `layers`),
    dropout off. A composite configuration (a text model beside a vision or audio tower:
    Llama 4, Gemma 3) has each of its sub-configurations shrunk the same way; left whole, its
    text model is the full-size one."""
    config = copy.deepcopy(config)
    for key in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            setattr(config, key, shrink_config(sub, layers=layers, **sizes))
    values = {**_SIZES, **sizes}
    for key, value in values.items():
        if hasattr(config, key) and getattr(config, key) is not None:
            _set(config, key, value)
    if hasattr(config, "num_key_value_heads") and config.num_key_value_heads is None:
        config.num_key_value_heads = values["num_key_value_heads"]
    if getattr(config, "qk_rope_head_dim", None):  # DeepSeek's rotary tables: head_dim wide
        config.head_dim = config.qk_rope_head_dim
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        token = getattr(config, key, None)
        if isinstance(token, int) and token >= config.vocab_size:
            setattr(config, key, config.vocab_size - 1)
    original = getattr(config, "num_hidden_layers", None)
    config.num_hidden_layers = layers
    # the per-layer lists: those named, and any other list with one entry per layer
    per_layer = set(_PER_LAYER) | {k for k, v in vars(config).items()
                                   if isinstance(v, list) and original and len(v) == original}
    for key in sorted(per_layer):
        full = getattr(config, key, None)
        if key in _INDEX_LISTS and isinstance(full, list):  # layer indices, not one per layer
            _set(config, key, [i for i in full if isinstance(i, int) and i < layers])
            continue
        if isinstance(full, list) and full:
            kept = list(full[:layers]) + [full[-1]] * max(0, layers - len(full))
            kinds = list(dict.fromkeys(full))
            if key == "layer_types" and len(kinds) > 1 and len(set(kept)) == 1:
                kept = [kinds[i % len(kinds)] for i in range(layers)]
            _set(config, key, kept)
    for key in _NO_DROPOUT:
        if isinstance(getattr(config, key, None), float):
            setattr(config, key, 0.0)
    return config


def tiny_config(family: str, **sizes):
    """The configuration of a tiny model of `family` (a key of `FAMILIES`)."""
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"family {family!r} is not one of {', '.join(FAMILIES)}")
    config = getattr(transformers, FAMILIES[family])()
    if family == "gemma3_text":  # its default list holds only sliding layers
        config.layer_types = ["sliding_attention", "full_attention"]
    if family == "smollm3":  # one layer with RoPE, one without
        config.no_rope_layers = [1, 0]
    if family == "granite":  # multipliers away from 1, so a plan that drops one shows
        config.embedding_multiplier, config.residual_multiplier = 2.0, 0.5
        config.attention_multiplier, config.logits_scaling = 0.25, 4.0
    if family == "qwen2_moe":
        config.mlp_only_layers = []
    return shrink_config(config, **sizes)


def tiny_model(family: str, *, seed: int = 0, dtype=None, **sizes):
    """A tiny `family` causal LM from `tiny_config`, weights seeded by `seed`, in `dtype`
    (float64 by default: layouts compared against one process at rounding level). A mixture
    of experts runs transformers' "eager" experts loop in float64 (its default grouped
    matmul takes float32 and bfloat16 only)."""
    import transformers

    config = tiny_config(family, **sizes)
    extra = ({"experts_implementation": "eager"}
             if family in MOE_FAMILIES and (dtype or torch.float64) == torch.float64 else {})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, **extra)
    return model.to(dtype or torch.float64)
