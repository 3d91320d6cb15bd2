"""Composed layouts on one mesh (4 gloo ranks) against a single process on the same batches.

Each layout trains the reference GPT (tied embedding and head, GELU, learned positions) for 5
AdamW steps through `Accelerator` — `prepare(model)` for dp x tp, `prepare_pipeline(model)`
for the layouts with pp — and returns every step's loss (the data-parallel mean) and the
whole model's state dict (`get_state_dict`, gathered to rank 0). The parent trains one
process on the global batch of every step (micro-batch x microbatches x data-parallel
ranks) and compares.

Tolerances: float64 throughout (in fp32, Adam would turn rounding noise of 1e-8 into 1e-4
parameter differences). The layouts change only the order of sums (micro-batch accumulation,
the tensor-parallel all-reduces, the data-parallel average, the tied copies' gradients added
across stages), ~1e-16 relative per operation, which AdamW (lr 3e-3, eps 1e-8, 5 steps) can
amplify to at most ~1.5e-10 on a parameter whose gradient is near eps (the bound is derived
in tests/reference.py). Measured over 5 seeds: losses <= 6.4e-16 relative, parameters
<= 5.7e-13 apart (layouts with tp; <= 6.5e-14 without). So losses agree to rtol 1e-10 and
parameters to atol 1e-10 (~175x the largest measured), while a layout mistake (a missing
gradient all-reduce, a batch seen twice, an unsummed tied copy) misses by more than 1e-3.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from conftest import case_result, run_cases, run_distributed, selected
from reference import logits, mean_ce, reference_run, step_batches, tiny_gpt, token_batches
from meshfit import Accelerator, ParallelDims

# The parent's one-process references are tiny models: one intra-op thread (see conftest).
pytestmark = pytest.mark.usefixtures("one_thread")

STEPS, T, MICRO, LR = 5, 16, 2, 3e-3
LOSS_RTOL, PARAM_ATOL = 1e-10, 1e-10


def _model():
    # The reference GPT with dropout off (its default), tied embedding and head, GELU and
    # learned positions; the same weights on every rank.
    return tiny_gpt(n_layer=4, max_seq_len=T)


def _data(n: int):
    return token_batches(n, T)


@functools.lru_cache(maxsize=None)
def _reference(per_step: int, clip: float | None = None):
    return reference_run(_model(), step_batches(*_data(STEPS * per_step), per_step), lr=LR,
                         clip=clip)


def _worker(rank, world, dims: dict, options: dict, pipeline: dict | None,
            clip: float | None = None):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc = Accelerator(parallel=ParallelDims(**dims), **options)
    layout_warnings = [str(w.message) for w in caught if "meshfit:" in str(w.message)]
    dp, k = acc.runtime.dp_size, acc.gradient_accumulation_steps
    m = pipeline["microbatches"] if pipeline else 1
    per_rank = MICRO * m  # sequences per rank per step: micro-batch x microbatches
    x, y = _data(STEPS * per_rank * dp * k)
    # Rank-major order of the global batch: dp rank r takes rows r, r + dp, ... (the
    # prepared loader's interleaved sharding) within each step's slice.
    loader = DataLoader(TensorDataset(x, y), batch_size=per_rank, shuffle=False)
    if pipeline:
        model = acc.prepare_pipeline(_model(), **pipeline)
        params = model.parameters()
    else:
        model = acc.prepare(_model())
        params = model.parameters()
    opt = torch.optim.AdamW(params, lr=LR)
    opt, loader = acc.prepare(opt, loader)
    losses, norms = [], []
    for xb, yb in loader:
        with acc.accumulate():
            if pipeline:
                loss = model.step(xb, yb, scale=1 / k)
            else:
                loss = model(xb, yb)  # GPT's own mean cross-entropy (loss-parallel aware)
                acc.backward(loss)
            if acc.sync_gradients and clip is not None:
                norms.append(acc.clip_grad_norm_(model if pipeline else model.parameters(),
                                                 clip).item())
            opt.step()
            opt.zero_grad()
        losses.append(acc.reduce(loss.detach(), "mean").item())
    # The optimizer step's loss: the mean of its k micro-steps' (equal token counts).
    losses = [sum(losses[i:i + k]) / k for i in range(0, len(losses), k)]
    with torch.no_grad():  # as a training loop evaluates
        evaluated = model.eval_loss(x[:per_rank], y[:per_rank]).item() if pipeline else None
    return {"losses": losses, "state": acc.get_state_dict(model), "dp": dp, "norms": norms,
            "eval": evaluated,
            "warnings": layout_warnings, "engine": acc.layout.engine.value}


def _check(results, dp: int, per_rank: int, k: int = 1, clip: float | None = None):
    want_losses, want_state = _reference(per_rank * dp * k, clip)
    if results[0]["eval"] is not None:
        # Pipeline.eval_loss after training = the trained reference's loss on that batch
        model = _model()
        model.load_state_dict(want_state)
        x, y = _data(per_rank)
        with torch.no_grad():
            want = mean_ce(logits(model, x), y).item()
        assert all(r["eval"] == pytest.approx(want, rel=LOSS_RTOL) for r in results)
    for res in results:
        assert res["dp"] == dp
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(want_losses),
                                   rtol=LOSS_RTOL, atol=0)
    assert all(r["state"] == {} for r in results[1:])
    state = results[0]["state"]
    assert set(state) == set(want_state)
    for key, value in want_state.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=PARAM_ATOL)


LAYOUTS = {
    # id: ParallelDims kwargs, Accelerator options, pipeline kwargs, data-parallel degree
    "dp2xtp2": (dict(dp_replicate=2, tp=2), {}, None, 2),
    "dp2xtp2-sp-lp": (dict(dp_replicate=2, tp=2), dict(sequence_parallel=True,
                                                       loss_parallel=True), None, 2),
    "zero1-dp2xtp2": (dict(dp_shard=2, tp=2), dict(zero_stage=1), None, 2),
    "dp2xpp2": (dict(pp=2, dp_replicate=2), {}, dict(schedule="1f1b", microbatches=2), 2),
    "tp2xpp2": (dict(pp=2, tp=2), {}, dict(schedule="gpipe", microbatches=2), 1),
    "tp2xpp2-sp-zero_bubble": (dict(pp=2, tp=2), dict(sequence_parallel=True),
                               dict(schedule="zero_bubble", microbatches=2), 1),
    "zero1-dp2xpp2-interleaved": (dict(pp=2, dp_shard=2), dict(zero_stage=1),
                                  dict(schedule="interleaved_1f1b", microbatches=2), 2),
    "zero2-dp2xpp2-warns": (dict(pp=2, dp_shard=2), dict(zero_stage=2),
                            dict(schedule="gpipe", microbatches=2), 2),
}
# dp2 x pp2 with 2 pipeline steps per optimizer step (scale=1/2) and the gradient norm
# clipped to 0.5 across both stages and data-parallel ranks.
ACCUMULATE_CLIP = (dict(pp=2, dp_replicate=2), dict(gradient_accumulation_steps=2),
                   dict(schedule="1f1b", microbatches=2), 0.5)
# The guide's 3-D layouts on 8 ranks (DP + PP + TP and ZeRO-1 + PP + TP, 2 x 2 x 2, 1f1b)
# are trained against one process in tests/checkpoint/test_export_matrix.py (ddpxpp2xtp2-gpt and
# zero1xpp2xtp2-gpt/-gpt2: every exported weight against the one-process run), in the 8-rank
# group that file starts for its exports, rather than in a second group of 8 ranks here.


@pytest.fixture(scope="module")
def four_ranks(request):
    """Every 4-rank layout trained in one spawn (see conftest.run_cases)."""
    cases = {name: (_worker, *LAYOUTS[name][:3])
             for name in selected(request, "layout", list(LAYOUTS))}
    cases["accumulate-clip"] = (_worker, *ACCUMULATE_CLIP)
    return run_cases(cases, 4, timeout=300)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(four_ranks, layout):
    dims, options, pipeline, dp = LAYOUTS[layout]
    results = case_result(four_ranks, layout)
    if options.get("zero_stage") == 2:  # the guide's warning: ZeRO-2/3 with a pipeline
        for res in results:
            assert len(res["warnings"]) == 1 and "zero_stage=2 with pp=2" in res["warnings"][0]
            assert "the same as zero_stage=1 here" in res["warnings"][0]
    else:
        assert all(r["warnings"] == [] for r in results)
    if dims.get("tp", 1) > 1 and dp > 1:
        # DTensor parameters: the data-parallel engine is FSDP2 even for stages 0 and 1.
        engine = "fsdp2" if dims.get("dp_shard", 1) > 1 else "fsdp2_replicate"
        assert {r["engine"] for r in results} == {engine}
    per_rank = MICRO * (pipeline["microbatches"] if pipeline else 1)
    _check(results, dp, per_rank)


def test_pipeline_accumulation_and_clipping_match_single_process(four_ranks):
    """dp2 x pp2 with 2 pipeline steps per optimizer step (scale=1/2) and the gradient norm
    clipped to 0.5 across both stages and data-parallel ranks (the tied embedding counted
    once): the same as one process clipping its whole model's norm."""
    results = case_result(four_ranks, "accumulate-clip")
    norms = [r["norms"] for r in results]
    assert len(norms[0]) == STEPS and all(n == norms[0] for n in norms)  # every rank agrees
    assert min(norms[0]) > 0.5  # the clip was active on every step
    _check(results, 2, MICRO * 2, k=2, clip=0.5)


def _pipeline_misuse_worker(rank, world):
    acc = Accelerator(parallel=ParallelDims(pp=2))
    model = _model()
    early = torch.optim.AdamW(model.parameters(), lr=LR)  # on the full model: refused
    pipe = acc.prepare_pipeline(model, schedule="gpipe", microbatches=2)
    out = {}
    try:
        acc.prepare(early)
    except ValueError as e:
        out["early_optimizer"] = str(e)
    x, y = _data(4)
    pipe.step(x, y)
    try:
        pipe.eval_loss(x, y)
    except RuntimeError as e:
        out["eval_with_grads"] = str(e)
    # A frozen tied weight (embedding and head): no gradients to sum, training goes on.
    frozen = _model()
    frozen.tok_emb.weight.requires_grad_(False)
    pipe2 = acc.prepare_pipeline(frozen, schedule="1f1b", microbatches=2)
    out["frozen_loss"] = pipe2.step(x, y).item()
    out["frozen_grads"] = [n for n, p in pipe2.named_parameters() if p.grad is None]
    return out


def test_pipeline_misuse_is_refused_and_frozen_ties_train():
    results = run_distributed(_pipeline_misuse_worker, 2)
    for res in results:
        assert res["early_optimizer"].startswith("prepare(optimizer): none of its parameters "
                                                 "belong to the prepared pipeline")
        assert "after optimizer.zero_grad(set_to_none=True)" in res["eval_with_grads"]
        assert res["frozen_loss"] > 0
    assert results[0]["frozen_grads"] == ["tok_emb.weight"]
    assert results[1]["frozen_grads"] == ["lm_head.weight"]
