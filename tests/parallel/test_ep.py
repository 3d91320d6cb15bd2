"""Expert parallelism (`ParallelDims(ep=)`) through `Accelerator`, each layout against one
process on the same global batch, in fp64.

The model: the reference GPT with 2 blocks, both mixture-of-experts (4 experts, top-2,
softmax routing, dropless, one shared expert; for the tensor-parallel cases block 0 is
dense), a load-balancing coefficient of 0.1 and a z-loss coefficient of 0.01 — large, so that an auxiliary loss that is lost or counted twice shows (measured:
dropping the auxiliary losses from the reference moves the parameters by 4e-2 after 2
steps in every case; leaving the experts' gradients unscaled instead of 1/ep, 1.3e-3).

The reference. Each data-parallel rank computes its auxiliary losses over its own tokens
(as data parallel does for any model), so the one-process reference runs the same global
batch as per-rank pieces — for a pipeline, per-rank per-micro-batch pieces — and
accumulates the mean of their losses (cross-entropy + auxiliary): the same objective, the
same global batch. The cross-entropy part equals the whole-batch mean (equal token counts).

Tolerance: the arithmetic of tests/reference.py (fp64, the same sums in another order,
AdamW's 1/eps sensitivity: at most 2 steps x lr 1e-2 x 1e-16 / 1e-8 = 2e-10 in the worst
case); measured here: 4.5e-13 at most over the seven cases (losses: 1.8e-15 apart);
PARAM_ATOL = 1e-11 as the other layout tests, 8 orders below the mistakes above.
"""

from __future__ import annotations

import re

import pytest
import torch

from conftest import case_result, run_cases
from reference import tiny_gpt, token_batches
from meshfit import Accelerator, ParallelDims

pytestmark = pytest.mark.usefixtures("one_thread")

SEQ, PER_RANK, STEPS, LR, CLIP = 16, 2, 2, 1e-2, 0.5
PARAM_ATOL, LOSS_RTOL = 1e-11, 1e-12
MOE = dict(n_experts=4, top_k=2, shared_experts=1, aux_loss_coef=0.1,
           router_z_loss_coef=0.01)


def _model(moe_every: int = 1, idle: bool = False):
    model = tiny_gpt(n_layer=2, max_seq_len=SEQ, moe_every=moe_every, **MOE)
    if idle:  # every token to experts 0 and 1: under ep2, rank 1's experts get no rows
        for m in model.modules():
            if type(m).__name__ == "MoE":
                m.route = _first_experts(m.route)
    return model


def _first_experts(route):
    def first(x):
        logits, probs, weights, idx = route(x)
        return logits, probs, weights, torch.arange(idx.shape[1]).expand_as(idx).contiguous()
    return first


def _batches(dp: int):
    x, y = token_batches(STEPS * PER_RANK * dp, SEQ)
    n = PER_RANK * dp
    return [(x[i:i + n], y[i:i + n]) for i in range(0, len(x), n)]


def _pieces(x, y, dp: int, microbatches: int):
    """Data-parallel rank r's rows of a global batch are r, r + dp, ...; a pipeline cuts
    them into consecutive micro-batches."""
    out = []
    for r in range(dp):
        xr, yr = x[r::dp], y[r::dp]
        m = len(xr) // microbatches
        out += [(xr[i:i + m], yr[i:i + m]) for i in range(0, len(xr), m)]
    return out


def _reference(dp: int, microbatches: int, aux: bool = True, moe_every: int = 1,
               idle: bool = False):
    model = _model(moe_every, idle)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ce_losses = []
    for x, y in _batches(dp):
        pieces = _pieces(x, y, dp, microbatches)
        ce = 0.0
        for xp, yp in pieces:
            loss = model(xp, yp)  # cross-entropy + the MoE blocks' auxiliary losses
            aux_loss = model.aux_loss()
            ce += (loss - aux_loss).item() / len(pieces)
            (loss if aux else loss - aux_loss).div(len(pieces)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        ce_losses.append(ce)
    return ce_losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _worker(rank, world, dims: dict, zero_stage: int | None, microbatches: int | None,
            moe_every: int = 1, sequence_parallel: bool = False, idle: bool = False,
            aux: bool = True):
    acc = Accelerator(parallel=ParallelDims(**dims), zero_stage=zero_stage,
                      sequence_parallel=sequence_parallel)
    dp, dp_rank = acc.runtime.dp_size, acc.runtime.dp_rank
    if microbatches:
        model = acc.prepare_pipeline(_model(moe_every), schedule="1f1b",
                                     microbatches=microbatches)
    else:
        model = acc.prepare(_model(moe_every, idle))
    opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=LR))
    losses, stats = [], []
    for x, y in _batches(dp):
        xr, yr = x[dp_rank::dp], y[dp_rank::dp]
        if microbatches:
            ce = model.step(xr, yr)
        else:
            xr, yr = acc.shard_sequence(xr, yr)  # under cp: this rank's part of each sequence
            loss = model(xr, yr) if aux else model(xr, yr) - model.aux_loss()
            acc.backward(loss)
            ce = loss.detach() - (model.aux_loss().detach() if aux else 0)
            stats.append(model.moe_stats())
        acc.clip_grad_norm_(model if microbatches else model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(acc.reduce(ce.detach(), "mean").item())
    # experts this rank computes per block: n_experts / ep
    computed = [m.n_experts if m.ep is None else m.ep.n_local
                for mod in (model.modules if microbatches else [model])
                for m in mod.modules() if type(m).__name__ == "MoE"]
    return {"losses": losses, "state": acc.get_state_dict(model), "dp": dp,
            "computed_experts": computed, "stats": stats, "engine": acc.layout.engine.value}


CASES = {
    # id: world size, ParallelDims kwargs, zero_stage, pipeline micro-batches (None: none),
    # moe_every (2: block 0 dense, block 1 MoE).
    # ep2-zero1 / -zero3: no other rank holds a rank's experts (FSDP2 leaves them out);
    # ep2xdp2: experts also sharded over the dp_shard / ep = 2 ranks holding the same ones;
    # hsdp: ... over the 2 replicas; ep2xpp2: each stage's blocks exchange over its ep group.
    "ep2-zero1": (2, dict(dp_shard=2, ep=2), 1, None),
    "ep2-zero3": (2, dict(dp_shard=2, ep=2), 3, None),
    # every token routed to rank 0's experts: rank 1 computes none, yet must run the
    # exchanges' backward with the others (it used to skip it and hang them)
    "ep2-idle-rank": (2, dict(dp_shard=2, ep=2), 1, None, 1, False, True),
    "ep2xdp2-zero3": (4, dict(dp_shard=4, ep=2), 3, None),
    "ep2-hsdp": (4, dict(dp_replicate=2, dp_shard=2, ep=2), 2, None),
    "ep2xpp2": (4, dict(pp=2, dp_shard=2, ep=2), 1, 2),
    # Tensor parallel without ep: attention, the dense MLP and the shared expert split, the
    # router and the routed experts whole on every tp rank (with sequence parallel: the MoE
    # blocks gather the sequence).
    "tp2": (2, dict(dp_replicate=1, tp=2), None, None, 2),
    "tp2-sp": (2, dict(dp_replicate=1, tp=2), None, None, 1, True),
    "dp2xtp2": (4, dict(dp_shard=2, tp=2), 1, None, 2),
    # ... and with ep: the routed experts whole on each tp rank, split over its ep group
    "ep2xtp2": (4, dict(dp_shard=2, ep=2, tp=2), 1, None, 2),
    # ... with cp: each sequence split over 2 cp ranks, the experts FSDP-sharded over the
    # dp_shard / ep x cp ranks holding the same ones. The blocks' auxiliary losses are each
    # rank's own (its part of the sequences), so this case trains the cross-entropy alone.
    "ep2xcp2": (4, dict(dp_shard=2, ep=2, cp=2), 1, None, 1, False, False, False),
}


@pytest.fixture(scope="module")
def results(request):
    out = {}
    for world in (2, 4):
        cases = {name: (_worker, *spec) for name, (w, *spec) in CASES.items() if w == world}
        out.update(run_cases(cases, world, timeout=240))
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel_equals_one_process(results, case):
    world, dims, stage, microbatches, *rest = CASES[case]
    moe_every = rest[0] if rest else 1
    idle = len(rest) > 2 and rest[2]
    aux = rest[3] if len(rest) > 3 else True
    per_rank = case_result(results, case)
    dp = per_rank[0]["dp"]
    want_losses, want_state = _reference(dp, microbatches or 1, aux=aux, moe_every=moe_every,
                                         idle=idle)
    for res in per_rank:
        assert res["engine"] == ("none" if dp == 1 else "fsdp2")
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(want_losses),
                                   rtol=LOSS_RTOL, atol=0)
        # each rank computes n_experts / ep of each block's experts
        assert res["computed_experts"] and all(
            n == MOE["n_experts"] // dims.get("ep", 1) for n in res["computed_experts"])
    state = per_rank[0]["state"]
    assert set(state) == set(want_state)
    for key, value in want_state.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=PARAM_ATOL, msg=key)


# ------------------------------------------------------------------ meshfit train
TRAIN = ["--model.preset=moe-tiny", "--model.n_layer=2", "--model.d_model=64",
         "--model.d_ff=128", "--model.moe_d_ff=64", "--train.steps=2", "--train.log_every=1",
         "--train.eval_every=0", "--train.global_batch_size=8", "--train.micro_batch_size=4",
         "--train.seq_len=32", "--train.eval_batches=1", "--checkpoint.every=1"]


def _train(out, args, env):
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "meshfit", "train", "--nproc", "2",
                           "--out", str(out), *args],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return proc.stdout, [line for line in lines if "loss" in line]


def test_train_ep2_logs_routing_and_resumes_on_another_ep(tmp_path, subprocess_env):
    """`meshfit train` with [parallel] ep: the routing metrics in metrics.jsonl and the
    progress line, and a checkpoint written under ep=2 resumed under ep=1 (DCP reshards the
    expert DTensors) reproducing the ep=2 run's step 2. The loss is logged to 5 decimals
    and both runs compute in fp32 with the same reductions up to order (~1e-6 relative):
    equal to 1e-4."""
    out = tmp_path / "run"
    stdout, lines = _train(out, [*TRAIN, f"--data.cache_dir={tmp_path / 'cache'}", "--parallel.dp_shard=2", "--parallel.ep=2"],
                           subprocess_env)
    assert "mesh dp_shard 2 x ep 2" in stdout
    assert len(lines) == 2
    for m in lines:
        assert 0 <= m["moe_tokens_per_expert_min"] <= m["moe_tokens_per_expert_max"]
        # 8 sequences x 32 tokens x top-2 over 8 experts: the busiest expert takes at least
        # the mean (64) and at most every token once (256)
        assert 64 <= m["moe_tokens_per_expert_max"] <= 256
        assert m["moe_tokens_per_expert_cv"] >= 0 and m["moe_dropped_fraction"] == 0
        assert m["moe_aux_loss"] > 0 and 0 < m["moe_a2a_share"] < 1
    step2 = lines[1]["loss"]
    import shutil

    shutil.rmtree(out / "checkpoints" / "step-2")
    shutil.rmtree(out / "model")
    _, resumed = _train(out, ["--resume", "--parallel.dp_shard=2",
                                        "--parallel.ep=1"], subprocess_env)
    assert resumed[-1]["step"] == 2
    assert resumed[-1]["loss"] == pytest.approx(step2, rel=1e-4)
    assert resumed[-1]["moe_a2a_s"] == 0  # no exchanges without ep


@pytest.mark.parametrize("args, match", [
    (["--parallel.ep=2"], r"ep=2 must divide dp_shard=1: expert parallelism is carved out"),
    (["--parallel.dp_shard=2", "--parallel.ep=2", "--model.preset=tiny"],
     r"parallel.ep=2 needs a mixture-of-experts model"),
    (["--parallel.dp_shard=2", "--parallel.ep=2", "--model.n_experts=3"],
     r"parallel.ep=2 must divide the number of experts \(3\)"),
    (["--parallel.dp_shard=2", "--parallel.ep=2", "--parallel.zero_stage=0"],
     r"parallel.zero_stage=0 with parallel.ep=2"),
    (["--model.n_experts=4", "--model.top_k=5"], r"model.top_k=5 must be <= n_experts=4"),
    (["--model.capacity_factor=0"], r"model.capacity_factor=0 must be a positive"),
])
def test_bad_moe_input_fails_before_launch(args, match, tmp_path, cli_refusal):
    line = cli_refusal("train", "--nproc", "2", "--out", str(tmp_path / "run"),
                       "--model.preset=moe-tiny", *args)
    assert re.search(match, line), line
