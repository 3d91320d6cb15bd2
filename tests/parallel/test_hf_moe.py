"""Hugging Face mixture-of-experts decoders, `MixtralForCausalLM` and `Qwen2MoeForCausalLM`
(transformers 5: fused experts ``mlp.experts.gate_up_proj`` [E, 2F, d] / ``down_proj``
[E, d, F], a top-k router ``mlp.gate``; Qwen2-MoE adds a gated shared expert and q/k/v biases,
and its second layer here is dense, as ``mlp_only_layers`` makes it),
under every layout without expert parallelism, on 2 gloo ranks: DDP, ZeRO-3 (FSDP2), tensor
parallel tp=2 with and without sequence parallel (attention and the shared expert split,
router and routed experts whole on both ranks), pipeline parallel pp=2 (1f1b).

Each case trains 2 AdamW steps from the same fp64 weights on the same global batches and must
give the one-process run's losses and parameters (`reference_train` below), in one spawn for
all cases (conftest.run_cases). The loss is meshfit train's (`meshfit.train.models.
loss_function`): with ``output_router_logits=True`` in the config it adds
``router_aux_loss_coef`` x the model's load-balancing loss, whose statistics (tokens per
expert, mean router probabilities) meshfit takes over every rank that sees distinct tokens
(`meshfit.parallel.ep_hf.global_aux_loss_hook`, installed by `prepare`), accumulated in
float64:
- DDP: over both ranks' halves of the step's batch, so the reference is the plain
  one-process step on the whole batch (before: each rank's own half, which the reference
  had to imitate; the load-balancing loss of a batch is not the mean of its halves');
- tp2 / tp2-sp: the whole batch on every rank (the router sees the replicated hidden
  states): the plain one-process step;
- pp2: the model's config asks for the aux loss, but a pipeline's loss is the last stage's
  cross-entropy: the run equals the cross-entropy-only reference (and `meshfit train`
  refuses that combination before launch, tested below);
- ZeRO-3 runs the cross-entropy alone.

Tolerances as in tests/reference.py: fp64, 2 steps at lr 3e-3, losses rtol 1e-10 and
parameters atol 1e-10 (worst case S lr dg / eps = 6e-11). The routers compute their softmax
in float32 (HF's code), which rounds a router probability to the same float32 value in every
layout unless a 1e-16 difference straddles a float32 rounding boundary (odds ~1e-9 per value).
Measured when this file was written (largest over the cases): losses 1.6e-16 relative,
parameters 4.9e-15. Against the wrong reference the same runs miss by far more: the aux loss
left out (or, for pp2, added) 1e-2 in the parameters and 4e-2 in the losses; the DDP
reference with the aux loss per half instead of over the whole batch, 1.1e-2 and 4.7e-5.
"""

from __future__ import annotations

import pytest
import torch

from conftest import case_result, run_cases, selected
from reference import VOCAB, step_batches, token_batches

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS, GLOBAL, T, LR = 2, 4, 16, 3e-3  # optimizer steps, sequences per step, length, AdamW lr
RTOL = ATOL = 1e-10
AUX_COEF = 0.02  # Mixtral's released value; HF's default (0.001) would hide a missing term


def _config(family: str, *, aux: bool, dtype=torch.float64):
    import transformers

    common = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=32,
                  num_experts_per_tok=2, output_router_logits=aux,
                  router_aux_loss_coef=AUX_COEF)
    if dtype == torch.float64:
        # The default "grouped_mm" experts kernel takes float32/bfloat16 only.
        common["experts_implementation"] = "eager"
    if family == "mixtral":
        return transformers.MixtralConfig(intermediate_size=64, num_local_experts=4, **common)
    # Layer 1 dense (mlp_only_layers): a model mixing MoE and Llama-like layers.
    return transformers.Qwen2MoeConfig(intermediate_size=64, moe_intermediate_size=32,
                                       shared_expert_intermediate_size=64, num_experts=4,
                                       mlp_only_layers=[1], **common)


def _build(family: str, *, aux: bool, seed: int = 0) -> torch.nn.Module:
    import transformers

    cls = {"mixtral": transformers.MixtralForCausalLM,
           "qwen2moe": transformers.Qwen2MoeForCausalLM}[family]
    torch.manual_seed(seed)
    return cls(_config(family, aux=aux)).to(torch.float64).train()


PIPE = dict(schedule="1f1b", microbatches=2)
LAYOUTS = {
    # name: (ParallelDims kwargs, Accelerator options, prepare_pipeline kwargs, aux loss)
    "ddp": (dict(dp_replicate=2), {}, None, True),
    "zero3": (dict(dp_shard=2, dp_replicate=1), dict(zero_stage=3), None, False),
    "tp2": (dict(tp=2, dp_replicate=1), {}, None, True),
    "tp2-sp": (dict(tp=2, dp_replicate=1), dict(sequence_parallel=True), None, True),
    "pp2": (dict(pp=2, dp_replicate=1), {}, PIPE, True),
}
FAMILIES = ("mixtral", "qwen2moe")
CASES = [(layout, family) for layout in LAYOUTS for family in FAMILIES]
IDS = [f"{layout}-{family}" for layout, family in CASES]


def _data():
    return token_batches(STEPS * GLOBAL, T)


# ---------------------------------------------------------------------------- the ranks
def _train(rank, world, layout: str, family: str) -> dict:
    from torch.distributed.tensor import DTensor

    from meshfit import Accelerator, ParallelDims
    from meshfit.train.models import loss_function

    dims, options, pipe, aux = LAYOUTS[layout]
    acc = Accelerator(parallel=ParallelDims(**dims), **options)
    dp, dp_rank = acc.runtime.dp_size, acc.runtime.dp_rank
    per_rank = GLOBAL // dp
    model = _build(family, aux=aux)
    loss_fn = loss_function(model)
    model = acc.prepare_pipeline(model, **pipe) if pipe else acc.prepare(model)
    opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=LR))
    x, y = _data()
    losses = []
    for step in range(STEPS):
        rows = slice(step * GLOBAL + dp_rank * per_rank, step * GLOBAL + (dp_rank + 1) * per_rank)
        with acc.accumulate():
            if pipe:
                loss = model.step(x[rows], y[rows])
            else:
                loss = loss_fn(model, x[rows], y[rows])
                acc.backward(loss)
            opt.step()
            opt.zero_grad()
        losses.append(loss.detach())
    # The step's loss over the data-parallel ranks (each rank's is its own rows').
    losses = acc.reduce(torch.stack(losses), reduction="mean").tolist()
    out = {"losses": losses, "state": acc.get_state_dict(model), "layouts": {}}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor) and (".experts." in name or "mlp.gate." in name
                                       or name.endswith(("q_proj.weight", "down_proj.weight"))):
            out["layouts"][name] = (str(p.placements), tuple(p.to_local().shape),
                                    tuple(p.shape))
    return out


@pytest.fixture(scope="module")
def ranks(request):
    cases = {case: (_train, *case) for case in selected(request, "case", CASES)}
    return run_cases(cases, 2, timeout=180) if cases else {}


# ---------------------------------------------------------------------------- the parent
def reference_train(family: str, *, aux: bool):
    """One process, one AdamW step per global batch, meshfit train's loss (with meshfit's
    router loss over the whole batch, as `prepare` installs it). Returns the losses and the
    state dict."""
    from meshfit.parallel.ep_hf import global_aux_loss_hook
    from meshfit.train.models import loss_function

    model = _build(family, aux=aux)
    global_aux_loss_hook(model)
    loss_fn = loss_function(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for x, y in step_batches(*_data(), GLOBAL):
        loss = loss_fn(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(family: str, aux: bool):
        key = (family, aux)
        if key not in cache:
            cache[key] = reference_train(family, aux=aux)
        return cache[key]

    return get


def _reference_for(references, layout: str, family: str):
    _, _, pipe, aux = LAYOUTS[layout]
    if pipe:  # a pipeline trains on the cross-entropy alone (see the module docstring)
        aux = False
    return references(family, aux)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_two_ranks_match_one_process(request, ranks, references, case):
    layout, family = case
    per_rank = case_result(ranks, case)
    ref_losses, ref_state = _reference_for(references, layout, family)
    losses = per_rank[0]["losses"]
    assert per_rank[1]["losses"] == losses  # reduced: the same on both ranks
    loss_gap = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    state = per_rank[0]["state"]
    assert state.keys() == ref_state.keys(), state.keys() ^ ref_state.keys()
    gaps = {k: (v - ref_state[k]).abs().max().item() for k, v in state.items()}
    worst = max(gaps, key=gaps.get)
    print(f"{layout}/{family}: losses {loss_gap:.1e}, parameters {gaps[worst]:.1e} ({worst})")
    assert len(losses) == STEPS and loss_gap < RTOL, (losses, ref_losses)
    assert gaps[worst] < ATOL, (worst, gaps[worst])


@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_parallel_keeps_routers_and_experts_whole(request, ranks, family):
    """Under tp=2 the attention is split (q_proj sharded on its output features), and so are
    Qwen2-MoE's shared expert and dense MLP (down_proj on its input features), while each
    router and routed-experts parameter is a replicated DTensor holding the whole tensor."""
    if ("tp2", family) not in ranks:
        pytest.skip("the tp2 case was not selected")
    layouts = case_result(ranks, ("tp2", family))[0]["layouts"]
    experts = {k: v for k, v in layouts.items() if ".experts." in k or "mlp.gate." in k}
    # gate_up_proj, down_proj and the router's weight in each MoE layer (Qwen2-MoE: one)
    assert len(experts) == 3 * (2 if family == "mixtral" else 1)
    for name, (placements, local, whole) in experts.items():
        assert placements == "(Replicate(),)" and local == whole, name
    q = layouts["model.layers.0.self_attn.q_proj.weight"]
    assert q == ("(Shard(dim=0),)", (16, 32), (32, 32))
    if family == "qwen2moe":
        for name in ("model.layers.0.mlp.shared_expert.down_proj.weight",
                     "model.layers.1.mlp.down_proj.weight"):
            assert layouts[name] == ("(Shard(dim=1),)", (32, 32), (32, 64)), name


# ---------------------------------------------------------------------------- in-process
@pytest.fixture(scope="module")
def hf_configs(tmp_path_factory):
    """config.json folders as `meshfit train` reads them ([model] hf_config), float32."""
    root = tmp_path_factory.mktemp("moe-configs")
    for family in FAMILIES:
        for aux in (False, True):
            cfg = _config(family, aux=aux, dtype=torch.float32)
            cfg.save_pretrained(root / f"{family}-{aux}")
    return root


def _run_config(folder, **parallel):
    from meshfit.train.configfile import build_config

    return build_config({"model": {"hf_config": str(folder)}, "parallel": parallel,
                         "train": {"seq_len": T}})


@pytest.mark.parametrize("aux", [False, True], ids=["ce", "aux"])
@pytest.mark.parametrize("family", FAMILIES)
def test_meshfit_loss_is_the_models_own_loss(hf_configs, family, aux):
    """`meshfit train`'s model (built from the config folder, float32, transformers' default
    experts kernel) and loss equal the model's own loss with ``labels``: the cross-entropy,
    plus router_aux_loss_coef x the load-balancing loss when output_router_logits is set (the
    aux term is checked to matter: > 1e-3 here). In evaluation mode meshfit's loss is the
    cross-entropy alone."""
    from meshfit.train.models import build_model, loss_function

    cfg = _run_config(hf_configs / f"{family}-{aux}")
    torch.manual_seed(0)
    model = build_model(cfg, VOCAB).train()
    assert model.config.output_router_logits is aux
    tokens = token_batches(2, T, seed=3)[0]
    # HF shifts labels inside: position t predicts tokens[t + 1], the last one nothing.
    targets = torch.cat([tokens[:, 1:], torch.full((2, 1), -100)], dim=1)
    loss_fn = loss_function(model)
    ours = loss_fn(model, tokens, targets)
    theirs = model(input_ids=tokens, labels=tokens)
    ce_only = model(input_ids=tokens, labels=tokens, output_router_logits=False).loss
    torch.testing.assert_close(ours, theirs.loss, rtol=1e-6, atol=0)
    if aux:
        assert theirs.aux_loss is not None and (theirs.loss - ce_only).item() > 1e-3
        model.eval()
        with torch.no_grad():
            torch.testing.assert_close(loss_fn(model, tokens, targets), ce_only.detach(),
                                       rtol=1e-6, atol=0)
    else:
        torch.testing.assert_close(theirs.loss, ce_only, rtol=0, atol=0)


def test_pipeline_with_router_aux_loss_is_refused_before_launch(hf_configs):
    from meshfit.train.models import check_model_source

    with pytest.raises(ValueError, match=r"output_router_logits=true .* parallel.pp=2 is not "
                                         r"yet available"):
        check_model_source(_run_config(hf_configs / "mixtral-True", pp=2, dp_replicate=1),
                           VOCAB)
    check_model_source(_run_config(hf_configs / "mixtral-False", pp=2, dp_replicate=1), VOCAB)
    check_model_source(_run_config(hf_configs / "mixtral-True", tp=2, dp_replicate=1), VOCAB)


def test_plans_are_built_in(hf_configs):
    """Both families have built-in plans (meshfit train accepts tp/pp without a plan); the
    TP plan asks tp to divide the heads, kv-heads, vocabulary and Qwen2-MoE's shared-expert
    width, and not the routed experts' width (they are not split)."""
    import transformers

    from meshfit.models.plans import has_builtin_plans, pipeline_plan_for, plan_for

    for family in FAMILIES:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(
                transformers.AutoConfig.from_pretrained(hf_configs / f"{family}-False"))
        assert has_builtin_plans(model)
        assert pipeline_plan_for(model).blocks == "model.layers"
        sizes = {name.split(".")[-1] for name, _, _ in plan_for(model).divisible}
        expected = {"num_attention_heads", "num_key_value_heads", "vocab_size"}
        if family == "qwen2moe":  # and its dense layer's width
            expected |= {"shared_expert_intermediate_size", "intermediate_size"}
        assert sizes == expected


def test_pipeline_stage_refuses_mixed_layer_types():
    """Qwen2-MoE picks each layer's attention mask by the layer's position in the list it
    iterates, which is wrong on a later stage when the layers mix sliding and full attention:
    that stage refuses to run; with one attention type both stages run."""
    import transformers

    from meshfit.parallel.pp.split import build_stage_module

    for sliding in (False, True):
        config = _config("qwen2moe", aux=False, dtype=torch.float32)
        if sliding:
            config = transformers.Qwen2MoeConfig(**{**config.to_dict(), "use_sliding_window": True,
                                                    "sliding_window": 4, "max_window_layers": 1,
                                                    "layer_types": None})
            assert len(set(config.layer_types)) == 2
        torch.manual_seed(0)
        model = transformers.Qwen2MoeForCausalLM(config)
        first, second = (build_stage_module(model, s, 2, [1]) for s in (0, 1))
        hidden = first(token_batches(1, 8)[0])
        assert hidden.shape == (1, 8, 32)
        if sliding:
            with pytest.raises(ValueError, match="layer_types mixing"):
                second(hidden)
        else:
            assert second(hidden).shape == (1, 8, VOCAB)
