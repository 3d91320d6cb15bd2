"""Tensor parallel (tp=2, gloo, CPU) against a single-process reference.

Every rank builds the full model from one seed, keeps a deep copy as the single-process
reference, applies TP to the other and trains both for 5 AdamW steps on the same batch.

Tolerances: models and losses run in float64 (the reference GPT's own `model(idx, targets)`
loss keeps a float64 model's dtype). TP changes only the order of summation (matmuls split
over ranks, then all-reduce / reduce-scatter), ~1e-16 relative per op (bound in
tests/reference.py). Measured over 5 seeds: losses <= 6e-16 relative apart over 5 steps,
first-step gradients <= 2.2e-16 apart, gradient norms <= 4e-16 relative. So losses and norms
must agree to rtol 1e-9 and first-step gradients to atol 1e-10 (no Adam step between them):
loose enough for summation order, tight enough that any layout mistake (a wrong q/k/v split,
a missing all-reduce, a doubled tied gradient) fails by orders of magnitude (a plain column
split of GPT-2's fused c_attn gives loss gaps of 5e-3 and gradient gaps of 0.1).
"""

from __future__ import annotations

import copy
import importlib.util
import math

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from conftest import case_result, run_cases, selected
from reference import MODELS, token_batches
from tp_families import ATOL as FAMILY_ATOL
from tp_families import (F32_ATOL, F32_LOSS_RTOL, FLOAT32, families_tp, lora_families_tp,
                         phimoe_tp)
from tp_families import RTOL as FAMILY_LOSS_RTOL
from tp_families import T as FAMILY_T
from tp_families import VOCAB as FAMILY_VOCAB
from meshfit.models import GPT, GPTConfig
from meshfit.models.families import MOE_FAMILIES
from meshfit.models.plans import gpt_plan
from meshfit.models.plans.regroup import unfuse_columns
from meshfit.parallel.tp import apply_tp, tp_cross_entropy

STEPS, B, T, VOCAB = 5, 2, 16, 256
LOSS_RTOL, GRAD_ATOL = 1e-9, 1e-10  # fp64, summation order only (see module docstring)
COMBOS = [(False, False), (False, True), (True, False), (True, True)]  # (sp, loss_parallel)

GPT_VARIANTS = {
    "gelu-learned-tied": dict(mlp="gelu", pos="learned", norm="layernorm", bias=True,
                              tie_embeddings=True),
    "swiglu-rope-gqa": dict(mlp="swiglu", pos="rope", norm="rmsnorm", bias=False,
                            tie_embeddings=False, n_kv_head=2),
}


def _mesh():
    return init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))


def _batch():
    x, y = token_batches(B, T, VOCAB, seed=1)
    y[0, 3] = -100  # an ignored target: every loss path must skip it alike
    return x, y


def _build(kind: str, variant: str | None = None) -> torch.nn.Module:
    # fp64 test-size models from reference.py (2 blocks, width 64, 4 heads).
    if kind == "gpt":
        return MODELS["gpt"](**GPT_VARIANTS[variant])
    return MODELS[kind]()


def _loss(model, x, y, lp: bool):
    if isinstance(model, GPT):
        # The model's own loss (float32 cross-entropy); under loss_parallel apply_tp routes it
        # to tp_cross_entropy (float64 here), so the reference uses that too.
        tp = isinstance(model.norm.weight, DTensor)
        return tp_cross_entropy(model(x), y) if lp and not tp else model(x, y)
    if lp:  # HF labels= needs full logits; the vocabulary-parallel loss is called directly
        return tp_cross_entropy(model(input_ids=x).logits, y)
    return model(input_ids=x, labels=y).loss


def _train(model, x, y, lp: bool):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, grads, norm = [], None, None
    for step in range(STEPS):
        loss = _loss(model, x, y, lp)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
                     for n, p in model.named_parameters()}
            # One mesh for all parameters, so torch's clip works as is (no clipping at 1e9).
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
            norm = (norm.full_tensor() if isinstance(norm, DTensor) else norm).item()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads, norm


def _compare(rank, world_size, kind, variant, combos):
    """Worker: for each (sp, loss_parallel), train reference and TP copies; report gaps."""
    mesh, (x, y), out = _mesh(), _batch(), []
    for sp, lp in combos:
        model = _build(kind, variant)
        ref = copy.deepcopy(model)
        apply_tp(model, mesh, sequence_parallel=sp, loss_parallel=lp)
        assert all(isinstance(p, DTensor) for p in model.parameters())
        extra = {}
        if lp:  # logits stay sharded on the vocabulary: never gathered
            with torch.no_grad():
                logits = model(x) if kind == "gpt" else model(input_ids=x).logits
            extra["logits"] = (logits.placements, tuple(logits.to_local().shape))
            if kind != "gpt":
                try:
                    model(input_ids=x, labels=y)
                except ValueError as err:
                    extra["labels_error"] = str(err)
        ref_losses, ref_grads, ref_norm = _train(ref, x, y, lp)
        tp_losses, tp_grads, tp_norm = _train(model, x, y, lp)
        gaps = {}
        for name, g in tp_grads.items():
            if kind == "gpt2" and name.rpartition(".")[0].endswith("attn.c_attn"):
                g = unfuse_columns(g, 3, world_size)  # head-grouped layout -> HF layout
            gaps[name] = (g - ref_grads[name]).abs().max().item()
        out.append(dict(sp=sp, lp=lp, ref=ref_losses, tp=tp_losses, grad_gaps=gaps,
                        n_params=len(ref_grads), tied=_tied(model), norms=(ref_norm, tp_norm),
                        **extra))
    return out


def _tied(model) -> bool:
    head = model.get_submodule("lm_head").weight
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") \
        else model.tok_emb
    return head is emb.weight


def _check(results, kind: str, expect_tied: bool):
    for r in results[0]:
        label = f"sp={r['sp']} loss_parallel={r['lp']}"
        assert r["tied"] is expect_tied, label
        assert len(r["grad_gaps"]) == r["n_params"], label
        for ref, tp in zip(r["ref"], r["tp"]):
            assert math.isclose(ref, tp, rel_tol=LOSS_RTOL), (label, r["ref"], r["tp"])
        worst = max(r["grad_gaps"], key=r["grad_gaps"].get)
        assert r["grad_gaps"][worst] < GRAD_ATOL, (label, worst, r["grad_gaps"][worst])
        assert math.isclose(*r["norms"], rel_tol=LOSS_RTOL), (label, r["norms"])
        assert r["ref"][-1] < r["ref"][0], label  # it trained
        if r["lp"]:
            assert r["logits"] == ((Shard(2),), (B, T, VOCAB // 2)), label
            if kind != "gpt":
                assert "tp_cross_entropy(logits[:, :-1], labels[:, 1:])" in r["labels_error"]
    # Both ranks saw the same losses.
    assert [r["tp"] for r in results[0]] == [r["tp"] for r in results[1]]


# Every comparison on 2 ranks, in one spawn: name -> (kind, GPT variant, (sp, lp) combos,
# tied embedding and head expected).
CASES = {
    **{f"gpt-{variant}": ("gpt", variant, COMBOS, kw["tie_embeddings"])
       for variant, kw in GPT_VARIANTS.items()},
    "llama": ("llama", None, [(False, False), (True, True)], False),
    # Fused c_attn re-laid out head-grouped; wte/lm_head stay one tied tensor.
    "gpt2": ("gpt2", None, [(False, True), (True, False)], True),
}
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
# Every transformers family of meshfit.models.families under tp=2 + sequence + loss parallel
# with meshfit's general plan (read from the model's own transformers plan); without them,
# the families whose plan takes a path of its own there (per-head norms, gathered fused
# projections, a replicated attention, a parallel residual).
FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "mixtral", "gemma2",
            "gemma3_text", "phi3", "olmo2", "gpt_neox", "granite", "smollm3", "glm4_moe",
            "deepseek_v3", "qwen2_moe")
PLAIN_FAMILIES = ("qwen3", "phi3", "olmo2", "gpt_neox", "deepseek_v3")

@pytest.fixture(scope="module")
def tp2(request, tmp_path_factory):
    names = [n for n in selected(request, "case", list(CASES))
             if HAS_TRANSFORMERS or CASES[n][0] == "gpt"]
    cases = {n: (_compare, *CASES[n][:3]) for n in names}
    cases["bad-input"] = (_bad_inputs,)  # well under a second
    cases["lora"] = (_lora_grads,)
    if HAS_TRANSFORMERS:  # the family matrix (tests/parallel/tp_families.py): ~30 s
        cases["families"] = (families_tp, list(FAMILIES), True, True,
                              str(tmp_path_factory.mktemp("tp-families")))
        cases["families-plain"] = (families_tp, list(PLAIN_FAMILIES), False, False)
        cases["lora-families"] = (lora_families_tp, list(FAMILIES))
        cases["phimoe"] = (phimoe_tp,)
    return run_cases(cases, 2, timeout=420)


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_matches_single_process(tp2, case):
    kind, _, _, tied = CASES[case]
    if kind != "gpt":
        pytest.importorskip("transformers")
    _check(case_result(tp2, case), kind, expect_tied=tied)


def _family_check(r: dict, family: str) -> None:
    loss_rtol, atol = (F32_LOSS_RTOL, F32_ATOL) if family in FLOAT32 else \
        (FAMILY_LOSS_RTOL, FAMILY_ATOL)
    for ref, tp in zip(r["ref"], r["tp"], strict=True):
        assert math.isclose(ref, tp, rel_tol=loss_rtol), (family, r["ref"], r["tp"])
    name, gap, n = r["worst"]
    assert gap < atol, (family, name, gap)
    assert r["ref"][-1] < r["ref"][0], family  # it trained


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_under_tp2_sp_lp_matches_one_process(tp2, family):
    """fp64 tiny model of each family, tp=2 with sequence and loss parallel, the general
    plan: 3 AdamW steps give one process's losses and final weights (all of them)."""
    pytest.importorskip("transformers")
    results = case_result(tp2, "families")
    _family_check(results[0][family], family)
    assert results[0][family]["tp"] == results[1][family]["tp"]  # both ranks alike


@pytest.mark.parametrize("family", PLAIN_FAMILIES)
def test_families_under_plain_tp2_match_one_process(tp2, family):
    pytest.importorskip("transformers")
    _family_check(case_result(tp2, "families-plain")[0][family], family)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_tp_trained_family_exports_a_folder_from_pretrained_loads(tp2, family):
    """Each family trained under tp=2 + SP + LP, gathered and written by
    `save_model_folder` (what `meshfit train` writes): `from_pretrained` gives back a model
    with the trained model's logits (export only gathers; the two differ by tensor
    parallel's split sums, ~1e-16, where a fused projection left in tp's layout or a
    weight not gathered moves them by > 1e-3)."""
    import transformers

    per_rank = case_result(tp2, "families")
    folder = per_rank[0][family]["folder"]
    # A mixture of experts in float64 needs transformers' eager experts loop (its grouped
    # kernel takes float32 and narrower), as meshfit.models.families.tiny_model builds it.
    extra = {"experts_implementation": "eager"} if family in MOE_FAMILIES else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64,
                                                              **extra)
    probe = token_batches(2, FAMILY_T, FAMILY_VOCAB, seed=5)[0]
    with torch.no_grad():
        logits = model(input_ids=probe).logits
    atol = F32_ATOL if family in FLOAT32 else FAMILY_ATOL
    for rank in range(2):  # every rank computed the loaded model's logits
        gap = (per_rank[rank][family]["logits"] - logits).abs().max().item()
        assert gap < atol, (family, rank, gap)


def test_a_router_that_is_a_linear_subclass_stays_whole(tp2):
    """PhiMoE's router subclasses nn.Linear but routes (its forward returns a tuple): the
    general plan keeps it whole like any router, and tp=2 + SP + LP trains like one process
    (it failed after launch: 'tuple' object has no attribute 'redistribute')."""
    pytest.importorskip("transformers")
    _family_check(case_result(tp2, "phimoe")[0], "phimoe")


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_under_tp_trains_like_one_process_for_every_family(tp2, family):
    """LoRA (every linear inside the blocks: fused projections, per-head q/k norms between
    split projections, MoE shared experts and their gate, DeepSeek's replicated latent
    attention) under tp=2 + SP: the adapters train as in one process (losses, final adapter
    and base weights)."""
    r = case_result(tp2, "lora-families")[0][family]
    assert r["adapted"] > 0 and r["adapters"] == 2 * r["adapted"], r  # A and B per layer
    _family_check(r, family)


def _lora_grads(rank, world_size):
    """LoRA (peft) on the fp64 GPT, every block linear adapted, B drawn non-zero so that A's
    gradient is too: under tp=2 (with and without sequence parallel) the loss and every
    adapter gradient, gathered, against the same model in one process; the base stays
    frozen (no gradient)."""
    from meshfit.peft import lora

    torch.manual_seed(0)
    ref = lora(MODELS["gpt"](**GPT_VARIANTS["swiglu-rope-gqa"]), r=2)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)
    out = []
    for sp in (False, True):
        model = copy.deepcopy(ref)
        apply_tp(model, _mesh(), sequence_parallel=sp)
        x, y = _batch()
        ref.zero_grad()
        loss_ref = ref(x, y)
        loss_ref.backward()
        loss = model(x, y)
        loss.backward()
        grads = {}
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            if not q.requires_grad:
                assert p.grad is None, name
                continue
            got = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            grads[name] = float((got - q.grad).abs().max() / q.grad.abs().max())
        out.append({"sp": sp, "loss": (float(loss), float(loss_ref)), "grads": grads})
    return out


def test_lora_under_tp_has_the_single_process_gradients(tp2):
    """Each adapted linear's adapters laid out to match it (`meshfit.models.plans.lora_plan`):
    column-parallel base -> A whole, B column-parallel; row-parallel base -> A row-parallel, B
    whole. fp64: the same loss and adapter gradients as one process (summation order only)."""
    for r in case_result(tp2, "lora")[0]:
        assert math.isclose(*r["loss"], rel_tol=LOSS_RTOL), r
        assert len(r["grads"]) == 2 * 2 * 7  # 2 blocks x (wq wk wv wo w1 w2 w3) x (A, B)
        worst = max(r["grads"].values())
        assert worst < 1e-9, (r["sp"], sorted(r["grads"].items(), key=lambda kv: -kv[1])[:3])


# ---------------------------------------------------------------------------- bad input
def _small(**kw) -> GPT:
    # Not reference.tiny_gpt: the refusals need shapes it fixes (vocab_size=257 among them);
    # only the error matters here, not the weights.
    torch.manual_seed(0)
    return GPT(GPTConfig(**{"n_layer": 1, "d_model": 32, "n_head": 4, "d_ff": 64, **kw}))


def _raises(model, mesh, **kw) -> str:
    before = dict(model.named_parameters())
    try:
        apply_tp(model, mesh, **kw)
    except ValueError as err:
        # Untouched: the same Parameter objects, none a DTensor.
        assert all(p is before[n] for n, p in model.named_parameters())
        return str(err)
    return "no error"


def _bad_inputs(rank, world_size):
    from torch.distributed.tensor.parallel import ColwiseParallel

    mesh, errors = _mesh(), {}
    errors["heads"] = _raises(_small(n_head=3, d_model=48), mesh)
    errors["vocab"] = _raises(_small(vocab_size=257), mesh)
    full = gpt_plan(_small()).styles
    errors["tied"] = _raises(_small(), mesh, plan={**full, "tok_emb": ColwiseParallel()})
    errors["typo"] = _raises(_small(), mesh, plan={**full, "layers.*.atn.wq": ColwiseParallel()})
    errors["plain"] = _raises(_small(), mesh, plan={k: v for k, v in full.items() if k != "norm"})
    dropout, dropout_sp = _small(dropout=0.1), _small(dropout=0.1)
    torch.manual_seed(rank)  # a different RNG stream per rank
    errors["rng"] = _raises(dropout, mesh)
    apply_tp(dropout_sp, mesh, sequence_parallel=True)  # SP: dropout on shards, fine
    dropout_sp(*_batch()).backward()
    model = apply_tp(_small(), mesh, sequence_parallel=True)
    try:
        model(torch.zeros(1, 15, dtype=torch.long))
    except ValueError as err:
        errors["seq"] = str(err)
    return errors


def test_bad_input_raises_before_touching_the_model(tp2):
    errors = case_result(tp2, "bad-input")[0]
    assert all("\n" not in e for e in errors.values()), errors
    assert "GPTConfig.n_head=3 does not divide by tp=2" in errors["heads"]
    assert "GPTConfig.vocab_size=257 does not divide by tp=2; pad it to 258 " \
           "(or 320 for tensor cores)" in errors["vocab"]
    assert "lm_head.weight and tok_emb.weight are one tied tensor" in errors["tied"] or \
        "tok_emb.weight and lm_head.weight are one tied tensor" in errors["tied"]
    assert "'layers.*.atn.wq' matches no module" in errors["typo"]
    assert "leaves 2 parameters as plain tensors (norm.weight, norm.bias)" in errors["plain"]
    assert "same RNG state on every TP rank" in errors["rng"]
    assert "sequence length 15 does not divide by tp=2" in errors["seq"] and "16" in errors["seq"]


def test_divisibility_advice_without_a_mesh():
    cfg = GPTConfig.preset("gpt2")
    plan = gpt_plan(GPT(GPTConfig.preset("tiny")))  # built on CPU: tiny is cheap
    with pytest.raises(ValueError, match=r"GPTConfig.n_head=4 does not divide by tp=3 .*tp in "
                                         r"\[2, 4\]"):
        plan.check_divisible(3)
    plan.check_divisible(2)
    big = torch.device("meta")
    with big:
        gpt2 = GPT(cfg)
    with pytest.raises(ValueError, match=r"vocab_size=50257 does not divide by tp=2; pad it to "
                                         r"50258 \(or 50304 for tensor cores\)"):
        gpt_plan(gpt2).check_divisible(2)
