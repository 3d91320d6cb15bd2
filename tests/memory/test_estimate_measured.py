"""The memory estimate (`meshfit.memory.estimate`) against what this machine measures.

**Layouts** (15, on 1, 2 and 4 gloo ranks; one spawn per world size): the `tiny` preset of
the reference GPT (0.86M parameters, 4 blocks, d 128, vocabulary 256, tied head, fp32,
attention_backend "flash"), 4 sequences of 256 tokens per micro-batch (4 micro-batches per
pipeline step), AdamW, through `Accelerator` as the layout tests drive it: one process;
DDP; ZeRO-1/2/3 on 2 ranks and ZeRO-3 on 4; ZeRO-3 + CPU offload; tp 2 with and without
sequence parallel; pp 2 (1F1B); dp_replicate 2 x tp 2; pp 2 x dp_replicate 2; ZeRO-3
dp_shard 2 x tp 2; context parallel cp 2, alone and under ZeRO-3 (sharded over cp). Each rank runs one optimizer step and one more forward and backward
(DDP rebuilds its buckets once, in the second step's forward: measured at +1 gradient copy
if the peak were taken there), keeping its gradients, then:

- **model states**: `rank_report` (parameters, gradients, optimizer state, on the live
  objects) against the estimate's params, grads and optimizer, within 2% on every rank (for
  pipelines, the estimate's worst rank against the largest rank). The estimate omits
  AdamW's 4-byte `step` per tensor (~300 B here) and ZeRO-1's whole-tensor partition; on
  this model both stay far below 2% (measured: <= 0.02%).
- **peak**: what the estimate claims to model is every byte held by live tensors at the
  step's peak: model states + saved activations + gathered parameters and gradient buffers.
  Measured: the rank's model states (`rank_report`, all present: gradients are kept) plus
  the largest net allocation during a forward and backward, from the profiler's allocation
  and free events in time order (`torch.profiler`, profile_memory=True; each event, not
  the per-op sums that `reference.forward_bytes` adds up), the smaller of two runs (an
  asynchronous gloo collective frees its input when its worker thread finishes, so one run
  can see a buffer or two more: up to 2 MiB here). The estimate within 10% of the largest
  rank's measured peak: it leaves out temporaries (a gradient being computed next to the
  activations it frees, the f-sized ones of the MLP's backward), the loss's third V-sized
  tensor and pipeline stages' send/receive buffers (measured: -0.7% to -8%; see
  src/meshfit/memory/estimate.py's known misses). One miss decides a layout's 10% and is
  added to the estimate here by name (`KNOWN_MISSES`, each checked to be missing): FSDP2's
  whole unsharded gradients under a pipeline (pp 2 x dp_replicate 2: -10.1% without it).

**Activations per block** (no spawn): one block's forward in fp32 under
`torch.autograd.graph.saved_tensors_hooks`, each storage counted once, parameters and
buffers left out, for the reference GPT (GELU / learned positions / LayerNorm, and SwiGLU /
RoPE / RMSNorm / GQA 4:2) with attention_backend "math" and "flash", and transformers'
Llama (GQA 4:2) and GPT-2 at test size, "eager" (= math) and "sdpa" (flash: no score
matrix; the estimate's attention="flash"). The closed form counts the tensors every
implementation must save; what one implementation saves beyond it is itemized (`_EXTRAS`,
per token):

    LayerNorm statistics          2 norms x (mean, rstd) x 4 B
    RMSNorm                       2 norms x (rstd 4 B + its normalized input, h elements)
    K/V repeated for GQA          2 (h - kv) elements (the reference GPT always, transformers
                                  "eager"; transformers "sdpa" passes enable_gqa: none)
    flash output copied           h elements (the reference GPT with RoPE: its rotated q is
                                  contiguous, so the kernel's output and wo's input differ)
    transformers' RoPE tables     cos and sin, 2 x head_dim x 4 B
    GPT-2's gelu_new              3f elements (tanh GELU written out: 4 f-sized tensors)

The closed form + the items must match within 1% (measured: exactly, on torch 2.13 and
transformers 5.24; the 1% leaves room for a small tensor another version may save); the
closed form alone is within 1% for the GELU GPT and 17-50% below for the others. Under
bf16 autocast (meshfit's mixed precision: fp32 master weights) the reference GPT saves
more, also itemized: the norm inputs stay fp32 (+2h x 2 B), each of q, k, v casts the fp32
normed input itself (+2h x 2 B), and the bf16 copies of the block's matmul weights live
from forward to backward (counted apart: the estimate has no term for them).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from conftest import case_result, run_cases, selected
from reference import hf_gpt2, hf_llama, tiny_preset
from meshfit.memory import (LayoutSpec, ModelShape, activation_bytes, estimate, net_peak_bytes,
                            rank_report)

pytestmark = pytest.mark.usefixtures("one_thread")

SEQ, MICRO, M = 256, 4, 4  # tokens per sequence, sequences per micro-batch, pp micro-batches
STATE_REL, PEAK_REL = 0.02, 0.10

# name: (world size, ParallelDims kwargs, Accelerator options, pipeline?, LayoutSpec kwargs)
LAYOUTS = {
    "one process": (1, {}, {}, False, {}),
    "ddp": (2, dict(dp_replicate=2), {}, False, dict(dp_replicate=2)),
    "zero1": (2, dict(dp_shard=2), dict(zero_stage=1), False, dict(dp_shard=2, zero_stage=1)),
    "zero2": (2, dict(dp_shard=2), dict(zero_stage=2), False, dict(dp_shard=2, zero_stage=2)),
    "zero3": (2, dict(dp_shard=2), dict(zero_stage=3), False, dict(dp_shard=2, zero_stage=3)),
    "zero3-offload": (2, dict(dp_shard=2), dict(zero_stage=3, offload="cpu"), False,
                      dict(dp_shard=2, zero_stage=3, offload="cpu")),
    "tp2": (2, dict(tp=2), {}, False, dict(tp=2)),
    "tp2-sp": (2, dict(tp=2), dict(sequence_parallel=True), False,
               dict(tp=2, sequence_parallel=True)),
    "pp2-1f1b": (2, dict(pp=2), {}, True, dict(pp=2, microbatches=M)),
    "zero3-dp4": (4, dict(dp_shard=4), dict(zero_stage=3), False,
                  dict(dp_shard=4, zero_stage=3)),
    "dp2xtp2": (4, dict(dp_replicate=2, tp=2), {}, False, dict(dp_replicate=2, tp=2)),
    "pp2xdp2": (4, dict(pp=2, dp_replicate=2), {}, True,
                dict(pp=2, dp_replicate=2, microbatches=M)),
    "fsdp2xtp2": (4, dict(dp_shard=2, tp=2), dict(zero_stage=3), False,
                  dict(dp_shard=2, tp=2, zero_stage=3)),
    "cp2": (2, dict(cp=2), {}, False, dict(cp=2)),
    "cp2-zero3": (2, dict(cp=2), dict(zero_stage=3), False, dict(cp=2, zero_stage=3)),
}


# ---------------------------------------------------------------------------- the ranks


def _measure(rank, world, name):
    from meshfit import Accelerator, ParallelDims

    _, dims, options, pipe, _ = LAYOUTS[name]
    acc = Accelerator(parallel=ParallelDims(**dims), **options) if dims else Accelerator()
    model = tiny_preset(attention_backend="flash")  # the same weights on every rank
    if pipe:
        model = acc.prepare_pipeline(model, schedule="1f1b", microbatches=M)
        measured = nn.ModuleList(model.wrapped_modules)
    else:
        model = measured = acc.prepare(model)
    opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, 256, (MICRO * (M if pipe else 1), SEQ + 1), generator=g)
    x, y = acc.shard_sequence(tokens[:, :-1], tokens[:, 1:])  # (under cp: this rank's part)

    def forward_backward():
        with acc.accumulate():
            if pipe:
                model.step(x, y)
            else:
                acc.backward(model(x, y))

    forward_backward()
    opt.step()  # the optimizer state exists from here; the gradients are kept
    forward_backward()  # DDP rebuilds its buckets in this forward: not the steady state
    report = rank_report(measured, opt)
    peak = min(net_peak_bytes(forward_backward) for _ in range(2))
    return {"report": report, "peak": report.total_bytes + peak}


@pytest.fixture(scope="module")
def measured(request):
    """Every selected layout, one spawn per world size (one process: in this process)."""
    names = selected(request, "name", list(LAYOUTS))
    out = {}
    for world in (1, 2, 4):
        cases = {n: (_measure, n) for n in names if LAYOUTS[n][0] == world}
        if world == 1:
            out.update({n: [_measure(0, 1, n)] for n in cases})
        elif cases:
            out.update(run_cases(cases, world, timeout=240))
    return out


# Terms the estimate leaves out that decide a layout's 10% here (src/meshfit/memory/
# estimate.py, known misses). FSDP2 under a pipeline: torch's schedules turn gradient sync off
# until the last micro-batch, so the stage's unsharded gradients accumulate whole beside the
# sharded ones: the stage's local parameters x 4 B (measured: the peak of pp 2 x
# dp_replicate 2 exceeds pp 2's by exactly 2 x that, the unsharded parameters and gradients;
# the estimate has the parameters). Without it: 10.1% below the measured peak.
KNOWN_MISSES: dict = {}  # (FSDP2's whole gradients under a pipeline: now in the estimate)


def _predicted(name):
    spec = LayoutSpec(micro_batch_size=MICRO, **LAYOUTS[name][4])
    est = estimate(ModelShape.of("tiny"), spec, seq_len=SEQ, dtype="fp32", attention="flash")
    states = est
    if spec.offload == "cpu":  # on the device: nothing; in host memory: the shares without
        states = estimate(ModelShape.of("tiny"), LayoutSpec(
            micro_batch_size=MICRO, **{**LAYOUTS[name][4], "offload": "none"}), seq_len=SEQ,
            dtype="fp32", attention="flash")
        assert (est.params, est.grads, est.optimizer) == (0, 0, 0)
        assert est.host == pytest.approx(states.params + states.grads + states.optimizer)
    # One memory here: host bytes count as much as device bytes.
    return est, (states.params, states.grads, states.optimizer), est.total + est.host


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_estimate_against_measured(measured, name):
    per_rank = measured[name] if LAYOUTS[name][0] == 1 else case_result(measured, name)
    est, states, peak = _predicted(name)
    reports = [r["report"] for r in per_rank]
    got = [(r.param_bytes, r.grad_bytes, r.optimizer_bytes) for r in reports]
    if LAYOUTS[name][3]:  # a pipeline: the estimate is the worst rank's
        got = [tuple(max(g[i] for g in got) for i in range(3))]
    for rank_states in got:
        for part, want, have in zip(("params", "grads", "optimizer"), states, rank_states):
            assert have == pytest.approx(want, rel=STATE_REL), (name, part)
    assert all(r.buffer_bytes == 0 for r in reports)  # the tiny preset has learned positions
    worst = max(r["peak"] for r in per_rank)
    if name in KNOWN_MISSES:  # a term the estimate leaves out: it must be missing, and be it
        missing = KNOWN_MISSES[name](est)
        assert peak < worst and worst - peak > missing / 2, (name, peak, worst)
        peak += missing
    assert peak == pytest.approx(worst, rel=PEAK_REL), (name, peak, worst)


# ---------------------------------------------------------------------------- one block
B, T = 2, 24  # 48 tokens: no activation has a weight's shape

_GPT_SWIGLU = dict(mlp="swiglu", pos="rope", norm="rmsnorm", n_kv_head=2, bias=False,
                   tie_embeddings=False)


def _gpt(backend, **kw):
    from meshfit.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, n_layer=2, n_head=4, d_model=64, d_ff=128,
                         max_seq_len=32, attention_backend=backend, **kw))


def _block_call(model):
    """(model, a function running its first block on hidden states [B, T, h])."""
    from meshfit.models import GPT

    if isinstance(model, GPT):
        block = model.layers["0"]
        rope = None if model.rope_cos is None else (model.rope_cos[:T], model.rope_sin[:T])
        return lambda x: block(x, rope)
    if hasattr(model, "transformer"):  # GPT-2
        return model.transformer.h[0]
    pos = torch.arange(T)[None].expand(B, T)
    block = model.model.layers[0]
    return lambda x: block(x, attention_mask=None, position_ids=pos,
                           position_embeddings=model.model.rotary_emb(x, pos))


def _saved_bytes(model, call, autocast: bool) -> tuple[int, int]:
    """(activation bytes, weight-copy bytes) one block's forward saves for backward: each
    storage once; parameters and buffers left out; autocast's copies of a parameter
    counted apart."""
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    params = list(model.parameters())
    seen: dict[int, tuple[int, bool]] = {}

    def pack(t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in own and ptr not in seen:
            views = [t, t.t()] if t.dim() == 2 else [t]  # a linear saves w or w.t()
            copy = any(v.dtype != p.dtype and v.shape == p.shape
                       and torch.equal(v, p.detach().to(v.dtype)) for v in views for p in params)
            seen[ptr] = (storage.nbytes(), copy)
        return t

    x = torch.randn(B, T, model.config.hidden_size if hasattr(model.config, "hidden_size")
                    else model.config.d_model, requires_grad=True)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with ctx, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = call(x)
    del out
    return (sum(n for n, copy in seen.values() if not copy),
            sum(n for n, copy in seen.values() if copy))


def _extras(items: dict, shape: ModelShape) -> float:
    """Bytes per token of the itemized extras (see the module docstring)."""
    h, f, kv, hd = shape.d_model, shape.d_ff, shape.kv_dim, shape.head_dim
    per_item = {"layernorm_stats": 2 * 2 * 4, "rmsnorm": 2 * (4 + 4 * h),
                "gqa_repeat": 2 * (h - kv) * 4, "flash_out_copy": h * 4,
                "rope_tables": 2 * hd * 4, "gelu_new": 3 * f * 4,
                "autocast_norm_inputs": 2 * h * 2, "autocast_qkv_casts": 2 * h * 2}
    return sum(per_item[k] for k in items)


# name: (builder, estimate attention, autocast, extras)
BLOCKS = {
    "gpt-gelu-math": (lambda: _gpt("math"), "math", False, ["layernorm_stats"]),
    "gpt-gelu-flash": (lambda: _gpt("flash"), "flash", False, ["layernorm_stats"]),
    "gpt-swiglu-math": (lambda: _gpt("math", **_GPT_SWIGLU), "math", False,
                        ["rmsnorm", "gqa_repeat"]),
    "gpt-swiglu-flash": (lambda: _gpt("flash", **_GPT_SWIGLU), "flash", False,
                         ["rmsnorm", "gqa_repeat", "flash_out_copy"]),
    "llama-eager": (lambda: hf_llama(dtype=torch.float32), "math", False,
                    ["rmsnorm", "gqa_repeat", "rope_tables"]),
    "llama-sdpa": (lambda: hf_llama(dtype=torch.float32), "flash", False,
                   ["rmsnorm", "rope_tables"]),
    "gpt2-eager": (lambda: hf_gpt2(dtype=torch.float32), "math", False,
                   ["layernorm_stats", "gelu_new"]),
    "gpt2-sdpa": (lambda: hf_gpt2(dtype=torch.float32), "flash", False,
                  ["layernorm_stats", "gelu_new"]),
    "gpt-gelu-flash-bf16-autocast": (lambda: _gpt("flash"), "flash", True,
                                     ["layernorm_stats", "autocast_norm_inputs",
                                      "autocast_qkv_casts"]),
}


@pytest.mark.parametrize("name", list(BLOCKS))
def test_block_activations_against_saved_tensors(name):
    build, attention, autocast, items = BLOCKS[name]
    model = build()
    if not hasattr(model, "layers"):  # transformers: the kernel as named
        model.config._attn_implementation = "eager" if attention == "math" else "sdpa"
    shape = ModelShape.from_module(model)
    dtype = "bf16" if autocast else "fp32"
    closed = activation_bytes(shape, LayoutSpec(micro_batch_size=B), seq_len=T, dtype=dtype,
                              attention=attention).per_block
    acts, copies = _saved_bytes(model, _block_call(model), autocast)
    assert acts == pytest.approx(closed + _extras(items, shape) * B * T, rel=0.01), \
        (name, acts, closed)
    if items == ["layernorm_stats"]:  # nothing but the norm statistics beyond the form
        assert acts == pytest.approx(closed, rel=0.01)
    if autocast:  # the bf16 copies of the block's matmul weights, held to backward
        block = model.layers["0"]
        assert copies == 2 * sum(m.weight.numel() for m in block.modules()
                                 if isinstance(m, nn.Linear))
    else:
        assert copies == 0


# ---------------------------------------------------------------------------- plan --validate
def test_validate_runs_the_plans_that_fit_this_machine():
    """`meshfit.plan_validate.validate` on the planner's top 3 plans for 2 processes
    (the tiny preset, the "cpu" device table) and one plan of 4 processes, which cannot run
    here: measured bytes as the test above measures them, within the same 10%."""
    from meshfit.plan import DEVICES, Cluster, search
    from meshfit.plan_validate import validate

    kwargs = dict(seq_len=128, global_batch_size=8, dtype="fp32")
    plans = search("tiny", Cluster(gpus_per_node=2, device=DEVICES["cpu"]),
                   checkpointing=("none",), **kwargs).plans[:3]
    four = search("tiny", Cluster(gpus_per_node=4, device=DEVICES["cpu"]),
                  checkpointing=("none",), **kwargs).plans[0]
    rows = validate([*plans, four], model="tiny", steps=2, nproc=2, **kwargs)
    assert [r["layout"] for r in rows] == [p.layout.describe() for p in [*plans, four]]
    for plan, row in zip(plans, rows):
        assert row["skipped"] is None
        assert row["predicted_bytes"] == plan.estimate.total + plan.estimate.host
        assert row["predicted_step_s"] == plan.step_time_s and row["measured_step_s"] > 0
        assert abs(row["bytes_error"]) < PEAK_REL, row
        assert row["time_error"] == pytest.approx(
            (row["predicted_step_s"] - row["measured_step_s"]) / row["measured_step_s"])
    assert rows[3]["skipped"].startswith("world size 4 != 2 processes")
    assert rows[3]["measured_bytes"] is None and rows[3]["time_error"] is None
