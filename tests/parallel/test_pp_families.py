"""Pipeline parallel for every transformers family of `meshfit.models.families`, its plan read
from the model's own ``base_model_pp_plan`` (`meshfit.models.plans.transformers_pp`).

One 2-rank spawn trains each family (4 layers, so that interleaved and zero-bubble stages hold
one layer each) with pp=2 under 1f1b and a second schedule (interleaved_1f1b, zero_bubble and
gpipe in turn), 3 AdamW steps in float64, and returns losses and the whole model; the parent
trains the same model in one process on the same batches and compares. The families carry
what a stage must get right: alternating sliding/full layers (Gemma 2/3: a stage's masks and
rotary tables by the types of the layers it holds), Gemma's scaled embedding and final logit
softcapping, Granite's four multipliers, tied embeddings (Gemma, SmolLM3: the head's copy on
the last stage kept equal to the embedding on the first), SmolLM3's layers without RoPE,
GPT-NeoX's parallel residual, dense and sparse MoE layers (router logits off). The sequence
(12) is longer than the sliding window (8), so a wrong mask shows.

Tolerances: as tests/parallel/test_pp_models.py (float64; a pipeline changes only the order of
sums, ~1e-16 relative per operation; reference.py derives the bound): losses to rtol 1e-10,
parameters to atol 1e-10; measured <= 4e-16 and <= 3e-14. Four families compute parts of
their forward in float32 whatever the model's dtype: Gemma 2/3's RMSNorm (``x.float()``) and
the DeepSeek-V3 / GLM-4-MoE router (``hidden_states.type(torch.float32)``). There a 1e-16
difference of an input can flip a float32 rounding, u32 = 6e-8 relative, so the same bound
with u32 in place of u: a gradient element moves by up to k u32 G ~ 100 x 6e-8 x 1e-2 = 6e-8,
which AdamW turns into up to S lr dg / eps = 3 x 3e-3 x 6e-8 / 1e-8 = 5e-5 on a parameter;
the loss by up to k u32 ~ 6e-6 relative. Measured: losses <= 1.4e-9 relative, parameters
<= 4.6e-8 apart; so rtol 1e-6 and atol 1e-5 for those four. A stage that applies a layer's
mask by its position in the stage, Granite's embedding multiplier twice, or no tied-gradient
sum misses by 1e-2 or more (measured for the first two: logits 0.13-0.22 and 0.04 apart).
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import run_distributed
from reference import logits, reference_run, token_batches
from meshfit.models.families import FAMILIES, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS, B, T, MB, LAYERS, VOCAB = 3, 4, 12, 2, 4, 128
LOSS_RTOL, PARAM_ATOL = 1e-10, 1e-10
FLOAT32_INSIDE = {"gemma2", "gemma3_text", "glm4_moe", "deepseek_v3"}  # (see the docstring)
LOSS_RTOL32, PARAM_ATOL32 = 1e-6, 1e-5
SECOND = ("interleaved_1f1b", "zero_bubble", "gpipe")
CASES = [(f, s) for i, f in enumerate(FAMILIES) for s in ("1f1b", SECOND[i % len(SECOND)])]
EXPORTED = "gemma3_text"  # a tied-embedding family: its pp run is exported and reloaded


def _batches():
    x, y = token_batches(B, T, VOCAB, seed=3)
    y[0, :5] = -100  # ignored targets in one micro-batch only: exact weighting matters
    return [(x, y)] * STEPS


def _model(family):
    return tiny_model(family, seed=0, layers=LAYERS)


def _train(rank, world_size):
    import time

    from meshfit import Accelerator, ParallelDims

    out = {}
    for family, schedule in CASES:
        start = time.perf_counter()
        acc = Accelerator(parallel=ParallelDims(pp=2, dp_replicate=1))
        pipeline = acc.prepare_pipeline(_model(family), schedule=schedule, microbatches=MB)
        optimizer = acc.prepare(torch.optim.AdamW(pipeline.parameters(), lr=3e-3))
        losses = []
        for x, y in _batches():
            with acc.accumulate():
                losses.append(pipeline.step(x, y).item())
                optimizer.step()
                optimizer.zero_grad()
        state = acc.get_state_dict(pipeline)
        out[(family, schedule)] = dict(losses=losses, state=state, stages=pipeline.stage_indices,
                                       seconds=time.perf_counter() - start)
    return out


@pytest.fixture(scope="module")
def trained():
    return run_distributed(_train, 2, timeout=600)


@pytest.fixture(scope="module")
def reference():
    return {family: reference_run(_model(family), _batches()) for family in FAMILIES}


def test_every_family_under_two_schedules_matches_one_process(trained, reference):
    failures = []
    for family, schedule in CASES:
        ref_losses, ref_state = reference[family]
        r0, r1 = trained[0][(family, schedule)], trained[1][(family, schedule)]
        assert r0["losses"] == r1["losses"]  # broadcast from the last stage's rank
        assert ref_losses[-1] < ref_losses[0], family  # it trained
        state = r0["state"]
        assert r1["state"] == {} and state.keys() == ref_state.keys(), (family, schedule)
        rtol, atol = ((LOSS_RTOL32, PARAM_ATOL32) if family in FLOAT32_INSIDE
                      else (LOSS_RTOL, PARAM_ATOL))
        loss_ok = all(math.isclose(a, b, rel_tol=rtol) for a, b in zip(ref_losses, r0["losses"]))
        gap = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)
        if not loss_ok or gap >= atol:
            failures.append((family, schedule, ref_losses, r0["losses"], gap))
    assert not failures, failures


def test_the_cases_cover_every_schedule_and_stage_placement(trained):
    """Each schedule ran, with the placement it promises (looped or V-shaped)."""
    expected = {"1f1b": [[0], [1]], "gpipe": [[0], [1]], "interleaved_1f1b": [[0, 2], [1, 3]],
                "zero_bubble": [[0, 3], [1, 2]]}
    assert {s for _, s in CASES} == set(expected)
    for family, schedule in CASES:
        got = [trained[r][(family, schedule)]["stages"] for r in (0, 1)]
        assert got == expected[schedule], (family, schedule)
    seconds = {k: round(v["seconds"], 2) for k, v in trained[0].items()}
    print("pp2 seconds per (family, schedule):", seconds)


def test_exported_pp_run_loads_with_from_pretrained(trained, tmp_path):
    """The whole model of a tied-embedding family's pp run, written as a model folder, loads
    with transformers' from_pretrained and gives the logits of that state exactly; the
    pipeline kept the head's copy equal to the embedding."""
    import transformers

    from meshfit.checkpoint.saved import save_model_folder

    state = trained[0][(EXPORTED, "1f1b")]["state"]
    model = _model(EXPORTED)
    assert model.config.tie_word_embeddings
    assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    save_model_folder(tmp_path / "model", state, model)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model",
                                                               dtype=torch.float64)
    model.load_state_dict(state)
    x = _batches()[0][0]
    with torch.no_grad():
        assert torch.equal(logits(loaded, x), logits(model, x))
