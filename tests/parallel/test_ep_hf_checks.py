"""Expert parallel for transformers MoE families, in one process: what can run it
(`meshfit.parallel.ep.ep_problem`, and `meshfit train`'s refusal before launch), the
parameter counts the memory estimate and planner use (`ModelShape`) against the real
models', and meshfit's load-balancing loss against transformers' own."""

from __future__ import annotations

import re

import pytest
import torch

from meshfit.models.families import FAMILIES, MOE_FAMILIES, tiny_config, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _moe_layers(config) -> int:
    """MoE layers of a tiny config, from the config's own fields (not from the model)."""
    layers = config.num_hidden_layers
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    dense |= set(range(getattr(config, "first_k_dense_replace", None) or 0))
    step = getattr(config, "decoder_sparse_step", None) or 1
    return sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_shape_counts_routed_experts_exactly(family):
    """`ModelShape` of each MoE family (on the meta device, as `meshfit estimate` / `plan`
    read a config): every parameter once, the routed experts (E x 3 x d x F per MoE layer,
    dense layers and shared experts excluded), and the estimate under ep2 holding half."""
    import transformers

    from meshfit.memory.estimate import LayoutSpec, estimate
    from meshfit.memory.shape import ModelShape

    config = tiny_config(family)
    model = tiny_model(family)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config)
    shape = ModelShape.from_module(meta)
    d, E = config.hidden_size, 4
    # Mixtral's experts are intermediate_size wide, the others' moe_intermediate_size
    f = config.intermediate_size if family == "mixtral" else config.moe_intermediate_size
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert shape.n_experts == E
    assert shape.block_expert_params == E * 3 * d * f
    assert shape.expert_params == _moe_layers(config) * E * 3 * d * f
    assert shape.moe_layers == _moe_layers(config) >= 1
    est = estimate(shape, LayoutSpec(dp_shard=2, ep=2, zero_stage=1), seq_len=16)
    assert est.detail["expert_params_on_rank"] == shape.expert_params / 2
    with pytest.raises(ValueError, match=r"ep=8 must divide the number of experts \(4\)"):
        estimate(shape, LayoutSpec(dp_shard=8, ep=8, zero_stage=1), seq_len=16)


def test_ep_problem_names_what_cannot_run():
    """One class each: a dense family (config or model), a MoE family meshfit has not mapped
    (OLMoE), ep not dividing the experts; every mapped family with ep2 runs."""
    import transformers

    from meshfit.models.config import GPTConfig
    from meshfit.parallel.ep import ep_problem

    for family in FAMILIES:
        problem = ep_problem(tiny_config(family), 2)
        assert (problem is None) == (family in MOE_FAMILIES), (family, problem)
        if family not in MOE_FAMILIES:
            assert problem.startswith(f"ep=2 needs a mixture-of-experts model, and {family} "
                                      "is dense"), problem
    assert "llama is dense" in ep_problem(tiny_model("llama"), 2)
    assert ep_problem(tiny_model("qwen3_moe"), 2) is None
    assert re.match(r"ep=8 must divide the number of experts \(4, deepseek_v3\)",
                    ep_problem(tiny_config("deepseek_v3"), 8))
    olmoe = transformers.OlmoeConfig(hidden_size=32, intermediate_size=32, num_experts=4,
                                     num_hidden_layers=1, num_attention_heads=2,
                                     num_key_value_heads=2, vocab_size=64)
    for what in (olmoe, transformers.AutoModelForCausalLM.from_config(olmoe)):
        assert re.match(r"ep=2: .* is a mixture-of-experts layout meshfit has not mapped",
                        ep_problem(what, 2)), ep_problem(what, 2)
    # Accelerator.prepare's path (`apply_hf_ep`, before any parameter is touched) says the same
    from meshfit.parallel.ep_hf import apply_hf_ep

    class TwoRanks:  # the size and rank of an ep mesh, all apply_hf_ep reads before refusing
        def size(self):
            return 2

        def get_local_rank(self):
            return 0

    with pytest.raises(ValueError, match="OlmoeExperts is a mixture-of-experts layout"):
        apply_hf_ep(what, TwoRanks())
    assert "this GPT is dense" in ep_problem(GPTConfig.preset("tiny"), 2)
    assert ep_problem(GPTConfig.preset("moe-tiny"), 2) is None
    assert ep_problem(tiny_config("llama"), 1) is None  # no expert parallel: nothing to say


def test_ep_composes_with_tp_and_cp():
    """ep with tp, and ep with cp, are layouts (tested equal to one process in
    test_ep_hf.py); ep is carved out of dp_shard as without them."""
    from meshfit.parallel.layout import Layout
    from meshfit.parallel.request import LayoutRequest

    for other in ("tp", "cp"):
        layout = Layout.resolve(LayoutRequest(dp_shard=2, ep=2, zero_stage=1, **{other: 2}), 4)
        assert (layout.dims.dp_shard, layout.dims.ep, getattr(layout.dims, other)) == (2, 2, 2)


@pytest.fixture(scope="module")
def config_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep-configs")
    for family in ("llama", "qwen3_moe"):
        tiny_config(family, vocab_size=512).save_pretrained(root / family)
    import transformers

    transformers.OlmoeConfig(hidden_size=32, intermediate_size=32, num_experts=4,
                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                             vocab_size=512).save_pretrained(root / "olmoe")
    return root


@pytest.mark.parametrize("family, nproc, match", [
    ("llama", 2, r"parallel.ep=2 needs a mixture-of-experts model, and llama is dense"),
    ("olmoe", 2, r"parallel.ep=2: OlmoeExperts is a mixture-of-experts "
                 r"layout meshfit has not mapped"),
    ("qwen3_moe", 8, r"parallel.ep=8 must divide the number of experts \(4, qwen3_moe\)"),
])
def test_train_refuses_ep_before_launch(family, nproc, match, config_folders, tmp_path,
                                        cli_refusal):
    line = cli_refusal("train", "--nproc", str(nproc), "--out", str(tmp_path / "run"),
                       f"--model.hf_config={config_folders / family}",
                       f"--parallel.dp_shard={nproc}", f"--parallel.ep={nproc}",
                       "--train.seq_len=16", "--train.micro_batch_size=1",
                       f"--train.global_batch_size={nproc}")
    assert re.search(match, line), line


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_load_balancing_loss_is_transformers_own(family):
    """meshfit's load-balancing loss (float64) equals the model's own `aux_loss` (float32
    accumulation: 1e-6 relative) on one process, and its gradient that of the model's."""
    from meshfit.parallel.ep_hf import AUX_LOSS_FAMILIES, load_balancing_loss

    assert family in AUX_LOSS_FAMILIES  # the families whose router loss meshfit replaces
    model = tiny_model(family, output_router_logits=True)
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=x)
    ours = load_balancing_loss(out.router_logits, 4, 2)
    torch.testing.assert_close(ours, out.aux_loss.to(ours), rtol=1e-6, atol=0)
    gate = model.model.layers[0].mlp.gate.weight
    (g_ours,) = torch.autograd.grad(ours, gate, retain_graph=True)
    (g_theirs,) = torch.autograd.grad(out.aux_loss, gate)
    torch.testing.assert_close(g_ours, g_theirs.to(g_ours), rtol=1e-5, atol=1e-9)


def test_planner_places_ep_with_its_all_to_alls():
    """`meshfit plan` (`search`) on a transformers MoE enumerates ep inside dp_shard (each ep
    dividing its experts, never at ZeRO stage 0), holds 1/ep of the routed experts per rank,
    and charges each ep layout its all-to-alls: per micro-batch and MoE block, 4 exchanges
    of b x s x k x d bytes at (ep - 1)/ep of the link's bandwidth, by hand below."""
    import transformers

    from meshfit.memory.shape import ModelShape
    from meshfit.plan import Cluster, search

    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"))
    shape = ModelShape.from_module(meta)
    cluster = Cluster(gpus_per_node=2)
    result = search(shape, cluster, seq_len=16, global_batch_size=8)
    layouts = {p.layout.ep for p in result.plans}
    assert layouts == {1, 2}  # ep 2 inside dp_shard 2 (4 experts)
    for plan in result.plans:
        spec = plan.layout
        assert spec.ep == 1 or spec.zero_stage > 0
        if spec.ep == 1 or spec.tp > 1 or spec.pp > 1:
            continue
        micro = 8 // spec.dp // spec.micro_batch_size
        calls = 6 if spec.activation_checkpointing == "full" else 4
        link = cluster.interconnect
        one = link.latency + (spec.ep - 1) / spec.ep * (
            spec.micro_batch_size * 16 * 2 * 64 * 2) / link.bandwidth  # k=2, d=64, bf16
        assert plan.breakdown["ep"] == pytest.approx(micro * 2 * calls * one, rel=1e-9)
        assert plan.estimate.detail["expert_params_on_rank"] == pytest.approx(
            shape.expert_params / spec.ep)


def test_estimate_cli_takes_ep_for_a_transformers_moe(config_folders, capsys):
    """`meshfit estimate CONFIG --layout dp_shard=2,ep=2` on a Qwen3-MoE config.json: the
    layout is accepted (it used to be refused as "no MoE blocks"), and per rank it needs
    less than ep=1 at the same ZeRO stage."""
    import json

    from meshfit.cli.main import main

    totals = {}
    for ep in (1, 2):
        assert main(["estimate", str(config_folders / "qwen3_moe"), "--layout",
                     f"dp_shard=2,ep={ep},zero_stage=1", "--seq-len", "16", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["layouts"][0]["layout"]["ep"] == ep
        totals[ep] = out["layouts"][0]["per_rank_bytes"]["total"]
    assert totals[2] < totals[1]


def test_global_aux_loss_hook_replaces_the_models_own():
    """On one process the hook's router loss is `load_balancing_loss` (float64), in
    ``out.aux_loss`` and, with labels, in ``out.loss`` (the model's cross-entropy plus
    router_aux_loss_coef times it, in place of transformers' float32 one)."""
    from meshfit.parallel.ep_hf import global_aux_loss_hook, load_balancing_loss

    model = tiny_model("qwen3_moe", output_router_logits=True, router_aux_loss_coef=0.05)
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    ce = model(input_ids=x, labels=x, output_router_logits=False).loss
    handle = global_aux_loss_hook(model)
    out = model(input_ids=x, labels=x)
    want = load_balancing_loss(out.router_logits, 4, 2)
    assert out.aux_loss.dtype == torch.float64 and torch.equal(out.aux_loss, want)
    torch.testing.assert_close(out.loss, ce + 0.05 * want, rtol=1e-14, atol=0)
    handle.remove()
    assert model(input_ids=x).aux_loss.dtype == torch.float32  # transformers' own again


def test_prepare_replaces_the_router_loss_of_mapped_families_only():
    """`parallelize` (what `Accelerator.prepare` runs) puts meshfit's router loss (float64,
    global statistics) on the families whose loss it reproduces (`AUX_LOSS_FAMILIES`) and
    leaves another family's (OLMoE's) as transformers computes it (float32)."""
    import transformers

    from meshfit.parallel.layout import Layout
    from meshfit.parallel.parallelize import parallelize
    from meshfit.parallel.request import LayoutRequest

    layout = Layout.resolve(LayoutRequest(), 1, distributed=False)
    olmoe = transformers.OlmoeConfig(hidden_size=32, intermediate_size=32, num_experts=4,
                                     num_hidden_layers=1, num_attention_heads=2,
                                     num_key_value_heads=2, vocab_size=128,
                                     num_experts_per_tok=2, output_router_logits=True)
    x = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(2))
    for model, dtype in ((tiny_model("qwen3_moe", output_router_logits=True), torch.float64),
                         (transformers.AutoModelForCausalLM.from_config(olmoe),
                          torch.float32)):
        model = parallelize(model, layout)
        assert model(input_ids=x).aux_loss.dtype == dtype
