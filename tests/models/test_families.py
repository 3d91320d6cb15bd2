"""The tiny family models: each family's own class, its splitting features kept, runnable."""

import pytest
import torch

from meshfit.models.families import (
    FAMILIES,
    MOE_FAMILIES,
    shrink_config,
    tiny_config,
    tiny_model,
)


def test_every_family_builds_small_and_computes_a_finite_loss():
    x = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    for family in FAMILIES:
        model = tiny_model(family)
        assert model.config.model_type == family
        assert sum(p.numel() for p in model.parameters()) < 250_000, family
        out = model(input_ids=x, labels=x)
        assert out.logits.dtype == torch.float64 and torch.isfinite(out.loss), family


def test_the_features_that_change_a_split_are_kept():
    gemma2 = tiny_config("gemma2")
    assert set(gemma2.layer_types) == {"sliding_attention", "full_attention"}
    assert gemma2.attn_logit_softcapping and gemma2.final_logit_softcapping
    assert gemma2.sliding_window < 12  # a 12-token test sequence crosses the window
    assert tiny_config("llama").num_key_value_heads < tiny_config("llama").num_attention_heads
    deepseek = tiny_config("deepseek_v3")
    assert deepseek.first_k_dense_replace == 1 and deepseek.n_group > deepseek.topk_group
    for family in MOE_FAMILIES:
        config = tiny_config(family)
        experts = next(getattr(config, k) for k in ("num_local_experts", "num_experts",
                                                    "n_routed_experts") if hasattr(config, k))
        assert experts % 2 == 0, family


def test_shrink_cuts_every_per_layer_list_and_keeps_the_original():
    import transformers

    full = transformers.SmolLM3Config()
    small = shrink_config(full, layers=3)
    assert len(small.no_rope_layers) == 3 and len(small.layer_types) == 3
    assert full.num_hidden_layers == 36  # the caller's configuration is not touched
    # a per-layer list that is a read-only property (a hybrid's layer kinds): left derived
    assert shrink_config(transformers.BambaConfig()).num_hidden_layers == 2
    with pytest.raises(ValueError, match="family 'bert'"):
        tiny_config("bert")
