"""Tests for meshfit.models: exact parameter counts, forward semantics, init, pipeline slicing."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from meshfit.models import GPT, GPTConfig, count_params

# Published parameter counts (unique tensors, tied embedding once).
EXPECTED_PARAMS = {
    "gpt2": 124_439_808,  # GPT-2 small, as reported by HF `GPT2LMHeadModel.num_parameters()`
    "llama-1b": 1_100_048_384,  # TinyLlama-1.1B
    "llama-7b": 6_738_415_616,  # Llama-2-7B
    "llama-70b": 68_976_648_192,  # Llama-2-70B
}

# Small configs covering both families; `tiny` itself is GPT-2 style.
GPT2_SMALL = dict(n_layer=4, d_model=64, n_head=4, d_ff=128, max_seq_len=32)
LLAMA_SMALL = dict(
    GPT2_SMALL, norm="rmsnorm", mlp="swiglu", pos="rope", bias=False, tie_embeddings=False, n_kv_head=2
)
STYLES = {"gpt2-style": GPT2_SMALL, "llama-style": LLAMA_SMALL}


def small(style: str, **overrides) -> GPTConfig:
    return GPTConfig.preset("tiny", **{**STYLES[style], **overrides})


def state_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------- parameter counts
@pytest.mark.parametrize("name", GPTConfig.preset_names())
def test_preset_builds_on_meta_and_closed_form_matches(name):
    cfg = GPTConfig.preset(name)
    with torch.device("meta"):
        model = GPT(cfg)
    assert model.num_params() == cfg.num_params() == count_params(model)
    assert model.num_params(exclude_embeddings=True) == cfg.num_params(exclude_embeddings=True)
    if name in EXPECTED_PARAMS:
        assert cfg.num_params() == EXPECTED_PARAMS[name]


@pytest.mark.parametrize("style", STYLES)
def test_closed_form_matches_built_for_small_variants(style):
    for over in ({}, dict(bias=not STYLES[style].get("bias", True)), dict(tie_embeddings=True)):
        cfg = small(style, **over)
        with torch.device("meta"):
            model = GPT(cfg)
        assert model.num_params() == cfg.num_params(), over
        assert model.num_params(True) == cfg.num_params(True), over


def test_tiny_preset_size_and_style():
    cfg = GPTConfig.preset("tiny")
    assert 0.8e6 <= cfg.num_params() <= 1.2e6
    assert (cfg.vocab_size, cfg.pos, cfg.norm, cfg.mlp, cfg.bias, cfg.tie_embeddings) == (
        256, "learned", "layernorm", "gelu", True, True
    )


def test_tied_head_shares_tok_emb_and_rope_has_no_params():
    with torch.device("meta"):
        gpt2, llama = GPT(GPTConfig.preset("gpt2")), GPT(GPTConfig.preset("llama-1b"))
    assert gpt2.lm_head.weight is gpt2.tok_emb.weight
    assert llama.lm_head.weight is not llama.tok_emb.weight
    assert llama.pos_emb is None
    assert "rope_cos" not in llama.state_dict()  # non-persistent buffers


def test_flops_per_token_closed_form_and_measured():
    cfg = GPTConfig.preset("gpt2")
    # GPT-2 small, T=1024: 6 * (85.0M layers+norm + 38.6M head) + 12*12*768*1024.
    n_matmul = cfg.num_params(exclude_embeddings=True) + cfg.vocab_size * cfg.d_model
    assert cfg.flops_per_token(1024) == 6 * n_matmul + 12 * 12 * 768 * 1024

    cfg = small("llama-style")
    model, B, T = GPT(cfg), 2, 32
    idx = torch.randint(0, cfg.vocab_size, (B, T))
    # The math backend decomposes attention into bmm, which FlopCounterMode counts; the
    # fused CPU kernel is not counted at all.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(idx, idx).backward()
    expected = cfg.flops_per_token(T) * B * T
    # PaLM's N also counts norm gains, which do no matmul: 0.1% of N here, hence 1e-2.
    assert counter.get_total_flops() == pytest.approx(expected, rel=1e-2)
    with pytest.raises(ValueError, match="seq_len"):
        cfg.flops_per_token(0)


# ---------------------------------------------------------------- forward semantics
@pytest.mark.parametrize("style", STYLES)
def test_forward_shapes_and_initial_loss(style):
    torch.manual_seed(0)
    cfg = small(style)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (3, 16))
    targets = torch.randint(0, cfg.vocab_size, (3, 16))
    assert model(idx).shape == (3, 16, cfg.vocab_size)
    loss = model(idx, targets)
    assert loss.shape == ()
    # init_std=0.02 makes logits nearly uniform; random targets then give ~ln(V).
    assert loss.item() == pytest.approx(math.log(cfg.vocab_size), abs=0.1)


def test_too_long_sequence_is_rejected():
    model = GPT(small("gpt2-style"))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_gqa_equals_mha_with_repeated_kv_heads():
    torch.manual_seed(0)
    gqa = GPT(small("llama-style", n_kv_head=2))
    mha = GPT(small("llama-style", n_kv_head=None))
    state = gqa.state_dict()
    hd = gqa.config.head_dim
    for key, t in state.items():
        if key.endswith(("attn.wk.weight", "attn.wv.weight")):
            # kv head h serves query heads h*g..h*g+g-1: repeat each head's rows g times.
            state[key] = t.view(2, hd, -1).repeat_interleave(2, dim=0).reshape(-1, t.shape[1])
    mha.load_state_dict(state)
    idx = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(gqa(idx), mha(idx))


@pytest.mark.parametrize("style", STYLES)
def test_causal(style):
    torch.manual_seed(0)
    model = GPT(small(style)).eval()
    idx = torch.randint(0, 256, (2, 20))
    changed = idx.clone()
    changed[:, 12] = (changed[:, 12] + 1) % 256
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12])
    assert not torch.allclose(a[:, 12:], b[:, 12:])


@pytest.mark.parametrize("style", STYLES)
def test_pipeline_halves_compose_to_full_model(style):
    torch.manual_seed(0)
    full = GPT(small(style)).eval()
    first, second = copy.deepcopy(full), copy.deepcopy(full)
    for k in ("2", "3"):
        del first.layers[k]
    first.norm = first.lm_head = None
    for k in ("0", "1"):
        del second.layers[k]
    second.tok_emb = second.pos_emb = None
    idx = torch.randint(0, 256, (2, 16))
    targets = torch.randint(0, 256, (2, 16))
    hidden = first(idx)
    assert hidden.shape == (2, 16, full.config.d_model)
    # Same ops in the same order on the same values: bitwise equal, no tolerance needed.
    assert torch.equal(second(hidden), full(idx))
    assert torch.equal(second(hidden, targets), full(idx, targets))
    assert first.num_params() + second.num_params() >= full.num_params()


# ---------------------------------------------------------------- initialisation
def test_init_is_deterministic_in_process_and_across_processes():
    torch.manual_seed(1234)
    digest = state_digest(GPT(GPTConfig.preset("tiny")))
    torch.manual_seed(1234)
    assert state_digest(GPT(GPTConfig.preset("tiny"))) == digest
    torch.manual_seed(4321)
    assert state_digest(GPT(GPTConfig.preset("tiny"))) != digest
    code = (
        "import torch, sys; sys.path.insert(0, %r); from test_models import state_digest;"
        "from meshfit.models import GPT, GPTConfig;"
        "torch.manual_seed(1234); print(state_digest(GPT(GPTConfig.preset('tiny'))))"
    ) % str(Path(__file__).parent)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == digest


@pytest.mark.parametrize("style", STYLES)
def test_meta_then_materialise_and_stage_init_match_full(style):
    cfg = small(style)
    full = GPT(cfg)
    full.init_weights(torch.Generator().manual_seed(7))
    with torch.device("meta"):
        lazy = GPT(cfg)
    lazy.to_empty(device="cpu")
    lazy.init_weights(torch.Generator().manual_seed(7))
    assert state_digest(lazy) == state_digest(full)
    idx = torch.randint(0, 256, (1, 8))
    assert torch.equal(lazy(idx), full(idx))  # includes the recomputed RoPE cache
    # A stage holding only the last layer and head initialises to the full model's values.
    stage = copy.deepcopy(full)
    for k in ("0", "1", "2"):
        del stage.layers[k]
    stage.tok_emb = stage.pos_emb = None
    stage.init_weights(torch.Generator().manual_seed(7))
    full_state = full.state_dict()
    for key, t in stage.state_dict().items():
        assert torch.equal(t, full_state[key]), key


def test_init_values():
    cfg = small("gpt2-style", n_layer=8, d_model=256, d_ff=1024)
    model = GPT(cfg)
    block = model.layers["0"]
    assert torch.all(block.attn.wq.bias == 0) and torch.all(block.attn_norm.weight == 1)
    # Loose bounds: a 256x256 sample std is within ~1% of its true value.
    assert block.attn.wq.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert block.attn.wo.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)


# ---------------------------------------------------------------- config validation
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(d_model=100, n_head=12), r"GPTConfig\.n_head=12 must divide d_model=100"),
        (dict(n_head=4, n_kv_head=3), r"GPTConfig\.n_kv_head=3 must divide n_head=4"),
        (dict(n_layer=0), r"GPTConfig\.n_layer=0"),
        (dict(vocab_size=-1), r"GPTConfig\.vocab_size=-1"),
        (dict(d_ff=2.5), r"GPTConfig\.d_ff=2\.5"),
        (dict(dropout=1.0), r"GPTConfig\.dropout=1\.0"),
        (dict(norm="batchnorm"), r"GPTConfig\.norm='batchnorm'"),
        (dict(mlp="relu"), r"GPTConfig\.mlp='relu'"),
        (dict(pos="alibi"), r"GPTConfig\.pos='alibi'"),
        (dict(pos="rope", d_model=12, n_head=4), r"GPTConfig\.pos='rope' needs an even head_dim"),
        (dict(norm_eps=0.0), r"GPTConfig\.norm_eps=0\.0"),
        (dict(bias="yes"), r"GPTConfig\.bias='yes'"),
    ],
)
def test_config_validation_names_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kwargs)


def test_preset_lookup_errors_and_overrides():
    with pytest.raises(ValueError, match="valid names: .*'tiny'.*'llama-70b'"):
        GPTConfig.preset("gpt5")
    with pytest.raises(ValueError, match=r"unknown fields \['n_layers'\]"):
        GPTConfig.preset("tiny", n_layers=2)
    cfg = GPTConfig.preset("llama-7b", max_seq_len=128)
    assert cfg.max_seq_len == 128 and cfg.n_layer == 32
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.n_layer = 3


# ---------------------------------------------------------------- training
@pytest.mark.parametrize("style", STYLES)
def test_few_steps_lower_loss_on_repeating_sequence(style):
    torch.manual_seed(0)
    model = GPT(small(style))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    seq = torch.arange(8).repeat(4)[None]  # 0..7 repeated: fully predictable after one period
    idx, targets = seq[:, :-1], seq[:, 1:]
    first = model(idx, targets).item()
    for _ in range(20):
        opt.zero_grad()
        loss = model(idx, targets)
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first


def test_attention_backend_switch_matches_auto_and_fails_clearly():
    import dataclasses

    from meshfit.models.gpt import check_attention_backend

    base = GPTConfig.preset("tiny", max_seq_len=32)
    x = torch.randint(0, base.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    losses = {}
    for backend in ("auto", "math", "flash"):  # PyTorch has a CPU flash kernel
        torch.manual_seed(0)
        model = GPT(dataclasses.replace(base, attention_backend=backend))
        loss = model(x, x)
        loss.backward()
        losses[backend] = (loss.detach(), model.layers["0"].attn.wq.weight.grad.clone())
    for backend in ("math", "flash"):
        # Different kernels sum in different orders: fp32 rounding only.
        torch.testing.assert_close(losses[backend][0], losses["auto"][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(losses[backend][1], losses["auto"][1], rtol=1e-4, atol=1e-6)
    torch.manual_seed(0)
    cpu_only = GPT(dataclasses.replace(base, attention_backend="efficient"))
    with pytest.raises(RuntimeError, match="attention_backend='efficient' cannot run on cpu"):
        cpu_only(x, x)
    with pytest.raises(ValueError, match="attention_backend='cudnn' is not available on cpu"):
        check_attention_backend("cudnn", "cpu", torch.float32)
    with pytest.raises(ValueError, match="GPTConfig.attention_backend='fast'"):
        dataclasses.replace(base, attention_backend="fast")
