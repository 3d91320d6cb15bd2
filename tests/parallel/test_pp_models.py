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

The same spawn trains every transformers family of `meshfit.models.families`, its plan read
from the model's own ``base_model_pp_plan`` (`meshfit.models.plans.transformers_pp`), with 4
layers (interleaved and zero-bubble stages hold one each), under 1f1b and one more schedule
(interleaved_1f1b, zero_bubble and gpipe in turn), 3 AdamW steps. The families carry what a
stage must get right: alternating sliding/full layers (Gemma 2/3: a stage's masks and rotary
tables by the types of the layers it holds), Gemma's scaled embedding and final logit
softcapping, Granite's four multipliers, tied embeddings (Gemma, SmolLM3: the head's copy on
the last stage kept equal to the embedding on the first), SmolLM3's layers without RoPE,
GPT-NeoX's parallel residual, dense and sparse MoE layers (router logits off). The sequence
(12) is longer than the sliding window (8), so a wrong mask shows. Measured: losses <= 4e-16
relative, parameters <= 3e-14 apart, within the tolerances above, except for four families
that compute parts of their forward in float32 whatever the model's dtype: Gemma 2/3's
RMSNorm (``x.float()``) and the DeepSeek-V3 / GLM-4-MoE router
(``hidden_states.type(torch.float32)``). There a 1e-16 difference of an input can flip a
float32 rounding, u32 = 6e-8 relative, so tests/reference.py's bound with u32 in place of u:
a gradient element moves by up to k u32 G ~ 100 x 6e-8 x 1e-2 = 6e-8, which AdamW turns into
up to S lr dg / eps = 3 x 3e-3 x 6e-8 / 1e-8 = 5e-5 on a parameter, the loss by up to
k u32 ~ 6e-6 relative. Measured: losses <= 1.4e-9 relative, parameters <= 4.6e-8 apart; so
rtol 1e-6 and atol 1e-5 for those four. A stage that applies a layer's mask by its position
in the stage, or Granite's embedding multiplier twice, misses by 1e-2 or more (logits 0.13-0.22
and 0.04 apart, measured).
"""

from __future__ import annotations

import contextlib
import math
import time

import pytest
import torch

from conftest import run_distributed
from reference import MODELS, logits, reference_run, token_batches
from meshfit.models.families import FAMILIES, tiny_model

# The parent's one-process references are tiny models: one intra-op thread (see conftest).
pytestmark = pytest.mark.usefixtures("one_thread")

STEPS, B, T, MB = 3, 8, 16, 4
LOSS_RTOL, PARAM_ATOL = 1e-10, 1e-10  # fp64, summation order only (see the docstring)
SCHEDULES = {"1f1b": dict(schedule="1f1b", microbatches=MB),
             "interleaved_1f1b": dict(schedule="interleaved_1f1b", microbatches=MB,
                                      virtual_stages=2)}
CASES = [(m, s) for m in MODELS for s in SCHEDULES]
# Families: 4 layers (interleaved and zero-bubble stages hold one each), sequence 12 > the
# sliding window of 8, so a wrong mask shows; 1f1b and one more schedule each, in turn.
FB, FT, FMB, LAYERS, VOCAB = 4, 12, 2, 4, 128
FLOAT32_INSIDE = {"gemma2", "gemma3_text", "glm4_moe", "deepseek_v3"}  # (see the docstring)
LOSS_RTOL32, PARAM_ATOL32 = 1e-6, 1e-5
SECOND = ("interleaved_1f1b", "zero_bubble", "gpipe")
FAMILY_CASES = [(f, s) for i, f in enumerate(FAMILIES)
                for s in ("1f1b", SECOND[i % len(SECOND)])]
EXPORTED = "gemma3_text"  # a tied-embedding family: its pp run is exported and reloaded


def _batches():
    x, y = token_batches(B, T, seed=3)
    y[0, :5] = -100  # ignored targets in one micro-batch only: exact weighting matters
    return [(x, y)] * STEPS  # one batch again and again: the loss must fall


def _family_batches():
    x, y = token_batches(FB, FT, VOCAB, seed=3)
    y[0, :5] = -100
    return [(x, y)] * STEPS


def _family(family):
    return tiny_model(family, seed=0, layers=LAYERS)


def _run(model, batches, **pipeline_kwargs) -> dict:
    """pp=2 training of `model` on `batches`, 3e-3 AdamW: losses, the gathered state, and
    where the stages went."""
    from meshfit import Accelerator, ParallelDims

    start = time.perf_counter()
    acc = Accelerator(parallel=ParallelDims(pp=2, dp_replicate=1))
    pipeline = acc.prepare_pipeline(model, **pipeline_kwargs)
    optimizer = acc.prepare(torch.optim.AdamW(pipeline.parameters(), lr=3e-3))
    losses = []
    for x, y in batches:
        with acc.accumulate():
            losses.append(pipeline.step(x, y).item())
            optimizer.step()
            optimizer.zero_grad()
    return dict(losses=losses, state=acc.get_state_dict(pipeline),
                stages=pipeline.stage_indices, points=pipeline.points,
                names=sorted(n for n, _ in pipeline.named_parameters()),
                seconds=time.perf_counter() - start)


def _train(rank, world_size):
    out = {case: _run(MODELS[case[0]](n_layer=4), _batches(), **SCHEDULES[case[1]])
           for case in CASES}
    for family, schedule in FAMILY_CASES:
        out[("family", family, schedule)] = _run(_family(family), _family_batches(),
                                                 schedule=schedule, microbatches=FMB)
    return out


@contextlib.contextmanager
def _one_thread():
    """conftest's one_thread for a module fixture (set up before function-scoped ones)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def trained():
    return run_distributed(_train, 2, timeout=600)


@pytest.fixture(scope="module")
def reference():
    with _one_thread():
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


@pytest.fixture(scope="module")
def family_reference():
    with _one_thread():
        return {f: reference_run(_family(f), _family_batches()) for f in FAMILIES}


def test_every_family_under_two_schedules_matches_one_process(trained, family_reference):
    failures = []
    for family, schedule in FAMILY_CASES:
        ref_losses, ref_state = family_reference[family]
        r0, r1 = (trained[r][("family", family, schedule)] for r in (0, 1))
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
    assert {s for _, s in FAMILY_CASES} == set(expected)
    for family, schedule in FAMILY_CASES:
        got = [trained[r][("family", family, schedule)]["stages"] for r in (0, 1)]
        assert got == expected[schedule], (family, schedule)
    seconds = {k[1:]: round(v["seconds"], 2) for k, v in trained[0].items() if k[0] == "family"}
    print("pp2 seconds per (family, schedule):", seconds)


def test_exported_pp_run_loads_with_from_pretrained(trained, tmp_path):
    """The whole model of a tied-embedding family's pp run, written as a model folder, loads
    with transformers' from_pretrained and gives the logits of that state exactly; the
    pipeline kept the head's copy equal to the embedding."""
    import transformers

    from meshfit.checkpoint.saved import save_model_folder

    state = trained[0][("family", EXPORTED, "1f1b")]["state"]
    model = _family(EXPORTED)
    assert model.config.tie_word_embeddings
    assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    save_model_folder(tmp_path / "model", state, model)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model",
                                                               dtype=torch.float64)
    model.load_state_dict(state)
    x = _family_batches()[0][0]
    with torch.no_grad():
        assert torch.equal(logits(loaded, x), logits(model, x))


def test_every_family_s_stages_run_like_the_model():
    """No spawn: each family cut into 4 stages (one layer each: for Gemma 2 and 3 a stage's
    first layer is not of the type the full list starts with), run one after another, gives
    the full model's logits exactly."""
    from meshfit.parallel.pp import build_stage_module

    x = _family_batches()[0][0]
    for family in FAMILIES:
        model = _family(family)
        reference = logits(model, x)
        h = x
        for s in range(LAYERS):
            h = build_stage_module(model, s, LAYERS, [1, 2, 3])(h)
        assert torch.equal(h, reference), family


def test_checkpointed_stages_recompute_on_the_stage_input():
    """No spawn: Granite (its forward multiplies inputs_embeds before the blocks) cut in 2
    stages with every block checkpointed: the backward pass recomputes the later stage's
    first block on that stage's input, so every gradient is the full model's."""
    from meshfit.parallel.activation import apply_activation_checkpointing
    from meshfit.parallel.pp import build_stage_module

    x, y = _family_batches()[0]
    model = _family("granite")
    torch.nn.functional.cross_entropy(logits(model, x).flatten(0, 1), y.flatten()).backward()
    stages = [apply_activation_checkpointing(build_stage_module(model, s, 2, [2]), "full")
              for s in (0, 1)]
    out = stages[1](stages[0](x))
    torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()).backward()
    grads = {n: p.grad for s in stages for n, p in s.named_parameters()}
    assert grads.keys() == dict(model.named_parameters()).keys()
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=1e-14, msg=name)
