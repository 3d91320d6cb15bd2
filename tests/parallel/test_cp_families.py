"""Context parallel for every transformers decoder family of `meshfit.models.families`
(`meshfit.parallel.cp_hf`: the ring registered in transformers' attention interface).

- Training: each family's tiny model (2 layers, fp64) under cp2, and cp2 x ZeRO-3 (FSDP2
  sharding over the 2 cp ranks, what meshfit's layout rules give 2 ranks) for a few, logs
  the one-process losses over 3 AdamW steps and ends with its weights. fp64, rtol 1e-9 as
  tests/parallel/test_cp.py derives it (the ring sums the same terms in another order,
  ~1e-16 per operation, grown by Adam over 3 steps; a token at the wrong position, a
  window applied to the wrong keys or a softcap dropped is off by > 1e-3). Sequences of 48
  tokens: with cp2's load balancing each rank holds chunks of 12, so the tiny configs'
  windows of 8 cut the diagonal block and the neighbour block and skip the rest. Covered
  this way: causal, GQA, q/k norms (Qwen3, OLMo 2, Gemma 3), sliding windows per layer
  (Gemma 2/3 alternate; Mistral's on every layer; Qwen3 and Mixtral with a window turned
  on), Gemma 2's attention logit softcapping, scaling from the module (Gemma's
  query_pre_attn_scalar, Granite's attention_multiplier), GPT-NeoX's partial rotary,
  SmolLM3's layers without RoPE, DeepSeek-V3's MLA with values narrower than keys, MoE;
  beyond the families module, Cohere 2 (alternating windows) and GPT-OSS (attention sinks).
  Every case runs on 2 ranks in one spawn.
- What each layer handed the ring (window, softcap) is recorded and checked against the
  configuration, so a window silently dropped on both sides cannot pass.
- Refusals (`cp_problem`, in-process): a class whose attention does not go through the
  interface, layer types the ring does not compute, bidirectional and chunked attention,
  attention dropout, an encoder-decoder; `meshfit train` refuses them in one line before
  launch; a padding mask is refused at the forward.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import case_result, run_cases
from reference import token_batches
from meshfit.models.families import FAMILIES

STEPS, ROWS, SEQ = 3, 2, 48
TRAIN_RTOL, TRAIN_ATOL = 1e-9, 1e-12
FP32_INSIDE = {"gemma2": "RMSNorm in float32", "gemma3_text": "RMSNorm in float32",
               "glm4_moe": "router in float32", "deepseek_v3": "router in float32",
               "cohere2": "LayerNorm in float32"}
"""Families whose fp64 model computes a part in float32 (transformers' code): a value rounded
to float32 (2^-24 = 6e-8 relative) rounds the same way in both runs unless a 1e-16
difference straddles a rounding boundary, and Adam's first steps (m/sqrt(v), insensitive to
a gradient's size) pass such a flip on to the weights it touches. Measured when written:
losses <= 7e-11 relative (inside TRAIN_RTOL), weights <= 4.7e-8 (DeepSeek-V3's embedding;
the others <= 7e-9). Bound: weights atol 1e-6, still 5,000x under what a dropped window
(1.8e-2) or a dropped softcap (5.7e-3) costs the weights."""
ISLAND_ATOL = 1e-6
VARIANTS = {**{f: (f, {}) for f in FAMILIES},
            # a cap the tiny model's scores reach (at Gemma 2's 50, tanh(s/50)·50 = s to
            # 1e-7 here: a dropped cap would not show)
            "gemma2": ("gemma2", dict(attn_logit_softcapping=1.0)),
            # values narrower than queries and keys (MLA): 8 against 16, kv heads = heads as
            # in DeepSeek-V3's own config (transformers' eager and SDPA paths repeat the
            # already-expanded MLA keys by heads / kv heads)
            "deepseek_v3": ("deepseek_v3", dict(v_head_dim=8, num_key_value_heads=4)),
            # windows on families whose tiny configs have none: per layer, and on all layers
            "qwen3+window": ("qwen3", dict(layer_types=["sliding_attention", "full_attention"],
                                           use_sliding_window=True, sliding_window=8)),
            "mixtral+window": ("mixtral", dict(sliding_window=8)),
            # beyond the families module: alternating layers with a window (Cohere 2),
            # attention sinks with alternating windows and MoE (GPT-OSS)
            "cohere2": ("cohere2", {}), "gpt_oss": ("gpt_oss", {})}
ZERO3 = ("llama", "gemma2", "mixtral", "qwen3_moe", "deepseek_v3")
"""Also under cp2 x ZeRO-3 (the parameters sharded over the 2 cp ranks)."""
CASES = [*(f"cp2/{v}" for v in VARIANTS), *(f"cp2-zero3/{v}" for v in ZERO3)]


def _variant_config(variant: str):
    import transformers

    from meshfit.models.families import shrink_config, tiny_config

    family, extra = VARIANTS[variant]
    sizes = {k: v for k, v in extra.items() if k in ("v_head_dim", "num_key_value_heads")}
    config = tiny_config(family, **sizes) if family in FAMILIES else shrink_config(
        transformers.AutoConfig.for_model(family), vocab_size=128)
    for key, value in extra.items():
        setattr(config, key, value)
    return config


def _build(variant: str):
    import transformers

    from meshfit.models.families import MOE_FAMILIES

    family, _ = VARIANTS[variant]
    config = _variant_config(variant)
    options = {"experts_implementation": "eager"} if family in (*MOE_FAMILIES, "gpt_oss") \
        else {}
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, **options).double()


def _fp64_softmax(x, dim=None, _stacklevel=3, dtype=None):
    """torch's softmax, kept in float64 for float64 input: the one-process reference of
    Gemma 2 runs transformers' eager attention (no SDPA with softcapping), which asks for
    its softmax in float32; the ring's is float64."""
    real = _fp64_softmax.real
    return real(x, dim=dim, dtype=torch.float64 if x.dtype == torch.float64 else dtype)


_fp64_softmax.real = F.softmax


def _train(rank, world_size, layout: str | None, variant: str) -> dict:
    from meshfit import Accelerator, ParallelDims
    from meshfit.parallel import cp

    seen = set()
    softmax = F.softmax
    if layout is None:
        acc = Accelerator(mixed_precision="no")
        if VARIANTS[variant][0] == "gemma2":  # (its eager attention: float32 otherwise)
            F.softmax = _fp64_softmax
    else:
        acc = Accelerator(parallel=ParallelDims(cp=2, dp_replicate=1), mixed_precision="no",
                          zero_stage=3 if layout == "cp2-zero3" else 0)
        ring = cp.ring_attention

        def recorded(*args, window=None, softcap=None, **kwargs):
            seen.add((window, softcap))
            return ring(*args, window=window, softcap=softcap, **kwargs)

        cp.ring_attention = recorded
    try:
        model = acc.prepare(_build(variant))
        opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=3e-3))
        x, y = token_batches(STEPS * ROWS, SEQ, vocab_size=128)
        losses = []
        for step in range(STEPS):
            xs, ys = acc.shard_sequence(x[step * ROWS:(step + 1) * ROWS],
                                        y[step * ROWS:(step + 1) * ROWS])
            logits = model(input_ids=xs).logits  # a float64 loss (transformers' upcasts)
            loss = F.cross_entropy(logits.flatten(0, 1), ys.flatten())
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(acc.reduce(loss.detach(), "mean").item())
        state = acc.get_state_dict(model)
    finally:
        F.softmax = softmax
        if layout is not None:
            cp.ring_attention = ring
    return {"losses": losses, "state": {k: v.clone() for k, v in state.items()},
            "seen": seen}


def _refused_at_prepare(rank, world_size) -> str:
    """`Accelerator.prepare` of a model cp cannot run: the ValueError's line."""
    from meshfit import Accelerator, ParallelDims
    from meshfit.models.families import tiny_model

    acc = Accelerator(parallel=ParallelDims(cp=2, dp_replicate=1), mixed_precision="no")
    model = tiny_model("qwen3")
    model.config.attention_dropout = 0.1
    try:
        acc.prepare(model)
    except ValueError as err:
        return str(err)
    return "accepted"


@pytest.fixture(scope="module")
def trained():
    one = {v: _train(0, 1, None, v) for v in VARIANTS}
    cases = {case: (_train, *case.split("/")) for case in CASES}
    cases["refused"] = (_refused_at_prepare,)
    return one, run_cases(cases, 2, timeout=420)


def test_prepare_refuses_what_cp_cannot_run_in_one_line(trained):
    for line in case_result(trained[1], "refused"):
        assert line.startswith("context parallel (cp=2): attention_dropout=0.1 is not "
                               "available") and "\n" not in line, line


def _expected(variant: str) -> set:
    """(window, softcap) pairs the layers of `variant` must hand the ring, from its
    configuration alone."""
    family, _ = VARIANTS[variant]
    cfg = _variant_config(variant)
    cap = getattr(cfg, "attn_logit_softcapping", None) if family == "gemma2" else None
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if window is None or (types is not None and "sliding_attention" not in types):
        return {(None, cap)}
    if types is None:
        return {(window, cap)}
    return {(window if t == "sliding_attention" else None, cap) for t in types}


@pytest.mark.parametrize("case", CASES)
def test_every_family_under_context_parallel_trains_like_one_process(trained, case):
    one, runs = trained
    layout, variant = case.split("/")
    got = case_result(runs, case)[0]
    want = one[variant]
    assert got["seen"] == _expected(variant)
    atol = ISLAND_ATOL if VARIANTS[variant][0] in FP32_INSIDE else TRAIN_ATOL
    assert got["losses"] == pytest.approx(want["losses"], rel=TRAIN_RTOL)
    for key, value in want["state"].items():
        torch.testing.assert_close(got["state"][key], value, rtol=TRAIN_RTOL, atol=atol,
                                   msg=key)


# ------------------------------------------------------------------ refusals, in-process
def _config(model_type: str, **fields):
    import transformers

    config = transformers.AutoConfig.for_model(model_type)
    for key, value in fields.items():
        setattr(config, key, value)
    return config


REFUSED = {  # one per class: (model type, fields) -> words of the one line
    "attention outside the interface": (("qwen3_next", {}), [
        "model_type 'qwen3_next'", "Qwen3NextForCausalLM's attention does not go through "
        "transformers' attention interface", "ZeRO and DDP (cp=1) run it"]),
    "linear-attention layers": (("minimax", {}), ["'linear_attention' layers (layer_types)"]),
    "chunked attention": (("llama", dict(attention_chunk_size=64)),
                          ["chunked attention (attention_chunk_size=64)"]),
    "bidirectional attention": (("gemma3_text", dict(use_bidirectional_attention=True)),
                                ["bidirectional attention is not available"]),
    "attention dropout": (("qwen3", dict(attention_dropout=0.1)),
                          ["attention_dropout=0.1 is not available", "set it to 0"]),
    "an encoder-decoder": (("t5", {}), ["model_type 't5' has no causal decoder"]),
    # (its attention class is not marked for the interface: it was refused only at prepare)
    # (a composite configuration: the layer types are its text configuration's; Llama 4's
    # chunked layers were refused only at prepare)
    "chunked layers of a composite configuration": (("llama4", {}), [
        "model_type 'llama4' has 'chunked_attention' layers (layer_types)"]),
    "no attention layer to replace": (("doge", {}), [
        "DogeForCausalLM has no attention layer the ring can replace",
        "ZeRO and DDP (cp=1) run it"]),
}


@pytest.mark.parametrize("name", REFUSED)
def test_cp_problem_refuses_each_class_in_one_line(name):
    from meshfit.parallel.cp_hf import cp_problem

    (model_type, fields), words = REFUSED[name]
    line = cp_problem(_config(model_type, **fields), 2)
    assert line is not None and "\n" not in line
    for word in words:
        assert word in line, line


def test_cp_problem_accepts_every_family_and_its_windows():
    """Every family's configuration (sliding windows, softcapping included: the old check
    refused Mistral's window), a model instance, meshfit's GPT; cp=1 always; a length that
    does not split into 2 x cp chunks is named; check_hf_config, the old name, agrees."""
    from meshfit.models.families import tiny_config, tiny_model
    from meshfit.models.gpt import GPTConfig
    from meshfit.parallel.cp import check_hf_config
    from meshfit.parallel.cp_hf import cp_problem

    for family in FAMILIES:
        assert cp_problem(tiny_config(family), 2) is None, family
    mistral = _config("mistral", sliding_window=16)
    assert cp_problem(mistral, 4, 64) is None and check_hf_config(mistral, 64) is None
    assert cp_problem(tiny_model("gemma3_text"), 2) is None
    assert cp_problem(_config("qwen3_next"), 1) is None
    assert "split into 4 equal chunks" in cp_problem(tiny_config("llama"), 2, 30)
    assert cp_problem(GPTConfig(dropout=0.0), 2) is None
    assert "dropout=0.1" in cp_problem(GPTConfig(dropout=0.1), 2)
    assert "neither meshfit's GPT nor a transformers model" in cp_problem(
        torch.nn.Linear(2, 2), 2)


def test_padding_and_foreign_masks_are_refused_at_the_forward():
    """The forward pre-hook: a padding mask refused, a mask of all ones dropped, the tokens'
    global positions filled in; the attention function: a mask of the model's own making, a
    bidirectional layer, a layer the ring was not given, packed sequences' offsets."""
    from meshfit.parallel import cp_hf

    class Shard:  # cp2, rank 1, balanced: tokens 2..5 of 8 (chunks 1 and 2)
        size, rank, balanced, group = 2, 1, True, None

        def positions(self, n, device=None):
            from meshfit.parallel.cp import sequence_positions
            return sequence_positions(n * 2, 2, 1, True, device)

    place = cp_hf._placer(Shard(), True)
    ids = torch.zeros(2, 4, dtype=torch.long)
    _, kwargs = place(None, (), {"input_ids": ids, "attention_mask": torch.ones(2, 4)})
    assert kwargs["attention_mask"] is None and kwargs["use_cache"] is False
    assert kwargs["position_ids"].tolist() == [[2, 3, 4, 5]] * 2
    with pytest.raises(ValueError, match="attention_mask with padding is not available"):
        place(None, (), {"input_ids": ids, "attention_mask": torch.tensor([[0, 1, 1, 1]] * 2)})
    q = torch.zeros(1, 2, 4, 8)
    module = torch.nn.Module()
    with pytest.raises(ValueError, match="was not prepared for the ring"):
        cp_hf._ring(module, q, q, q, None)
    module.sequence_shard = Shard()
    for mask, words in ((torch.zeros(1, 1, 4, 4), "a mask of the model's own making"),
                        (cp_hf.RingMask(custom=True), "a mask of the model's own making"),
                        (cp_hf.RingMask(bidirectional=True), "attends bidirectionally")):
        with pytest.raises(ValueError, match=words):
            cp_hf._ring(module, q, q, q, mask)
    with pytest.raises(ValueError, match=r"passes cu_seq_lens_q to its attention \(packed"):
        cp_hf._ring(module, q, q, q, None, cu_seq_lens_q=torch.zeros(3))
