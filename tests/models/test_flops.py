"""Model FLOPs per token (what MFU divides by) against torch's FlopCounterMode, and the
device peak that MFU divides into.

Convention (PaLM, appendix B): 6·N + 12·L·d·T per token for forward and backward, N the
parameters taking part in matrix products (all but embedding lookups; the output head
counts, tied or not), the attention scores and weighted sum counted over the full T×T
matrix (the causal mask's half is not subtracted), a mixture of experts' N its active
parameters. FlopCounterMode counts every matrix product that runs, so the two agree up to
the norm gains and biases PaLM's N includes but no product uses: under 1% at the sizes
below (GPT-2's biases and layer norms are the largest share, 0.84% at d_model 128), hence
the 1% tolerance.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from meshfit.memory import ModelShape
from meshfit.models import GPT, GPTConfig

B, T = 2, 32


def _measured(model: torch.nn.Module, vocab: int, *, hf: bool) -> float:
    torch.manual_seed(0)
    idx = torch.randint(0, vocab, (B, T))
    # The math backend computes attention as matrix products, which the counter sees
    # (the fused CPU kernel is not counted at all).
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        if hf:
            model(input_ids=idx, labels=idx).loss.backward()
        else:
            model(idx, idx).backward()
    return counter.get_total_flops()


def _hf(kind: str) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if kind == "llama":
        config = transformers.LlamaConfig(**common)
    elif kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=256, n_embd=128, n_layer=2, n_head=4,
                                         n_positions=64)
    elif kind == "mixtral":  # every token is routed to exactly top_k experts
        config = transformers.MixtralConfig(**common, num_local_experts=4,
                                            num_experts_per_tok=2)
    else:
        config = transformers.Qwen2MoeConfig(**common, num_experts=4, num_experts_per_tok=2,
                                             moe_intermediate_size=128,
                                             shared_expert_intermediate_size=256,
                                             decoder_sparse_step=1, mlp_only_layers=[])
    # Attention and experts as plain matrix products, which the counter sees (it has no
    # formula for _grouped_mm, transformers' default for experts).
    config._attn_implementation = "eager"
    if kind in ("mixtral", "qwen2_moe"):
        config._experts_implementation = "eager"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).float()


@pytest.mark.parametrize("kind", ["llama", "gpt2", "mixtral", "qwen2_moe"])
def test_transformers_models_flops_match_the_counter(kind):
    model = _hf(kind)
    expected = ModelShape.from_module(model).flops_per_token(T) * B * T
    assert _measured(model, model.config.vocab_size, hf=True) == pytest.approx(expected,
                                                                               rel=1e-2)


def test_transformers_moe_counts_active_parameters_only():
    """Negative control: the same Mixtral counted with all its experts as active would be
    far from the counter (so the test above can tell)."""
    model = _hf("mixtral")
    shape = ModelShape.from_module(model)
    assert shape.active_params is not None and shape.active_params < shape.params
    every_expert = 6.0 * (shape.params - shape.first_params) + 12.0 * 2 * 128 * T
    assert _measured(model, 256, hf=True) < 0.9 * every_expert * B * T


def test_reference_moe_flops_match_the_counter():
    cfg = GPTConfig(vocab_size=256, max_seq_len=64, n_layer=2, d_model=64, n_head=4,
                    n_kv_head=2, d_ff=128, norm="rmsnorm", mlp="swiglu", pos="rope",
                    bias=False, tie_embeddings=False, n_experts=4, top_k=2,
                    capacity_factor=None)
    torch.manual_seed(0)
    model = GPT(cfg)
    expected = cfg.flops_per_token(T) * B * T
    assert ModelShape.from_module(model).flops_per_token(T) == cfg.flops_per_token(T)
    assert _measured(model, 256, hf=False) == pytest.approx(expected, rel=1e-2)


@pytest.mark.parametrize("name, mixed, tf32, key, peak", [
    ("NVIDIA H100 80GB HBM3", "bf16", False, "h100", 989e12),
    ("NVIDIA H100 80GB HBM3", "no", True, "h100", 494e12),
    ("NVIDIA H100 80GB HBM3", "no", False, "h100", 67e12),
    ("NVIDIA H100 PCIe", "bf16", False, "h100-pcie", 756e12),
    ("NVIDIA H100 NVL", "fp16", False, "h100-nvl", 835e12),
    ("NVIDIA H200", "bf16", False, "h200", 989e12),
    ("NVIDIA A100-SXM4-80GB", "bf16", False, "a100", 312e12),
    ("NVIDIA A100 80GB PCIe", "no", False, "a100", 19.5e12),
    ("NVIDIA L4", "bf16", False, "l4", 121e12),
    ("Tesla T4", "fp16", False, "t4", 65e12),
])
def test_device_peak_from_the_cuda_device_name(monkeypatch, name, mixed, tf32, key, peak):
    from meshfit.train.run import device_peak_flops

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    found, source = device_peak_flops(torch.device("cuda", 0), mixed, tf32=tf32)
    assert found == peak and source.startswith(f"{key} data sheet")


def test_unknown_cuda_device_has_no_peak(monkeypatch):
    from meshfit.train.run import device_peak_flops

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA L40S")
    assert device_peak_flops(torch.device("cuda", 0), "bf16") == (None, "")
