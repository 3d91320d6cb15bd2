"""Expert parallel for transformers' MoE families (`meshfit.parallel.ep_hf`): Mixtral,
Qwen2-MoE, Qwen3-MoE, GLM-4-MoE and DeepSeek-V3 (`meshfit.models.families.tiny_model`, fp64,
transformers' "eager" experts loop as the one-process reference of the exchange), each
against one process on the same global batches.

Layouts: ep2 (2 ranks, dp_shard=2 = ep: each rank holds half the experts, nothing else
shares them) for every family, in one spawn; in a second spawn of 4 ranks, ep2 x dp_shard2
under ZeRO-3 (the experts FSDP-sharded over the 2 ranks holding the same ones) for Qwen3-MoE
and DeepSeek-V3, ep2 x tp2 (attention split, the experts whole on each tp rank), ep2 x cp2
(each sequence split over 2 cp ranks) and ep2 x pp2 (1f1b; cross-entropy only, as a pipeline
trains) for Mixtral and Qwen2-MoE (the MoE families with built-in tp and pp plans on this
branch).

The loss is meshfit train's (`meshfit.train.models.loss_function`): the cross-entropy plus,
for the families whose ForCausalLM has a router loss (Mixtral, Qwen2/3-MoE; DeepSeek-V3 and
GLM-4-MoE balance by a routing bias and have none), router_aux_loss_coef x the
load-balancing loss, whose statistics meshfit takes over all data-parallel ranks
(`load_balancing_loss`): so the reference is one plain process on the whole global batch.
AUX_COEF = 0.05 so that the term shows (measured on Mixtral and Qwen3-MoE: leaving it out of
the reference moves the parameters by 1.7e-2; taking it per rank, over each half of the
batch, instead of over the global batch, by 1.5e-2).

Tolerance, as tests/parallel/test_hf_moe.py derives it: fp64, 3 AdamW steps at lr 3e-3,
worst case S lr dg / eps ~ 1e-10: losses rtol 1e-10, parameters atol 1e-10 (measured: 2.4e-14
at most). DeepSeek-V3 and GLM-4-MoE compute their routers in float32 (transformers' own
code): the router weights' gradients are sums over the tokens rounded in float32 (relative
error up to ~N eps32 = 64 x 6e-8 = 4e-6 in a different order of summation), which AdamW turns
into at most S lr 4e-6 = 4e-8 per parameter: parameters atol 1e-7, losses rtol 1e-8
(measured: 3.9e-9 and 2.3e-11). The routing
statistics (`routing_metrics` of the last step: tokens per expert over the global batch,
their min/max/cv, the aux loss) equal one process's to 1e-9 (cv and aux are rounded to 4
and 6 decimals).
"""

from __future__ import annotations

import pytest
import torch

from conftest import case_result, run_cases
from reference import VOCAB, step_batches, token_batches

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS, GLOBAL, T, LR = 3, 4, 16, 3e-3
RTOL = ATOL = 1e-10
FP32_ROUTER_RTOL, FP32_ROUTER_ATOL = 1e-8, 1e-7  # see the module docstring
AUX_COEF = 0.05
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "glm4_moe", "deepseek_v3")
CASES = {
    # id: world, ParallelDims kwargs, zero stage, families
    "ep2": (2, dict(dp_shard=2, ep=2), 1, FAMILIES),
    "ep2xdp2-zero3": (4, dict(dp_shard=4, ep=2), 3, ("qwen3_moe", "deepseek_v3")),
    # attention (and Qwen2-MoE's shared expert) split over tp, the routed experts whole on
    # each tp rank and split over the ep ranks of the same tp index
    "ep2xtp2": (4, dict(dp_shard=2, ep=2, tp=2), 1, ("mixtral", "qwen2_moe")),
    # each sequence split over the cp ranks (ring attention); the experts FSDP-sharded over
    # the dp_shard / ep x cp ranks holding the same ones, the router loss's statistics and
    # the routing over dp x cp
    "ep2xcp2": (4, dict(dp_shard=2, ep=2, cp=2), 1, ("mixtral", "qwen2_moe")),
    # two pipeline stages (1f1b, 2 micro-batches), each stage's experts split over its ep
    # group; a pipeline's loss is the cross-entropy (the router loss is refused with pp)
    "ep2xpp2": (4, dict(pp=2, dp_shard=2, ep=2), 1, ("mixtral", "qwen2_moe")),
}


def _model(family: str):
    from meshfit.models.families import tiny_model

    return tiny_model(family, vocab_size=VOCAB, output_router_logits=True,
                      router_aux_loss_coef=AUX_COEF).train()


def _stats(model, dp_group=None, dp_size: int = 1) -> dict:
    from meshfit.parallel.ep import moe_modules, routing_metrics

    out = routing_metrics(moe_modules([model]), dp_group=dp_group, dp_size=dp_size)
    out.pop("moe_a2a_s", None)
    return out


def _train(rank, world, dims: dict, stage: int, families) -> dict:
    from meshfit import Accelerator, ParallelDims
    from meshfit.train.models import loss_function

    out = {}
    for family in families:
        acc = Accelerator(parallel=ParallelDims(**dims), zero_stage=stage)
        dp, dp_rank = acc.runtime.dp_size, acc.runtime.dp_rank
        per_rank = GLOBAL // dp
        model = _model(family)
        loss_fn = loss_function(model)
        pipe = dims.get("pp", 1) > 1
        model = acc.prepare_pipeline(model, schedule="1f1b", microbatches=2) if pipe else \
            acc.prepare(model)
        opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=LR))
        x, y = token_batches(STEPS * GLOBAL, T)
        losses = []
        for step in range(STEPS):
            rows = slice(step * GLOBAL + dp_rank * per_rank,
                         step * GLOBAL + (dp_rank + 1) * per_rank)
            if pipe:
                loss = model.step(x[rows], y[rows])
            else:
                loss = loss_fn(model, *acc.shard_sequence(x[rows], y[rows]))
                acc.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        group = acc.runtime.reduce_group  # the ranks that see distinct tokens: dp x cp
        stats = None if pipe else _stats(model, group, torch.distributed.get_world_size(group))
        losses = acc.reduce(torch.stack(losses), reduction="mean").tolist()
        local = [(tuple(p.to_local().shape), p.device_mesh.mesh_dim_names)
                 for m in (model.modules if pipe else [model])
                 for n, p in m.named_parameters() if n.endswith("experts.gate_up_proj")]
        out[family] = {"losses": losses, "state": acc.get_state_dict(model), "stats": stats,
                       "local_experts": local}
    return out


@pytest.fixture(scope="module")
def ranks():
    out = {}
    for world in (2, 4):
        cases = {name: (_train, *spec) for name, (w, *spec) in CASES.items() if w == world}
        out.update(run_cases(cases, world, timeout=300))
    return out


def reference_train(family: str, aux: bool = True):
    """One process, one AdamW step per global batch: cross-entropy + coef x the
    load-balancing loss over the whole batch (`load_balancing_loss`, one process), and the
    last step's routing statistics."""
    import torch.nn.functional as F

    from meshfit.parallel.ep_hf import load_balancing_loss, record_routing

    model = _model(family)
    record_routing(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, aux_on = [], aux and hasattr(model.config, "router_aux_loss_coef")
    for x, y in step_batches(*token_batches(STEPS * GLOBAL, T), GLOBAL):
        out = model(input_ids=x, output_router_logits=aux_on)
        loss = F.cross_entropy(out.logits.flatten(0, 1), y.flatten())
        if aux_on:
            aux = load_balancing_loss(out.router_logits, _experts(model).num_experts,
                                      model.config.num_experts_per_tok)
            loss = loss + AUX_COEF * aux
            _experts(model).meshfit_stats["aux_loss"] = AUX_COEF * float(aux.detach())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, \
        _stats(model)


def _experts(model):
    """The first MoE layer's experts (where meshfit's hook puts the aux loss's statistic)."""
    return next(m for m in model.modules() if hasattr(m, "gate_up_proj"))


@pytest.mark.parametrize("case, family", [(c, f) for c, spec in CASES.items()
                                          for f in spec[3]])
def test_expert_parallel_equals_one_process(ranks, case, family):
    per_rank = [r[family] for r in case_result(ranks, case)]
    pipe = CASES[case][1].get("pp", 1) > 1  # the cross-entropy alone
    want_losses, want_state, want_stats = reference_train(family, aux=not pipe)
    losses = per_rank[0]["losses"]
    assert all(r["losses"] == losses for r in per_rank)
    gap = max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses))
    state = per_rank[0]["state"]
    assert state.keys() == want_state.keys()
    gaps = {k: (v - want_state[k]).abs().max().item() for k, v in state.items()}
    worst = max(gaps, key=gaps.get)
    print(f"{case}/{family}: losses {gap:.1e}, parameters {gaps[worst]:.1e} ({worst})")
    fp32 = family in ("glm4_moe", "deepseek_v3")  # their routers compute in float32
    assert len(losses) == STEPS and gap < (FP32_ROUTER_RTOL if fp32 else RTOL), losses
    assert gaps[worst] < (FP32_ROUTER_ATOL if fp32 else ATOL), (worst, gaps[worst])
    # each rank holds n_experts / ep = 2 of the 4 experts of each MoE layer, and under
    # ZeRO-3 an FSDP shard of those over the dp_shard / ep ranks holding the same ones
    dims = CASES[case][1]
    held = 4 // dims["ep"] // (dims["dp_shard"] // dims["ep"] * dims.get("cp", 1))
    assert per_rank[0]["local_experts"] and all(
        shape[0] == held and "ep" in mesh for r in per_rank for shape, mesh in r["local_experts"])
    for r in per_rank if not pipe else ():  # (the stages' routing: test_ep.py's ep2xpp2)
        assert r["stats"].keys() == want_stats.keys() and want_stats
        for key, value in want_stats.items():
            assert r["stats"][key] == pytest.approx(value, rel=1e-9, abs=1e-9), key


# ------------------------------------------------------------------ meshfit train
def test_train_ep2_on_a_transformers_moe(tmp_path, subprocess_env):
    """`meshfit train --parallel.ep=2` on a tiny Qwen3-MoE config.json: it trains (dropless,
    the routing metrics logged), and the exported folder holds every expert whole
    (transformers loads it with the config's 4 experts per layer)."""
    import json
    import subprocess
    import sys

    import transformers

    from meshfit.models.families import tiny_config

    tiny_config("qwen3_moe", vocab_size=512, output_router_logits=True).save_pretrained(
        tmp_path / "config")
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "meshfit", "train", "--nproc", "2", "--out", str(out),
         f"--model.hf_config={tmp_path / 'config'}", "--parallel.dp_shard=2",
         "--parallel.ep=2", "--train.steps=2", "--train.seq_len=16",
         "--train.micro_batch_size=2", "--train.global_batch_size=4", "--train.log_every=1",
         "--train.eval_every=0", "--train.eval_batches=1", "--checkpoint.every=0",
         f"--data.cache_dir={tmp_path / 'cache'}"],
        env=subprocess_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "mesh dp_shard 2 x ep 2" in proc.stdout
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "loss" in m]
    assert len(steps) == 2
    for m in steps:
        # 4 sequences x 16 tokens x top-2 = 128 assignments over 4 experts, none dropped
        assert 0 <= m["moe_tokens_per_expert_min"] <= 32 <= m["moe_tokens_per_expert_max"]
        assert m["moe_dropped_fraction"] == 0 and m["moe_aux_loss"] > 0
        assert m["moe_a2a_s"] > 0
    model = transformers.AutoModelForCausalLM.from_pretrained(out / "model")
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (4, 64, 64) and experts.down_proj.shape == (4, 64, 32)
