"""Tensor parallel for every transformers decoder: what meshfit's general plan refuses (one
line, before anything starts, naming the family and what works), and tp=2 x ZeRO-3 on 4
ranks with the export of what it trained.

The 2-rank proof (every family of `meshfit.models.families` under tp=2 + sequence + loss
parallel against one process, LoRA on Qwen3) runs in tests/parallel/test_tp.py's spawn; the
workers are in tests/parallel/tp_families.py.

tp=2 x ZeRO-3 (dp_shard=2) through the Accelerator: each data rank trains on its half of each
step's global batch, so the one-process reference takes the whole batch per step (the mean
of two equal halves' mean losses is the whole batch's). Tolerances as in
tests/parallel/test_tp.py's family matrix: fp64, 3 AdamW steps at lr 1e-3, so losses within
1e-10 relative and weights within S lr dg / eps = 3e-11 (atol 1e-10); DeepSeek-V3's router
computes in float32 (its own code), held to float32's bound there (measured 2.1e-9: its
gradient summed over the two data halves rounds differently). The exported folder
(`save_model_folder`, what `meshfit train` writes) loaded by `from_pretrained` computes
nothing differently from the trained model but the order of tensor parallel's split sums:
logits within 1e-10 (measured ~1e-15), where a fused projection left in the wrong layout or
a weight left untrained moves them by > 1e-3.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math

import pytest
import torch

from conftest import case_result, run_cases
from reference import token_batches
from tp_families import (ATOL, F32_ATOL, F32_LOSS_RTOL, FLOAT32, LR, RTOL, STEPS, B, T, VOCAB,
                         zero3_tp_export)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="needs transformers")

ZERO3_FAMILIES = ("llama", "qwen3", "phi3", "deepseek_v3")
EXPORTED = ("llama", "phi3")  # Phi-3: fused qkv_proj / gate_up_proj, gathered, kept in layout


# ---------------------------------------------------------------------------- refusals
def _config(name: str, *, shrink: bool = False, **sizes):
    """transformers' default `name` configuration (refusals read nothing else), or shrunk to
    test size where a model is built from it."""
    import transformers

    from meshfit.models.families import shrink_config

    config = getattr(transformers, name)()
    return shrink_config(config, **sizes) if shrink else config


REFUSED = {  # configuration -> what the one line says (a class of model per row)
    "BartConfig": "bart (BartConfig) is an encoder-decoder",
    "LlavaConfig": "llava (LlavaConfig) has a vision tower (vision_config)",
    "JambaConfig": "jamba (JambaConfig) mixes linear-attention or state-space layers",
    "Qwen3NextConfig": "qwen3_next (Qwen3NextConfig) mixes linear-attention or state-space "
                       "layers (linear_attention)",
    "DeepseekV2Config": "plan uses style 'mla_kv_a_proj'",
    "BioGptConfig": "biogpt (BioGptConfig) ships no tensor-parallel plan",
    # a routing bias on the MoE block no entry places: apply_tp refused it after launch
    "AfmoeConfig": "afmoe (AfmoeForCausalLM) has parameters its plan does not place",
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_the_general_plan_does_not_cover_is_refused_in_one_line(name):
    from meshfit.models.plans import tp_problem

    line = tp_problem(_config(name), 2)
    assert line is not None and "\n" not in line, line
    assert REFUSED[name] in line, line
    assert "ZeRO (parallel.dp_shard) and DDP work for it" in line, line


@pytest.mark.parametrize("sizes, tp, expect", [
    ({}, 3, "Qwen3Config.num_attention_heads=4 does not divide by tp=3 (each rank holds "
            "whole heads); use tp in [2, 4]"),
    ({}, 4, "Qwen3Config.num_key_value_heads=2 does not divide by tp=4"),
    ({"intermediate_size": 97}, 2, "Qwen3Config.intermediate_size=97 does not divide by tp=2"),
    ({"vocab_size": 129}, 2, "Qwen3Config.vocab_size=129 does not divide by tp=2; pad it to 130"),
])
def test_sizes_tp_must_divide_are_named(sizes, tp, expect):
    from meshfit.models.families import tiny_config
    from meshfit.models.plans import tp_problem

    line = tp_problem(tiny_config("qwen3", **sizes), tp)
    assert line.startswith("qwen3 (Qwen3ForCausalLM): tensor parallel") and expect in line, line
    assert "\n" not in line


def test_every_family_has_a_plan_and_the_accelerator_path_refuses_the_rest():
    """Every family of meshfit.models.families takes the general plan at tp=2 (from its
    configuration alone); a model that cannot is refused by `plan_for`, what
    `Accelerator.prepare` and `apply_tp` call, with the same line."""
    from meshfit.models.families import FAMILIES, tiny_config
    from meshfit.models.plans import has_tp_plan, plan_for, tp_problem
    from meshfit.models.plans.transformers_tp import meta_model

    assert {f: tp_problem(tiny_config(f), 2) for f in FAMILIES} == dict.fromkeys(FAMILIES)
    hybrid = meta_model(_config("Qwen3NextConfig", shrink=True))
    assert not has_tp_plan(hybrid)
    with pytest.raises(ValueError, match="qwen3_next .* mixes linear-attention or state-space"):
        plan_for(hybrid)


def test_a_module_between_split_projections_that_the_plan_does_not_name_is_refused():
    """Qwen3's per-head q/k norms sit between the column-split q/k and attention: with their
    'replicated_with_grad_allreduce' entries removed from the plan meshfit cannot know
    whether they see one head or all of them, and says so rather than guess (a replicated
    norm on the rank's heads would silently train each rank's copy apart)."""
    from meshfit.models.families import tiny_config
    from meshfit.models.plans import tp_problem

    cfg = tiny_config("qwen3")
    cfg.base_model_tp_plan = {k: v for k, v in cfg.base_model_tp_plan.items()
                              if not k.endswith("_norm")}
    line = tp_problem(cfg, 2)
    assert "self_attn.q_norm (Qwen3RMSNorm) between split projections with no style" in line


@pytest.mark.parametrize("family, nproc, args, expect", [
    ("qwen3", 3, ["--parallel.tp=3"], "parallel.tp: tensor parallel tp=3 does not fit the "
     "model: Qwen3Config.num_attention_heads=4 does not divide by tp=3"),
    ("Qwen3NextConfig", 2, ["--parallel.tp=2"], "parallel.tp=2: tensor parallel: qwen3_next "
     "(Qwen3NextConfig) mixes linear-attention or state-space layers"),
])
def test_meshfit_train_refuses_before_launch(cli_refusal, tmp_path, family, nproc, args,
                                             expect):
    from meshfit.models.families import tiny_config

    cfg = tiny_config(family, vocab_size=512) if family.islower() else \
        _config(family, shrink=True, vocab_size=512)
    cfg.save_pretrained(tmp_path / "model")
    line = cli_refusal("train", "--nproc", str(nproc), "--out", str(tmp_path / "run"),
                       f"--model.hf_config={tmp_path}/model", "--parallel.dp_replicate=1",
                       "--train.seq_len=16", *args)
    assert expect in line, line
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------- tp2 x zero3
@pytest.fixture(scope="module")
def zero3xtp2(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-export")
    results = run_cases({"zero3xtp2": (zero3_tp_export, ZERO3_FAMILIES, str(root), EXPORTED)},
                        4, timeout=300)
    return case_result(results, "zero3xtp2"), root


def _one_process(family: str):
    """The one-process run: the whole global batch each step; losses and final state."""
    from meshfit.models.families import tiny_model
    from meshfit.parallel.tp import tp_cross_entropy

    model = tiny_model(family, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    gx, gy = token_batches(STEPS * 2 * B, T, VOCAB, seed=1)
    losses = []
    for step in range(STEPS):
        rows = slice(step * 2 * B, (step + 1) * 2 * B)
        loss = tp_cross_entropy(model(input_ids=gx[rows], use_cache=False).logits, gy[rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, copy.deepcopy(model.state_dict())


@pytest.mark.parametrize("family", ZERO3_FAMILIES)
def test_tp2_x_zero3_matches_one_process(zero3xtp2, family):
    per_rank, _ = zero3xtp2
    got = per_rank[0][family]
    losses, state = _one_process(family)
    rtol, atol = (F32_LOSS_RTOL, F32_ATOL) if family in FLOAT32 else (RTOL, ATOL)
    for ref, ours in zip(losses, got["losses"], strict=True):
        assert math.isclose(ref, ours, rel_tol=rtol), (losses, got["losses"])
    assert set(got["state"]) == set(state)
    gaps = {k: (got["state"][k] - v).abs().max().item() for k, v in state.items()}
    worst = max(gaps, key=gaps.get)
    assert gaps[worst] < atol, (worst, gaps[worst])


@pytest.mark.parametrize("family", EXPORTED)
def test_a_tp_trained_model_exports_a_folder_from_pretrained_loads(zero3xtp2, family):
    import transformers

    per_rank, root = zero3xtp2
    folder = root / family
    assert json.loads((folder / "config.json").read_text())["model_type"] == family
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    probe = token_batches(2, T, VOCAB, seed=5)[0]
    with torch.no_grad():
        logits = model(input_ids=probe).logits
    for rank in range(4):  # every rank computed the same logits as the loaded model
        gap = (per_rank[rank][family]["logits"] - logits).abs().max().item()
        assert gap < ATOL, (rank, gap)


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "phi3", "deepseek_v3"])
def test_meshfit_train_takes_the_families_to_launch_with_tp2(cli_refusal, tmp_path, family):
    """`meshfit train --parallel.tp=2 --parallel.sequence_parallel=true` on a family's config
    passes every check before launch (on main: "has no built-in tensor-parallel plan"); the
    runs themselves are the matrix above."""
    from meshfit.models.families import tiny_config

    tiny_config(family, vocab_size=512).save_pretrained(tmp_path / "model")
    with pytest.raises(AssertionError, match="the arguments were accepted"):
        cli_refusal("train", "--nproc", "2", "--out", str(tmp_path / "run"),
                    f"--model.hf_config={tmp_path}/model", "--parallel.dp_replicate=1",
                    "--parallel.tp=2", "--parallel.sequence_parallel=true",
                    "--train.seq_len=16")
