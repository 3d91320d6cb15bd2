"""Pipeline parallel from plans as data: the reference GPT, Hugging Face `LlamaForCausalLM`
and `GPT2LMHeadModel`, each cut into stages by its `PipelinePlan` and trained through
`Accelerator.prepare_pipeline` on pp=2 with 1f1b and interleaved_1f1b (2 stages per rank),
against one process training the same model on the same batches.

Tolerances: float64 throughout. A pipeline changes only the order of sums (micro-batch
gradients accumulated one after another, a tied weight's copies added across ranks), ~1e-16
relative per operation; Adam divides by sqrt(v), which amplifies that to ~1e-14 on the
parameters after a few steps of a model this size. Losses must agree to rtol 1e-10 and
parameters to atol 1e-10, as in tests/parallel/test_pp.py: a real mistake (a stage adding positions
twice, a skipped final norm, tied copies drifting apart) misses by more than 1e-3.
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import run_distributed
from reference import MODELS, reference_run, token_batches

STEPS, B, T, MB = 3, 8, 16, 4
LOSS_RTOL, PARAM_ATOL = 1e-10, 1e-10  # fp64, summation order only (see the docstring)
SCHEDULES = {"1f1b": dict(schedule="1f1b", microbatches=MB),
             "interleaved_1f1b": dict(schedule="interleaved_1f1b", microbatches=MB,
                                      virtual_stages=2)}
CASES = [(m, s) for m in MODELS for s in SCHEDULES]


def _batches():
    x, y = token_batches(B, T, seed=3)
    y[0, :5] = -100  # ignored targets in one micro-batch only: exact weighting matters
    return [(x, y)] * STEPS  # one batch again and again: the loss must fall


def _train(rank, world_size):
    from meshfit import Accelerator, ParallelDims

    out = {}
    for kind, schedule in CASES:
        acc = Accelerator(parallel=ParallelDims(pp=2, dp_replicate=1))
        pipeline = acc.prepare_pipeline(MODELS[kind](n_layer=4), **SCHEDULES[schedule])
        optimizer = acc.prepare(torch.optim.AdamW(pipeline.parameters(), lr=3e-3))
        losses = []
        for x, y in _batches():
            with acc.accumulate():
                losses.append(pipeline.step(x, y).item())
                optimizer.step()
                optimizer.zero_grad()
        out[(kind, schedule)] = dict(losses=losses, state=acc.get_state_dict(pipeline),
                                     stages=pipeline.stage_indices, points=pipeline.points,
                                     names=sorted(n for n, _ in pipeline.named_parameters()))
    return out


@pytest.fixture(scope="module")
def trained():
    return run_distributed(_train, 2, timeout=300)


@pytest.fixture(scope="module")
def reference():
    return {kind: reference_run(MODELS[kind](n_layer=4), _batches()) for kind in MODELS}


@pytest.mark.parametrize("kind, schedule", CASES)
def test_pp2_matches_one_process(trained, reference, kind, schedule):
    ref_losses, ref_state = reference[kind]
    r0, r1 = trained[0][(kind, schedule)], trained[1][(kind, schedule)]
    assert r0["losses"] == r1["losses"]  # broadcast from the last stage's rank
    for ref, got in zip(ref_losses, r0["losses"]):
        assert math.isclose(ref, got, rel_tol=LOSS_RTOL), (ref_losses, r0["losses"])
    assert ref_losses[-1] < ref_losses[0]  # it trained
    expected = [[0], [1]] if schedule == "1f1b" else [[0, 2], [1, 3]]
    assert [r0["stages"], r1["stages"]] == expected
    # Every rank holds its stages' parameters under the full model's names, none twice
    # except a tied weight's second copy.
    assert not set(r0["names"]) & set(r1["names"])
    state = r0["state"]  # the whole model, gathered to rank 0
    assert r1["state"] == {} and state.keys() == ref_state.keys()
    gaps = {k: (state[k] - ref_state[k]).abs().max().item() for k in ref_state}
    worst = max(gaps, key=gaps.get)
    assert gaps[worst] < PARAM_ATOL, (worst, gaps[worst])


def test_stage_modules_keep_names_and_run_like_the_model():
    """No spawn: each HF model's stages, run one after another, give the full model's
    logits; the blocks keep their indices in the full model."""
    from meshfit.parallel.pp import build_stage_module
    from reference import logits

    x = token_batches(2, T)[0]
    for kind in ("llama", "gpt2"):
        model = MODELS[kind](n_layer=4)
        parts = [build_stage_module(model, s, 3, [1, 3]) for s in range(3)]
        full = model.state_dict()
        for part in parts:
            for name, value in part.state_dict().items():
                assert torch.equal(value, full[name]), (kind, name)
        h = x
        for part in parts:
            h = part(h)
        torch.testing.assert_close(h, logits(model, x), rtol=0, atol=1e-12)
        assert model.state_dict().keys() == full.keys()  # the full model is untouched
