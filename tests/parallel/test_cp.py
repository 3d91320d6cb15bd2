"""Context parallelism (`meshfit.parallel.cp`): the sequence split over cp ranks, causal
attention as a ring of key/value blocks.

- The ring against unsharded attention (torch's `scaled_dot_product_attention`, causal, on
  the whole sequence in one process): on cp = 2 and 4 gloo ranks, with head-tail load
  balancing and without, each block on torch's fused CPU kernel and as matmuls, with
  grouped-query attention (4 query heads on 2 kv heads), with sliding windows that cut and
  skip blocks, softcapping, values narrower than keys and attention sinks (against
  attention written out densely; the sinks' gradient summed over the ranks), the output
  and the gradients of q, k and v of each rank's tokens equal that part of the unsharded
  ones. fp64: the ring sums the same terms in another order (blocks merged by log-sum-exp),
  ~1e-16 relative per operation over a few dozen operations; the tolerance is 1e-12, while
  a misplaced chunk, a wrong mask or a lost dk/dv block is off by > 1e-2.
- Training through `Accelerator(parallel=ParallelDims(cp=...))` and `shard_sequence`: the
  reference GPT (RoPE with grouped-query attention, and learned positions) under cp2, cp4,
  cp2 x ZeRO-1/2/3 (sharded over the cp ranks), cp2 x dp2, cp2 x ZeRO-3 over dp_shard 2
  (dp_shard_cp = 4), cp2 x tp2 (with and without sequence parallel) and cp2 x pp2, balanced
  and not; transformers' Llama, Qwen2 and Mistral (attention swapped through transformers'
  attention interface) under cp2 x tp2 + SP (Llama also cp4; cp2 and cp2 x ZeRO-3 of every
  transformers family: tests/parallel/test_cp_families.py); the reference GPT's mixture of
  experts (dropless routing, no auxiliary loss) under cp2 and cp2 x ZeRO-3; logs the
  one-process losses over 3 AdamW steps and ends with its weights (fp64, 1e-9: the order of
  sums only, grown by Adam; a token placed at the wrong position or a gradient averaged over
  the wrong ranks is off by > 1e-3).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import case_result, run_cases
from reference import tiny_gpt, token_batches
from meshfit.parallel.cp import (chunk_ids, sequence_positions, shard_sequence,
                                 unshard_sequence)

RTOL, ATOL = 1e-12, 1e-13


def _inputs(T: int, seed: int = 0, dv: int = 8):
    g = torch.Generator().manual_seed(seed)
    B, H, HKV, D = 2, 4, 2, 8
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, HKV, T, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, HKV, T, dv, generator=g, dtype=torch.float64)
    dout = torch.randn(B, H, T, dv, generator=g, dtype=torch.float64)
    return q, k, v, dout


def _dense(q, k, v, window, softcap, sinks=None):
    """Attention over the whole sequence as written in transformers' eager path: scores
    scaled, capped, masked (causal, and i - j < window), a sink column per head (GPT-OSS),
    softmax, the sink's column dropped, values."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    i = torch.arange(q.shape[2])
    d = i.unsqueeze(1) - i
    keep = (d >= 0) & (d < (window or q.shape[2] + 1))
    s = s.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.view(1, -1, 1, 1).expand(*s.shape[:3], 1)], dim=-1)
        return torch.softmax(s, -1)[..., :-1] @ v
    return torch.softmax(s, -1) @ v


def _sinks(with_sinks: bool):
    return torch.linspace(-1.0, 2.0, 4, dtype=torch.float64) if with_sinks else None


def _reference(T: int, window=None, softcap=None, dv: int = 8, sinks: bool = False):
    q, k, v, dout = (t.requires_grad_() if i < 3 else t for i, t in
                     enumerate(_inputs(T, dv=dv)))
    s = _sinks(sinks)
    if sinks:
        out = _dense(q, k, v, window, softcap, s.requires_grad_())
        out.backward(dout)
        return out.detach(), q.grad, k.grad, v.grad, s.grad
    if window is None and softcap is None and dv == 8:  # torch's own kernel, causal
        groups = q.shape[1] // k.shape[1]
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1),
                                             v.repeat_interleave(groups, 1), is_causal=True)
    else:
        out = _dense(q, k, v, window, softcap)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _ring_case(rank, world_size, T: int, balanced: bool, kernel: bool, window=None,
               softcap=None, dv: int = 8, sinks: bool = False):
    import torch.distributed as dist

    from meshfit.parallel import cp
    from meshfit.parallel.cp import ring_attention

    used = []
    real = cp._kernel
    def chosen(q):
        name = real(q) if kernel else None
        used.append(name is not None)
        return name

    cp._kernel = chosen
    min_sub, cp._MIN_SUB = cp._MIN_SUB, 1  # chunk pairs a window cuts: split, however small

    q, k, v, dout = _inputs(T, dv=dv)
    part = [shard_sequence(t, 2, world_size, rank, balanced) for t in (q, k, v, dout)]
    q, k, v = (t.requires_grad_() for t in part[:3])
    s = _sinks(sinks)
    if sinks:
        s.requires_grad_()
    out = ring_attention(q, k, v, dist.group.WORLD, balanced=balanced, window=window,
                         softcap=softcap, sinks=s)
    out.backward(part[3])
    cp._kernel, cp._MIN_SUB = real, min_sub
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad,
            "dsinks": s.grad if sinks else None, "kernel": set(used)}


# each split on the fused CPU kernel and on the matmul form
CASES = {f"cp{cp}-{'balanced' if b else 'contiguous'}-{'kernel' if k else 'matmul'}":
         (cp, b, k, {}) for cp in (2, 4) for b in (True, False) for k in (True, False)}
# sliding windows cutting the chunks (cp2: chunks of 4 tokens, a window of 6 cuts the
# neighbour chunk and the one before it, skips the rest; cp4 contiguous, chunks of 8, and a
# window of 3 cuts the diagonal too), softcapping, values narrower than keys (MLA)
CASES.update({
    "cp2-balanced-window6-softcap-mla": (2, True, True, dict(window=6, softcap=2.0, dv=4)),
    "cp2-contiguous-window6": (2, False, True, dict(window=6)),
    "cp4-balanced-window3-softcap": (4, True, True, dict(window=3, softcap=1.5)),
    "cp4-contiguous-window3": (4, False, True, dict(window=3)),
    # attention sinks (GPT-OSS), on the fused kernel's blocks and with a window
    "cp2-balanced-sinks": (2, True, True, dict(sinks=True)),
    "cp4-balanced-window3-sinks": (4, True, True, dict(window=3, sinks=True)),
})


@pytest.fixture(scope="module")
def rings():
    results = {}
    for cp in (2, 4):
        results.update(run_cases({name: (_ring_case, 8 * cp, b, k, extra.get("window"),
                                         extra.get("softcap"), extra.get("dv", 8),
                                         extra.get("sinks", False)) for
                                  name, (n, b, k, extra) in CASES.items() if n == cp},
                                 cp, timeout=120))
    return results


@pytest.mark.parametrize("name", CASES)
def test_ring_attention_equals_unsharded_attention(rings, name):
    cp, balanced, kernel, extra = CASES[name]
    per_rank = case_result(rings, name)
    # the path named was taken (a window, a cap or narrow values: the matmul form too)
    assert all(r["kernel"] == {kernel} if not extra else r["kernel"] <= {True, False}
               for r in per_rank)
    want = dict(zip(("out", "dq", "dk", "dv", "dsinks"), _reference(8 * cp, **extra)))
    if "dsinks" in want:  # a parameter: each rank's part of its gradient, summed
        torch.testing.assert_close(sum(r["dsinks"] for r in per_rank), want.pop("dsinks"),
                                   rtol=RTOL, atol=ATOL, msg=f"{name} dsinks")
    for key, full in want.items():
        got = unshard_sequence([r[key] for r in per_rank], 2, balanced)
        torch.testing.assert_close(got, full, rtol=RTOL, atol=ATOL, msg=f"{name} {key}")


def test_a_fused_kernel_is_used_only_where_it_matches_the_matmul_form(monkeypatch):
    """The probe that admits SDPA's CUDA kernels (run here on the CPU kernel and on broken
    stand-ins): a kernel equal to the matmul form is accepted, one off by a little or one
    that raises (a private op whose signature moved) is not."""
    from meshfit.parallel import cp

    like = torch.empty(1, 1, 1, 16)
    assert cp._probe("cpu_flash", like)
    forward, backward = cp._KERNELS["cpu_flash"]

    def off(*args):
        out, lse = forward(*args)
        return out * 1.001, lse

    def raises(*args):
        raise RuntimeError("_scaled_dot_product_flash_attention_backward() takes 14 arguments")

    monkeypatch.setitem(cp._KERNELS, "off", (off, backward))
    monkeypatch.setitem(cp._KERNELS, "raises", (forward, raises))
    assert not cp._probe("off", like) and not cp._probe("raises", like)


@pytest.mark.parametrize("min_sub", [1, 32])
def test_the_blocks_cover_each_visible_key_once(monkeypatch, min_sub):
    """The ring's blocks (`_pairs`: skipped, whole, causal, banded, and chunk pairs a window
    cuts split into smaller blocks) against the dense mask of the chunks' global positions
    (key seen where 0 <= query - key < window): every visible (query, key) pair in exactly
    one block, no hidden one in any."""
    from meshfit.parallel import cp

    monkeypatch.setattr(cp, "_MIN_SUB", min_sub)
    for c, window, n, balanced in [(c, w, n, b) for c in (4, 6, 12, 64)
                                   for w in (None, 1, 3, 5, 8, 13, 200)
                                   for n in (2, 3) for b in (True, False)]:
        for rank in range(n):
            for step in range(n):
                mine, theirs = chunk_ids(n, rank, balanced), chunk_ids(n, (rank - step) % n,
                                                                         balanced)
                got = torch.zeros(c * len(mine), c * len(theirs), dtype=torch.int)
                for qs, ks, band in cp._pairs(mine, theirs, c, window):
                    size = qs.stop - qs.start
                    got[qs, ks] += (torch.ones(size, size, dtype=torch.int) if band is None
                                    else cp._band(size, size, band, None).int())
                d = torch.cat([torch.arange(x * c, (x + 1) * c) for x in mine]).unsqueeze(1) \
                    - torch.cat([torch.arange(x * c, (x + 1) * c) for x in theirs])
                want = ((d >= 0) & (d < (window or d.max() + 1))).int()
                assert torch.equal(got, want), (c, window, n, balanced, rank, step)


def test_sharding_round_trip_and_positions():
    t = torch.arange(2 * 24).view(2, 24)
    for cp in (1, 2, 3):
        for balanced in (True, False):
            parts = [shard_sequence(t, 1, cp, r, balanced) for r in range(cp)]
            assert torch.equal(unshard_sequence(parts, 1, balanced), t)
            for r in range(cp):  # positions are the tokens' own indices here
                assert torch.equal(sequence_positions(24, cp, r, balanced), parts[r][0])
    # head-tail: rank 0 holds the first and the last chunk, rank 1 the two middle ones
    assert chunk_ids(2, 0) == (0, 3) and chunk_ids(2, 1) == (1, 2)
    assert sequence_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="a sequence of 10 tokens does not split into 4 "
                                         "equal chunks"):
        shard_sequence(torch.zeros(1, 10), 1, 2, 0)


# ------------------------------------------------------------------ training layouts
STEPS, GLOBAL, SEQ = 3, 4, 32
LAYOUTS = {  # name: (processes, ParallelDims, Accelerator options)
    "cp2": (2, dict(cp=2, dp_replicate=1), {}),
    "cp2-contiguous": (2, dict(cp=2, dp_replicate=1), dict(cp_load_balance=False)),
    "cp2-zero1": (2, dict(cp=2, dp_replicate=1), dict(zero_stage=1)),
    "cp2-zero2": (2, dict(cp=2, dp_replicate=1), dict(zero_stage=2)),
    "cp2-zero3": (2, dict(cp=2, dp_replicate=1), dict(zero_stage=3)),
    "cp4": (4, dict(cp=4, dp_replicate=1), {}),
    "cp2xdp2": (4, dict(cp=2, dp_replicate=2), {}),
    "cp2xzero3": (4, dict(cp=2, dp_shard=2, dp_replicate=1), dict(zero_stage=3)),
    "cp2xtp2": (4, dict(cp=2, tp=2, dp_replicate=1), dict(zero_stage=3)),
    "cp2xtp2-sp": (4, dict(cp=2, tp=2, dp_replicate=1), dict(zero_stage=1,
                                                            sequence_parallel=True)),
    "cp2xpp2": (4, dict(cp=2, pp=2, dp_replicate=1), dict(zero_stage=1)),
}
MODELS = {"rope-gqa": dict(pos="rope", n_kv_head=2), "learned": dict(pos="learned"),
          # dropless routing, no auxiliary losses: each token's experts whatever the layout
          "moe": dict(pos="rope", n_experts=4, top_k=2, aux_loss_coef=0.0,
                      router_z_loss_coef=0.0),
          "hf-llama": None, "hf-qwen2": None, "hf-mistral": None}
# transformers' models: these (cp2 and cp2 x ZeRO-3 of every family, Mixtral's too, run in
# tests/parallel/test_cp_families.py's spawn)
HF_LAYOUTS = ("cp4", "cp2xtp2-sp")
MOE_LAYOUTS = ("cp2", "cp2-zero3")  # (mixtures of experts: these)


def _build(model_name: str):
    import transformers

    from reference import hf_llama, hf_qwen2

    if model_name == "hf-llama":
        return hf_llama()
    if model_name == "hf-qwen2":
        return hf_qwen2()
    if model_name == "hf-mistral":
        torch.manual_seed(0)
        cfg = transformers.MistralConfig(hidden_size=64, intermediate_size=128,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         num_hidden_layers=2, vocab_size=256,
                                         max_position_embeddings=32, sliding_window=None)
        return transformers.MistralForCausalLM(cfg).double()
    return tiny_gpt(max_seq_len=SEQ, **MODELS[model_name])


def _cases(nproc: int):
    def runs(model_name: str, name: str) -> bool:
        if model_name == "moe":
            return name in MOE_LAYOUTS
        if model_name in ("hf-qwen2", "hf-mistral"):  # Llama's attention path, other classes
            return name == "cp2xtp2-sp"
        return not model_name.startswith("hf") or name in HF_LAYOUTS

    return {f"{name}/{m}": (_train, name, m) for name, (n, _, _) in LAYOUTS.items()
            if n == nproc for m in MODELS if runs(m, name)}
TRAIN_RTOL = 1e-9


def _train(rank, world_size, name: str | None, model_name: str) -> dict:
    from meshfit import Accelerator, ParallelDims

    if name is None:
        acc = Accelerator(mixed_precision="no")
    else:
        _, dims, options = LAYOUTS[name]
        acc = Accelerator(parallel=ParallelDims(**dims), mixed_precision="no", **options)
    gpt = _build(model_name)
    if acc.parallel.pp > 1:
        model = acc.prepare_pipeline(gpt, schedule="1f1b", microbatches=2)
        train_step = model.step
    else:
        model = acc.prepare(gpt)

        def train_step(xs, ys):
            if model_name.startswith("hf"):
                out = model(input_ids=xs).logits
                loss = F.cross_entropy(out.flatten(0, 1), ys.flatten())
            else:
                loss = model(xs, ys)
            acc.backward(loss)
            return loss
    opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=3e-3))
    x, y = token_batches(STEPS * GLOBAL, SEQ)
    dp, r = acc.runtime.dp_size, acc.runtime.dp_rank
    per = GLOBAL // dp
    losses = []
    for step in range(STEPS):
        rows = slice(step * GLOBAL + r * per, step * GLOBAL + (r + 1) * per)
        loss = train_step(*acc.shard_sequence(x[rows], y[rows]))
        opt.step()
        opt.zero_grad()
        losses.append(acc.reduce(loss.detach(), "mean").item())
    state = acc.get_state_dict(model)
    return {"losses": losses, "state": {k: v.clone() for k, v in state.items()}}


@pytest.fixture(scope="module")
def trained():
    one = {m: _train(0, 1, None, m) for m in MODELS}
    runs = {}
    for nproc in (2, 4):
        runs.update(run_cases(_cases(nproc), nproc, timeout=300))
    return one, runs


@pytest.mark.parametrize("case", [*_cases(2), *_cases(4)])
def test_context_parallel_layouts_train_like_one_process(trained, case):
    one, runs = trained
    name, model_name = case.split("/")
    got = case_result(runs, case)[0]
    want = one[model_name]
    assert got["losses"] == pytest.approx(want["losses"], rel=TRAIN_RTOL)
    for key, value in want["state"].items():
        torch.testing.assert_close(got["state"][key], value, rtol=TRAIN_RTOL, atol=1e-12,
                                   msg=key)
