"""Tests for the reference mixture of experts (meshfit.models.moe) and its place in GPT."""

from __future__ import annotations

import hashlib
import math

import pytest
import torch
import torch.nn.functional as F

from meshfit.models import GPT, GPTConfig, MoE, count_params

MIXTRAL_PARAMS = 46_702_792_704
MIXTRAL_ACTIVE = 12_879_925_248

# Dense digests recorded at HEAD a40033e, before MoE existed (torch 2.13 CPU RNG).
DENSE_TINY_DIGEST = "549db67d8230c5a028c497dfdfaffa73bcc7d2eda9f495d1f26b7e50cd47b9f8"
DENSE_LLAMA_DIGEST = "30ca026fb6cf347684fe00c3d5d1c0b6184a45834ee78bd87a7dd325d180ac0a"
DENSE_LLAMA_LOSS = 5.547316074371338
LLAMA_SMALL = dict(norm="rmsnorm", mlp="swiglu", pos="rope", bias=False, tie_embeddings=False,
                   n_kv_head=2, n_layer=2, d_model=64, d_ff=128, max_seq_len=32)


def state_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def moe_cfg(**kw) -> GPTConfig:
    base = dict(vocab_size=64, n_layer=2, n_head=2, d_model=16, d_ff=24, max_seq_len=32,
                n_experts=4, top_k=2)
    return GPTConfig(**{**base, **kw})


# ---------------------------------------------------------------- counts
def test_mixtral_counts_on_meta():
    cfg = GPTConfig.preset("mixtral-8x7b")
    assert cfg.num_params() == MIXTRAL_PARAMS
    assert cfg.num_active_params() == MIXTRAL_ACTIVE
    with torch.device("meta"):
        model = GPT(cfg)
    assert model.num_params() == count_params(model) == MIXTRAL_PARAMS
    # flops use active parameters (untied head: excluding embeddings keeps lm_head).
    T = 4096
    assert cfg.flops_per_token(T) == 6 * cfg.num_active_params(exclude_embeddings=True) + 12 * 32 * 4096 * T


def active_from_model(model: GPT) -> int:
    n = model.num_params()
    for m in model.moe_layers().values():
        for name in ("w1", "w2", "w3", "w_in", "w_out"):
            if hasattr(m.experts, name):
                p = getattr(m.experts, name)
                n -= p.numel() // m.n_experts * (m.n_experts - m.top_k)
    return n


@pytest.mark.parametrize("kw", [
    {"preset": "moe-tiny"},
    dict(mlp="gelu", bias=True, shared_experts=1, moe_every=2, n_layer=4, moe_d_ff=8),
    dict(mlp="swiglu", bias=False, shared_experts=1, tie_embeddings=False, top_k=1),
    dict(mlp="swiglu", bias=True, moe_every=3, n_layer=5, router="sigmoid_topk"),
])
def test_counts_match_built_model(kw):
    cfg = GPTConfig.preset("moe-tiny") if "preset" in kw else moe_cfg(**kw)
    with torch.device("meta"):
        model = GPT(cfg)
    assert model.num_params() == cfg.num_params() == count_params(model)
    assert model.num_params(exclude_embeddings=True) == cfg.num_params(exclude_embeddings=True)
    assert cfg.num_active_params() == active_from_model(model) < cfg.num_params()
    assert len(model.moe_layers()) == cfg.n_moe_layers
    assert [n for n in model.moe_layers()] == [str(i) for i in range(cfg.n_layer)
                                               if (i + 1) % cfg.moe_every == 0]


# ---------------------------------------------------------------- dense model unchanged
def test_dense_default_unchanged():
    assert GPTConfig(n_experts=0) == GPTConfig()
    cfg = GPTConfig.preset("tiny")
    assert cfg.num_active_params() == cfg.num_params()
    torch.manual_seed(0)
    assert state_digest(GPT(cfg)) == DENSE_TINY_DIGEST
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", **LLAMA_SMALL))
    assert state_digest(model) == DENSE_LLAMA_DIGEST
    torch.manual_seed(1)
    idx = torch.randint(0, 256, (2, 16))
    assert model(idx, idx).item() == DENSE_LLAMA_LOSS
    assert model.moe_stats() == {} and model.aux_loss() is None


# ---------------------------------------------------------------- naive reference
def make_moe(cfg: GPTConfig, seed: int = 0) -> MoE:
    moe = MoE(cfg).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)
    moe.experts.use_grouped_mm = False
    return moe


def naive(moe: MoE, cfg: GPTConfig, x: torch.Tensor, keep=None):
    """Per-token loop over that token's top-k experts, plus the aux losses by formula.
    `keep(token, expert)` -> bool says whether an assignment survives capacity."""
    E, k = cfg.n_experts, cfg.top_k
    Wr = moe.router.weight
    outs, probs_all, chosen_all, lse = [], [], [], []
    for n in range(x.shape[0]):
        xn = x[n]
        logits = Wr @ xn
        lse.append(torch.logsumexp(logits, 0))
        if cfg.router == "softmax_topk":
            p = torch.exp(logits - logits.max())
            p = p / p.sum()
            probs_all.append(p)
            scores = p
        else:
            scores = 1 / (1 + torch.exp(-logits))
            probs_all.append(scores / scores.sum())
        chosen = sorted(range(E), key=lambda e: -float(scores[e].detach()))[:k]
        chosen_all.extend(chosen)
        denom = sum(scores[e] for e in chosen)
        y = torch.zeros_like(xn)
        for e in chosen:
            if keep is not None and not keep(n, e):
                continue
            if cfg.mlp == "swiglu":
                h = F.silu(xn @ moe.experts.w1[e]) * (xn @ moe.experts.w3[e])
                out = h @ moe.experts.w2[e]
            else:
                out = F.gelu(xn @ moe.experts.w_in[e], approximate="tanh") @ moe.experts.w_out[e]
            y = y + scores[e] / denom * out
        if moe.shared is not None:
            s = moe.shared
            if cfg.mlp == "swiglu":
                y = y + s.w2(F.silu(s.w1(xn)) * s.w3(xn))
            else:
                y = y + s.w_out(F.gelu(s.w_in(xn), approximate="tanh"))
        outs.append(y)
    P = torch.stack(probs_all).mean(0)
    f = torch.tensor([chosen_all.count(e) / (x.shape[0] * k) for e in range(E)], dtype=x.dtype)
    aux = cfg.aux_loss_coef * E * (f * P).sum() + cfg.router_z_loss_coef * torch.stack(lse).square().mean()
    return torch.stack(outs), aux


CASES = [(r, s, m) for r in ("softmax_topk", "sigmoid_topk") for s in (0, 1) for m in ("swiglu", "gelu")]


@pytest.mark.parametrize("router,shared,mlp", CASES)
def test_forward_and_grads_match_naive(router, shared, mlp):
    cfg = moe_cfg(router=router, shared_experts=shared, mlp=mlp, n_experts=5, top_k=2,
                  aux_loss_coef=0.3, router_z_loss_coef=0.05)
    moe = make_moe(cfg)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 7, cfg.d_model, generator=g, dtype=torch.float64, requires_grad=True)
    R = torch.randn(2, 7, cfg.d_model, generator=g, dtype=torch.float64)
    y = moe(x)
    y_ref, aux_ref = naive(moe, cfg, x.reshape(-1, cfg.d_model))
    torch.testing.assert_close(y.reshape(-1, cfg.d_model), y_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(moe.last_aux_loss, aux_ref, rtol=0, atol=1e-12)

    params = [x, *moe.parameters()]
    g_moe = torch.autograd.grad((y * R).sum() + moe.last_aux_loss, params)
    g_ref = torch.autograd.grad((y_ref * R.reshape(-1, cfg.d_model)).sum() + aux_ref, params)
    for (name, _), a, b in zip([("x", x), *moe.named_parameters()], g_moe, g_ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=name)
    assert moe.router.weight.grad is None  # autograd.grad leaves .grad alone
    assert g_moe[1 + [n for n, _ in moe.named_parameters()].index("router.weight")].abs().sum() > 0


def test_aux_loss_formula_and_stats():
    cfg = moe_cfg(n_experts=4, top_k=2)
    moe = make_moe(cfg, seed=3)
    x = torch.randn(10, cfg.d_model, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    moe(x)
    logits = x @ moe.router.weight.T
    probs = logits.softmax(-1)
    idx = probs.topk(2, dim=-1).indices
    f = torch.bincount(idx.flatten(), minlength=4).double() / 20
    expect = 0.01 * 4 * (f * probs.mean(0)).sum() + 0.001 * torch.logsumexp(logits, -1).square().mean()
    torch.testing.assert_close(moe.last_aux_loss, expect, rtol=0, atol=1e-14)
    assert moe.last_stats["tokens_per_expert"].tolist() == (f * 20).long().tolist()
    assert moe.last_stats["dropped"] == 0


# ---------------------------------------------------------------- capacity
@pytest.mark.parametrize("cf,cap", [(1.0, 4), (1.5, 6), (0.3, 2)])
def test_capacity_drops_expected_assignments(cf, cap):
    # 8 tokens, top-2 of 4 experts; every token prefers expert 0 then 1, so each of those
    # two gets 8 assignments and keeps the first cap = ceil(cf * 8 * 2 / 4) tokens.
    assert cap == math.ceil(cf * 8 * 2 / 4)
    cfg = moe_cfg(n_experts=4, top_k=2, capacity_factor=cf)
    moe = make_moe(cfg)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[:, 0] = torch.tensor([3.0, 2.0, 1.0, 0.0], dtype=torch.float64)
    x = torch.randn(8, cfg.d_model, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x[:, 0] = 1.0
    y = moe(x)
    y_ref, _ = naive(moe, cfg, x, keep=lambda n, e: n < cap)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-12)
    assert (y[cap:] == 0).all() and (y[:cap] != 0).any()
    dropped = 2 * (8 - cap)
    assert moe.last_stats["dropped"] == dropped
    assert moe.last_stats["tokens_per_expert"].tolist() == [8, 8, 0, 0]  # before drops
    # and through the model's aggregate
    model = GPT(GPTConfig.preset("moe-tiny", capacity_factor=cf, n_layer=1))
    model.layers["0"].mlp = moe
    model.layers["0"].mlp.last_stats = moe.last_stats
    assert model.moe_stats()["dropped_fraction"] == dropped / 16


# ---------------------------------------------------------------- in the model
def test_gpt_loss_includes_aux_and_stats():
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("moe-tiny"))
    idx = torch.randint(0, 256, (2, 32))
    loss = model(idx, idx)
    ce = F.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
    aux = sum(m.last_aux_loss for m in model.moe_layers().values())
    torch.testing.assert_close(loss, ce + aux)
    st = model.moe_stats()
    assert st["layers"] == 4 and st["dropped_fraction"] == 0.0
    assert 0 <= st["tokens_per_expert_min"] <= st["tokens_per_expert_max"] <= 64
    assert st["tokens_per_expert_cv"] >= 0 and st["aux_loss"] > 0


def test_moe_tiny_trains():
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("moe-tiny"))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    idx = torch.randint(0, 256, (2, 33))
    losses = []
    for _ in range(20):
        loss = model(idx[:, :-1], idx[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses
    assert all(p.grad is not None for n, p in model.named_parameters() if "router" in n)


def test_init_deterministic_per_name():
    cfg = GPTConfig.preset("moe-tiny", shared_experts=1)
    full = GPT(cfg)
    full.init_weights(torch.Generator().manual_seed(5))
    stage = GPT(cfg)
    del stage.layers["0"]
    stage.tok_emb = None
    stage.init_weights(torch.Generator().manual_seed(5))
    sd = full.state_dict()
    for name, t in stage.state_dict().items():
        assert torch.equal(t, sd[name]), name
    m = full.layers["1"].mlp
    std = cfg.init_std / math.sqrt(2 * cfg.n_layer)
    assert abs(m.experts.w2.std().item() - std) < 0.1 * std
    assert abs(m.experts.w1.std().item() - cfg.init_std) < 0.1 * cfg.init_std


def test_kv_cache_path_with_moe():
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("moe-tiny", max_seq_len=32)).eval()
    idx = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        full = model(idx)
        cache = model.new_cache(2)
        parts = [model.forward_cached(idx[:, :5], cache)]
        parts += [model.forward_cached(idx[:, t:t + 1], cache) for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize("field,kw", [
    ("top_k", dict(n_experts=4, top_k=5)),
    ("capacity_factor", dict(n_experts=4, capacity_factor=0.0)),
    ("capacity_factor", dict(n_experts=4, capacity_factor=-1.0)),
    ("moe_every", dict(n_experts=4, moe_every=0)),
    ("moe_every", dict(n_experts=4, moe_every=3, n_layer=2)),
    ("n_experts", dict(n_experts=-1)),
    ("shared_experts", dict(n_experts=4, shared_experts=2)),
    ("router", dict(n_experts=4, router="expert_choice")),
    ("moe_d_ff", dict(n_experts=4, moe_d_ff=0)),
    ("aux_loss_coef", dict(n_experts=4, aux_loss_coef=-0.1)),
    ("router_z_loss_coef", dict(n_experts=4, router_z_loss_coef=float("nan"))),
    ("top_k", dict(n_experts=4, top_k=0)),
])
def test_invalid_configs(field, kw):
    with pytest.raises(ValueError, match=rf"GPTConfig\.{field}=") as err:
        GPTConfig(**{"n_layer": 2, **kw})
    assert "\n" not in str(err.value)
