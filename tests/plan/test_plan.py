"""The memory estimate's closed forms and the layout planner, in one process (no spawn).

Against independent references: the published parameter counts of GPT-2 and Llama-2 (from
the reference presets and from transformers configs), the ZeRO paper's worked example
(Rajbhandari et al. 2020: Ψ = 7.5B, N_d = 64 -> 120, 31.4, 16.6, 1.9 GB), Korthikanti et
al. (2022)'s activation formula per transformer layer (eq. 2-4) for GPT's shape, and the
multi-GPU guide's decision tree (one scenario per branch). Measured bytes on live layouts
are in tests/memory/test_estimate_measured.py.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from meshfit.memory import LayoutSpec, ModelShape, activation_bytes, estimate, model_state_bytes
from meshfit.plan import DEVICES, INTERCONNECTS, NETWORKS, Cluster, search

GiB = 2**30


@pytest.mark.parametrize("preset, expected", [("gpt2", 124_439_808),
                                              ("llama-7b", 6_738_415_616),
                                              ("llama-70b", 68_976_648_192)])
def test_exact_parameter_counts_of_presets(preset, expected):
    assert ModelShape.of(preset).params == expected


def test_exact_parameter_counts_of_transformers_configs(tmp_path):
    import transformers

    transformers.GPT2Config().save_pretrained(tmp_path / "gpt2")
    transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                             num_attention_heads=32, vocab_size=32000).save_pretrained(
        tmp_path / "llama")
    assert ModelShape.of(str(tmp_path / "gpt2" / "config.json")).params == 124_439_808
    shape = ModelShape.of(str(tmp_path / "llama"))
    assert shape.params == 6_738_415_616
    assert (shape.n_layer, shape.d_model, shape.gated_mlp, shape.tied) == (32, 4096, True, False)


def test_zero_paper_example_within_one_percent():
    paper = [120, 31.4, 16.6, 1.9]  # GB per GPU, Figure 1
    for stage, gb in enumerate(paper):
        got = model_state_bytes(7.5e9, dp=64, zero_stage=stage)["total"] / 1e9
        assert round(got, 1) == gb, (stage, got)  # the paper rounds to 0.1 GB (1.875 -> 1.9)


def _gpt_shape(**changes) -> ModelShape:
    return dataclasses.replace(ModelShape.of("gpt2"), **changes)


@pytest.mark.parametrize("t, sp", [(1, False), (2, False), (4, False), (4, True)])
def test_activations_follow_korthikanti_for_gpt_shape(t, sp):
    """Per layer, 2-byte activations, dropout on, the score matrix saved: s·b·h·(34 +
    5as/h) without tensor parallel, s·b·h·(10 + 24/t + 5as/(h t)) with it, and
    s·b·h/t·(34 + 5as/h) with sequence parallel (eq. 2, 3 and 4)."""
    shape = _gpt_shape(dropout=True)
    s, b, h, a = 1024, 4, shape.d_model, shape.n_head
    layout = LayoutSpec(tp=t, sequence_parallel=sp, micro_batch_size=b)
    got = activation_bytes(shape, layout, seq_len=s, dtype="bf16", attention="math").per_block
    if sp:
        want = s * b * h / t * (34 + 5 * a * s / h)
    else:
        want = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    assert got == pytest.approx(want, rel=1e-12)


def test_checkpointing_keeps_block_inputs_and_pipelines_hold_micro_batches():
    shape = _gpt_shape()
    s = 512
    full = estimate(shape, LayoutSpec(activation_checkpointing="full"), seq_len=s)
    none = estimate(shape, LayoutSpec(), seq_len=s)
    per_block = none.detail["per_block_activation"]
    inputs = shape.n_layer * s * shape.d_model * 4  # fp32: each block's input
    head_and_loss = 2 * s * shape.d_model * 4 + 3 * shape.vocab_size * 4 * s
    assert full.activations == pytest.approx(inputs + per_block + head_and_loss)
    assert none.activations == pytest.approx(shape.n_layer * per_block + head_and_loss)
    gpipe = estimate(shape, LayoutSpec(pp=4, schedule="gpipe", microbatches=8), seq_len=s)
    one_f = estimate(shape, LayoutSpec(pp=4, schedule="1f1b", microbatches=8), seq_len=s)
    assert (gpipe.detail["in_flight"], one_f.detail["in_flight"]) == (8, 4)
    assert gpipe.activations > one_f.activations


def test_model_states_follow_the_layout_engine():
    """ZeRO stages through meshfit's engines: fp32 AdamW states of the whole model on one
    rank, divided as the Layout's costs say."""
    shape = ModelShape.of("gpt2")
    p = shape.params
    one = estimate(shape, LayoutSpec(), seq_len=128)
    assert (one.params, one.grads, one.optimizer) == (4 * p, 4 * p, 8 * p)
    z1 = estimate(shape, LayoutSpec(dp_shard=4, zero_stage=1), seq_len=128)
    assert (z1.params, z1.grads, z1.optimizer) == (4 * p, 4 * p, 2 * p)
    z3 = estimate(shape, LayoutSpec(dp_shard=4, zero_stage=3), seq_len=128)
    assert (z3.params, z3.grads, z3.optimizer) == (p, p, 2 * p)
    off = estimate(shape, LayoutSpec(dp_shard=4, zero_stage=3, offload="cpu"), seq_len=128)
    assert off.params + off.grads + off.optimizer == 0 and off.host == 4 * p
    tp = estimate(shape, LayoutSpec(tp=4), seq_len=128)
    replicated = p * (1 - shape.tp_split)
    assert tp.params == pytest.approx(4 * (replicated + (p - replicated) / 4))


# ---------------------------------------------------------------------------- the guide
def _cluster(gpus: int, nodes: int = 1, *, interconnect="nvlink", network="infiniband",
             memory_gib: float | None = None) -> Cluster:
    device = DEVICES["h100"]
    if memory_gib is not None:
        device = dataclasses.replace(device, memory=memory_gib * GiB)
    return Cluster(gpus_per_node=gpus, nodes=nodes, device=device,
                   interconnect=INTERCONNECTS[interconnect], interconnect_name=interconnect,
                   network=NETWORKS[network], network_name=network)


def _best(model, cluster, *, seq_len=1024, batch=64):
    result = search(model, cluster, seq_len=seq_len, global_batch_size=batch)
    return result, result.plans[0].layout


def test_guide_one_gpu_model_fits():
    result, best = _best("gpt2", _cluster(1))
    assert result.scenario.startswith("one GPU: the model fits")
    assert best.world_size == 1


def test_guide_one_node_model_fits_data_parallel():
    result, best = _best("gpt2", _cluster(8))
    assert "fits one GPU: data parallel" in result.scenario
    assert (best.tp, best.pp) == (1, 1)  # DDP or ZeRO: data parallel either way


def test_guide_one_node_no_nvlink_prefers_pipeline():
    result, best = _best("llama-7b", _cluster(8, interconnect="pcie"), seq_len=4096)
    assert "no NVLink: pipeline parallel is preferred" in result.scenario
    assert best.pp > 1 and best.tp == 1


def test_guide_largest_layer_does_not_fit_needs_tensor_parallel():
    from meshfit.models import GPT, GPTConfig

    with torch.device("meta"):
        wide = ModelShape.from_module(GPT(GPTConfig(
            vocab_size=32000, n_layer=4, n_head=64, d_model=16384, d_ff=65536,
            max_seq_len=2048, bias=False, tie_embeddings=False)), name="wide")
    result = search(wide, _cluster(8, 2, memory_gib=16), seq_len=1024, global_batch_size=32)
    assert "largest layer does not fit one GPU: tensor parallel is needed" in result.scenario
    assert all(p.layout.tp > 1 for p in result.plans)


def test_guide_many_nodes_slow_network_keeps_tp_inside_and_pp_across():
    result, best = _best("llama-70b", _cluster(8, 16, network="ethernet"), seq_len=4096,
                         batch=512)
    assert "slow network: TP inside the node, PP across nodes" in result.scenario
    assert best.pp > 1 and 8 % best.tp == 0
    # the guide: DP across the slow network with ZeRO-1 at most (ZeRO-2/3 shard groups,
    # which gather parameters every step, stay inside a node)
    assert best.zero_stage <= 1 or best.tp * best.dp_shard <= 8


def test_guide_many_nodes_fast_network():
    result, best = _best("llama-70b", _cluster(8, 16), seq_len=4096, batch=512)
    assert "fast network: ZeRO-3/FSDP" in result.scenario
    assert best.zero_stage == 3 or (best.pp > 1 and best.tp > 1)


def test_impossible_request_says_what_would_make_it_possible():
    with pytest.raises(ValueError, match=r"needs at least \d+ GPUs of that size .* CPU offload"):
        search("llama-70b", _cluster(1), seq_len=4096, global_batch_size=8)


def test_plans_fit_with_the_margin_and_are_ranked():
    result = search("llama-7b", _cluster(8), seq_len=4096, global_batch_size=64)
    budget = 80 * GiB * 0.9
    assert all(p.estimate.total <= budget for p in result.plans)
    times = [p.step_time_s for p in result.plans]
    assert times == sorted(times)
    best = result.plans[0]
    tokens = 64 * 4096
    assert best.tokens_per_s == pytest.approx(tokens / best.step_time_s)
    peak = DEVICES["h100"].flops["bf16"] * 8
    assert best.mfu == pytest.approx(ModelShape.of("llama-7b").flops_per_token(4096) *
                                     best.tokens_per_s / peak)
    assert 0 < best.mfu <= DEVICES["h100"].efficiency


# ---------------------------------------------------------------------------- commands
def test_estimate_table_reads_in_a_unit_its_cells_show_in(capsys):
    """A small model's table switches to MiB (or KiB), as plan does: every row's total is
    non-zero as printed, and the cells add up to the total (within the rounding of 6 cells)."""
    from meshfit.cli.main import main

    assert main(["estimate", "tiny", "--world-size", "2", "--seq-len", "128"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("MiB per rank"), out[0]
    rows = [line.split() for line in out[2:] if "refused" not in line]
    assert rows
    for row in rows:
        cells = [float(x) for x in row[-6:]]
        assert cells[-1] > 0 and abs(sum(cells[:-1]) - cells[-1]) <= 0.03, row


def test_estimate_json_schema(capsys):
    from meshfit.cli.main import main

    assert main(["estimate", "gpt2", "--world-size", "4", "--seq-len", "1024", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "gpt2" and out["params"] == 124_439_808
    assert len(out["layouts"]) >= 6
    for row in out["layouts"]:
        assert set(row["layout"]) >= {"dp_replicate", "dp_shard", "tp", "pp", "zero_stage",
                                      "offload", "schedule", "microbatches",
                                      "activation_checkpointing", "micro_batch_size"}
        b = row["per_rank_bytes"]
        assert set(b) == {"params", "grads", "optimizer", "activations", "buffers", "total"}
        assert b["total"] == pytest.approx(sum(b[k] for k in b if k != "total"), abs=5)


def test_plan_json_and_out_config_that_meshfit_train_accepts(capsys, tmp_path):
    from meshfit.cli.main import main
    from meshfit.train.configfile import load_config

    out = tmp_path / "plan.toml"
    assert main(["plan", "gpt2", "--gpus-per-node", "4", "--gpu", "a100", "--gpu-memory",
                 "40GiB", "--seq-len", "1024", "--global-batch-size", "32", "--json",
                 "--out", str(out)]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert plans and all({"layout", "per_rank_bytes", "step_time_s", "tokens_per_s", "mfu",
                          "why"} <= set(p) for p in plans)
    assert [p["step_time_s"] for p in plans] == sorted(p["step_time_s"] for p in plans)
    cfg = load_config(out)
    layout = cfg.validate_for(4)  # meshfit train's own checks, before any launch
    best = plans[0]["layout"]
    assert (layout.dims.dp_shard, layout.dims.tp, layout.dims.pp) == (
        best["dp_shard"], best["tp"], best["pp"])
    assert cfg.train.global_batch_size == 32 and cfg.train.seq_len == 1024


def test_estimate_and_plan_with_lora_and_qlora(capsys, tmp_path):
    """--peft: the estimate of `Adapters.lora` (tests/memory: equal to what peft adds); the
    plan for a 4-bit base fits where full training does not, and writes a config that
    `meshfit train` takes (the folder as hf_model, [peft] qlora)."""
    import transformers

    from meshfit.cli.main import main
    from meshfit.memory import Adapters, LayoutSpec, estimate
    from meshfit.train.configfile import load_config

    rows = {}
    for peft in ("none", "lora", "qlora"):
        assert main(["estimate", "llama-7b", "--layout", "dp_shard=8,zero_stage=3",
                     "--seq-len", "2048", "--peft", peft, "--lora-r", "16", "--json"]) == 0
        rows[peft] = json.loads(capsys.readouterr().out)["layouts"][0]["per_rank_bytes"]
    shape = ModelShape.of("llama-7b")
    spec = LayoutSpec(dp_shard=8, zero_stage=3)
    for peft in ("lora", "qlora"):
        want = estimate(shape, spec, seq_len=2048, dtype="bf16", adapters=Adapters.lora(
            shape, 16, quantized=peft == "qlora"))
        assert rows[peft] == want.per_rank_bytes
    assert rows["qlora"]["params"] < rows["lora"]["params"] / 5
    assert rows["lora"]["grads"] < rows["none"]["grads"] / 50
    folder = tmp_path / "llama"
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=768,
                                      num_attention_heads=4, num_key_value_heads=4,
                                      num_hidden_layers=4, vocab_size=1000,
                                      max_position_embeddings=256)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    out = tmp_path / "plan.toml"  # 4M parameters: ~70 MiB to train in full, ~20 with QLoRA
    assert main(["plan", str(folder), "--gpus-per-node", "1", "--gpu-memory", "40MiB",
                 "--seq-len", "256", "--global-batch-size", "1", "--dtype", "fp32",
                 "--peft", "qlora", "--out", str(out)]) == 0
    capsys.readouterr()
    cfg = load_config(out)
    assert cfg.peft.method == "qlora" and cfg.model.hf_model == str(folder)
    assert main(["plan", str(folder), "--gpus-per-node", "1", "--gpu-memory", "40MiB",
                 "--seq-len", "256", "--global-batch-size", "1", "--dtype", "fp32"]) == 2
    assert "needs at least" in capsys.readouterr().err


@pytest.mark.parametrize("argv, match", [
    (["estimate", "nosuch"], "MODEL='nosuch' is not a preset"),
    (["estimate", "gpt2", "--peft", "lora", "--lora-r", "0"], "--lora-r=0 must be >= 1"),
    (["estimate", "moe-tiny", "--peft", "lora"], "--peft=lora: moe-tiny: LoRA estimates"),
    (["plan", "gpt2", "--gpus-per-node", "8", "--gpu-memory", "80XB"],
     "--gpu-memory='80XB' is not a memory size"),
    (["estimate", "gpt2", "--layout", "tp=5", "--seq-len", "128"], "12"),
    (["estimate", "gpt2", "--layout", "tp=4", "--gpus-per-node", "6", "--seq-len", "128"],
     "tp=4 does not divide --gpus-per-node=6"),
    (["estimate", "gpt2", "--layout", "tpp=2"], "--layout 'tpp=2': unknown key 'tpp'"),
    (["plan", "llama-70b", "--gpus-per-node", "1", "--seq-len", "4096"],
     "needs at least"),
    (["plan", "gpt2", "--gpus-per-node", "0"], "--gpus-per-node=0 must be >= 1"),
    (["estimate", "gpt2", "--seq-len", "4096"], "--seq-len=4096 is longer than the 1024"),
])
def test_bad_input_is_one_line(cli_refusal, argv, match):
    assert match in cli_refusal(*argv)


def test_flops_per_token_matches_the_reference_gpt():
    from meshfit.models import GPTConfig

    for preset in ("gpt2", "llama-7b"):
        cfg = GPTConfig.preset(preset)
        assert ModelShape.of(preset).flops_per_token(2048) == cfg.flops_per_token(2048)
    assert math.isfinite(ModelShape.of("tiny").flops_per_token(128))


def test_mixture_of_experts_counts_total_and_active(capsys):
    from meshfit.cli.main import main

    shape = ModelShape.of("mixtral-8x7b")
    assert (shape.params, shape.active_params) == (46_702_792_704, 12_879_925_248)
    assert main(["estimate", "mixtral-8x7b", "--world-size", "8", "--seq-len", "4096",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["params"], out["active_params"]) == (46_702_792_704, 12_879_925_248)


# ---------------------------------------------------------------------------- expert parallel
@pytest.mark.parametrize("preset, experts", [
    ("moe-tiny", 4 * 8 * 3 * 128 * 256),  # MoE blocks x experts x SwiGLU (w1, w3, w2) x d x f
    ("mixtral-8x7b", 32 * 8 * 3 * 4096 * 14336)])
def test_expert_parallel_divides_the_routed_experts(preset, experts):
    """ep splits the routed experts (router, attention, norms, embeddings stay as without
    ep); the ZeRO stages then shard the experts' share over the dp / ep ranks holding the
    same experts. By hand, fp32 AdamW (4 + 4 + 8 B) and the ZeRO paper's 2 + 2 + 12 B."""
    shape = ModelShape.of(preset)
    assert shape.expert_params == experts and shape.n_experts == 8
    P, X = shape.params, experts
    D = P - X  # everything but the routed experts
    for ep in (1, 2, 4):
        # The paper's formula on dp = 8: unsharded states hold D + X/ep, sharded ones P/8.
        got = [model_state_bytes(P, dp=8, zero_stage=z, ep=ep, expert_params=X)["total"]
               for z in range(4)]
        mine = D + X / ep
        assert got == pytest.approx([16 * mine, 4 * mine + 12 * P / 8, 2 * mine + 14 * P / 8,
                                     16 * P / 8], rel=1e-12)
        # meshfit's engine on dp_shard 4: FSDP2 whenever ep > 1 (at stage 1 too), so at rest
        # every state is 1/4 of the model for every ep; ZeRO-1 without ep keeps the
        # parameters and gradients whole.
        for stage in (1, 3):
            est = estimate(shape, LayoutSpec(dp_shard=4, ep=ep, zero_stage=stage), seq_len=128)
            whole = stage == 1 and ep == 1
            assert (est.params, est.grads, est.optimizer) == pytest.approx(
                (4 * P if whole else P, 4 * P if whole else P, 2 * P), rel=1e-12)
        # ZeRO-3 gathers one block at a time, of which this rank's experts only: 1/ep of
        # them over the dp_shard / ep ranks that share them, none at ep = dp_shard (FSDP2
        # leaves them out); x (2 gathered + 1 reduce-scatter) x 4 B.
        Xb = shape.block_expert_params
        gathered = shape.block_params - Xb + (Xb / ep if ep < 4 else 0)
        z3 = estimate(shape, LayoutSpec(dp_shard=4, ep=ep, zero_stage=3), seq_len=128)
        assert z3.buffers == pytest.approx(12 * gathered, rel=1e-12)
    # ep = dp_shard with 2 replicas: the experts are sharded over the replicas (a 1-D
    # dp_replicate mesh), everything else is HSDP over dp_shard.
    hsdp = estimate(shape, LayoutSpec(dp_replicate=2, dp_shard=4, ep=4, zero_stage=3),
                    seq_len=128)
    assert hsdp.params == pytest.approx(4 * (D / 4 + X / 8), rel=1e-12)
    # ep = dp_shard, no replicas, CPU offload: the experts FSDP2 leaves out stay on the device.
    off = estimate(shape, LayoutSpec(dp_shard=4, ep=4, zero_stage=3, offload="cpu"),
                   seq_len=128)
    assert (off.params, off.grads, off.optimizer) == pytest.approx((X, X, 2 * X), rel=1e-12)
    assert off.host == pytest.approx(16 * D / 4, rel=1e-12)


def test_expert_parallel_needs_routed_experts_that_ep_divides():
    with pytest.raises(ValueError, match="ep=2 needs a mixture-of-experts model"):
        estimate("tiny", LayoutSpec(dp_shard=2, ep=2, zero_stage=3), seq_len=128)
    with pytest.raises(ValueError, match="ep=16 must divide the number of experts"):
        estimate("moe-tiny", LayoutSpec(dp_shard=16, ep=16, zero_stage=3), seq_len=128)
    with pytest.raises(ValueError, match="ep=3 must be an integer >= 1 that divides dp=8"):
        model_state_bytes(1e9, dp=8, zero_stage=1, ep=3, expert_params=5e8)
    assert LayoutSpec(dp_shard=4, ep=2).world_size == 4  # carved out of dp_shard


def test_disk_offload_is_estimated_and_planned_only_when_nothing_else_fits():
    """offload="disk": the estimate moves the optimizer state to `Estimate.disk` (AdamW's
    8 B per parameter) and keeps three 256 MiB chunks of it in memory; the planner proposes
    it only when no layout fits without it, its step charged with reading and writing the
    state at the cluster's disk bandwidth."""
    from meshfit.memory import LayoutSpec, estimate
    from meshfit.memory.estimate import DISK_CHUNK_BYTES
    from meshfit.plan.search import Cluster, search

    shape = ModelShape.of("llama-7b")
    full = estimate(shape, LayoutSpec(), seq_len=1024, dtype="bf16")
    disk = estimate(shape, LayoutSpec(offload="disk"), seq_len=1024, dtype="bf16")
    assert disk.disk == full.optimizer == 8 * shape.params
    assert disk.optimizer == 3 * DISK_CHUNK_BYTES
    assert disk.total == full.total - full.optimizer + 3 * DISK_CHUNK_BYTES
    one = search("llama-7b", Cluster(gpus_per_node=1), seq_len=1024, global_batch_size=8)
    best = one.plans[0]
    assert all(p.layout.offload == "disk" for p in one.plans)
    io = 2 * disk.disk / Cluster(gpus_per_node=1).disk_bandwidth
    assert best.breakdown["offload"] == pytest.approx(io, rel=1e-9)
    assert "nothing fits without the optimizer state on disk" in best.why
    two = search("llama-7b", Cluster(gpus_per_node=2), seq_len=1024, global_batch_size=8)
    assert not any(p.layout.offload == "disk" for p in two.plans)
    slow = search("llama-7b", Cluster(gpus_per_node=1, disk_bandwidth=1e9), seq_len=1024,
                  global_batch_size=8).plans[0]
    assert slow.breakdown["offload"] == pytest.approx(2 * io, rel=1e-9)


def test_parameters_on_disk_are_estimated_and_planned_when_the_state_alone_is_not_enough(
        capsys, tmp_path):
    """offload_params (ZeRO-3): the parameter shards (4 B per parameter / dp_shard) join the
    state on disk; the host keeps the gradient shards and three chunks of state; the device
    none of the three. The planner takes it only where the state on disk alone does not
    fit, and charges the shards' and gradients' trips over the host link too."""
    from meshfit.memory import LayoutSpec, estimate
    from meshfit.memory.estimate import DISK_CHUNK_BYTES
    from meshfit.plan.search import Cluster, search

    shape = ModelShape.of("llama-7b")
    state = estimate(shape, LayoutSpec(dp_shard=4, zero_stage=3, offload="disk"),
                     seq_len=1024, dtype="bf16")
    both = estimate(shape, LayoutSpec(dp_shard=4, zero_stage=3, offload="disk",
                                      offload_params=True), seq_len=1024, dtype="bf16")
    assert both.disk == pytest.approx((4 + 8) * shape.params / 4, rel=1e-12)
    assert both.host == pytest.approx(4 * shape.params / 4 + 3 * DISK_CHUNK_BYTES, rel=1e-12)
    assert both.params == both.grads == both.optimizer == 0
    assert both.total == pytest.approx(state.total - state.params - state.grads
                                       - state.optimizer, rel=1e-12)
    assert both.layout.to_json()["offload_params"] is True
    # 4 GPUs of 16 GiB and 64 GiB of host memory: the ZeRO-3 parameter and gradient shards
    # (13.5 GB per rank) with the activations do not fit the GPUs, even with the state on
    # disk, and CPU offload needs 100 GiB of host memory; with the shards on disk too, the
    # host holds 30 GB of gradient shards and chunks
    import dataclasses

    from meshfit.plan.devices import DEVICES

    small = Cluster(gpus_per_node=4,
                    device=dataclasses.replace(DEVICES["h100"], memory=16 * 2**30))
    plans = search("llama-7b", small, seq_len=1024, global_batch_size=8,
                   host_memory=64 * 2**30).plans
    assert plans and all(p.layout.offload_params and p.layout.zero_stage == 3 for p in plans)
    best = plans[0]
    assert "nothing fits without the parameters and optimizer state on disk" in best.why
    est = best.estimate
    io = 2 * est.disk * 4 / small.disk_bandwidth
    moved = 2 * (est.detail["params_on_disk"] + est.host) / small.device.host_link
    assert best.breakdown["offload"] == pytest.approx(io + moved, rel=1e-9)
    # 80 GB GPUs: the state alone on disk is enough, the parameters stay on the device
    assert not any(p.layout.offload_params for p in search(
        "llama-7b", Cluster(gpus_per_node=1), seq_len=1024, global_batch_size=8).plans)


def test_plan_writes_a_disk_offload_config_meshfit_train_takes(capsys, tmp_path):
    from meshfit.cli.main import main
    from meshfit.train.configfile import load_config

    out = tmp_path / "plan.toml"
    assert main(["plan", "llama-7b", "--gpus-per-node", "1", "--seq-len", "1024",
                 "--global-batch-size", "8", "--disk-bandwidth", "3", "--json",
                 "--out", str(out)]) == 0
    best = json.loads(capsys.readouterr().out)["plans"][0]
    assert "nothing fits without the optimizer state on disk" in best["why"]
    assert "at 3.0 GB/s per node" in best["why"]
    cfg = load_config(out)
    assert cfg.parallel.offload == "disk" and cfg.parallel.offload_dir == "./meshfit-offload"
    assert main(["plan", "gpt2", "--gpus-per-node", "1", "--disk-bandwidth", "0"]) == 2
    assert "--disk-bandwidth=0.0 must be > 0" in capsys.readouterr().err


def test_the_offload_disk_bandwidth_comes_from_the_flag_the_profile_or_the_default():
    import argparse

    from meshfit.cli.plan import _disk_bandwidth

    class Measured:
        def __init__(self, noisy=False):
            self.noisy = noisy

        def disk_bandwidth(self):
            return 3e8

        def trusted(self, figure):
            return not self.noisy

    flag, none = argparse.Namespace(disk_bandwidth=1.5), argparse.Namespace(disk_bandwidth=None)
    assert _disk_bandwidth(flag, Measured()) == 1.5e9
    assert _disk_bandwidth(none, Measured()) == 3e8
    assert _disk_bandwidth(none, None) == 2e9
    assert _disk_bandwidth(none, Measured(noisy=True)) == 2e9  # flagged: not used


def test_a_cpu_cluster_is_this_machine(capsys):
    """`--gpu cpu` is the host the command runs on: its physical memory (not a 16 GiB
    stand-in), shared by its processes (each rank's budget its share), which talk over
    loopback; no NVLink, and no network on one node. A GPU cluster names its network only
    across nodes."""
    import dataclasses
    import os

    from meshfit.cli.main import main
    from meshfit.plan import DEVICES, Cluster, search

    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert DEVICES["cpu"].memory == host
    cpu = Cluster(gpus_per_node=2, device=DEVICES["cpu"])
    assert cpu.memory_per_rank == host / 2
    described = (f"1 x 2 cpu processes ({host / GiB:.1f} GiB of memory per node, "
                 f"{host / 2 / GiB:.1f} GiB each; loopback)")
    assert cpu.describe() == described
    assert Cluster(gpus_per_node=8).describe() == "1 x 8 h100 (80 GiB, nvlink)"
    assert Cluster(gpus_per_node=8, nodes=2).describe() == "2 x 8 h100 (80 GiB, nvlink, " \
                                                           "infiniband)"
    assert main(["plan", "tiny", "--gpus-per-node", "2", "--gpu", "cpu", "--top", "1"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert described in first and "nvlink" not in first and "infiniband" not in first
    # the budget is a rank's share: the plans that fit 2 ranks sharing M are those whose
    # per-rank estimate fits M / 2 with the margin
    everything = search("tiny", Cluster(gpus_per_node=2, device=dataclasses.replace(
        DEVICES["cpu"], memory=2**40)), seq_len=256, global_batch_size=16).plans
    memory = sorted(p.estimate.total for p in everything)[len(everything) // 2] / 0.45
    shared = search("tiny", Cluster(gpus_per_node=2, device=dataclasses.replace(
        DEVICES["cpu"], memory=memory)), seq_len=256, global_batch_size=16).plans
    assert 0 < len(shared) < len(everything)
    assert {p.layout for p in shared} == {p.layout for p in everything
                                          if p.estimate.total <= memory / 2 * 0.9}
