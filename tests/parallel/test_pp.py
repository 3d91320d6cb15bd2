"""Pipeline parallel (pp=2, gloo, CPU) against a single-process reference.

One spawn trains every schedule in turn, each on a fresh model built from one seed: the ranks
return their losses and stage parameters; the parent trains the single-process reference on
the same global batch and compares, after reassembling the full model from both ranks.

Tolerances: float64 throughout (in fp32, Adam would turn rounding noise of 1e-8 into 1e-4
parameter differences). A pipeline changes only the order of sums: the batch is cut into
micro-batches whose gradients are accumulated one after another, and the tied embedding's two
copies' gradients are added across ranks, ~1e-16 relative per op; AdamW (lr 3e-3, eps 1e-8,
5 steps) can amplify that to at most ~1.5e-10 on a parameter whose gradient is near eps (the
bound is derived in tests/reference.py). Measured over 5 seeds (the meta-built 1f1b run at
seed 0 only: build_pipeline materialises seed 0): losses <= 4e-16 relative, parameters
<= 5.6e-14 apart. So losses must agree to rtol 1e-10 and parameters to atol 1e-10
(~2000x the largest measured), while a real mistake fails by orders of magnitude (measured:
no tied-gradient sum, or micro-batch means averaged while one micro-batch holds ignored
targets, give loss gaps ~1e-2 and parameter gaps ~3e-2).
"""

from __future__ import annotations

import dataclasses
import math
import time
import types

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from conftest import run_distributed
from reference import idle_share, mean_ce, reference_run, tiny_gpt, token_batches
from meshfit.models import GPT, GPTConfig
from meshfit.parallel import pp
from meshfit.parallel.pp import build_pipeline, build_stage_module, check_pipeline, split_points

# The parent's one-process references are tiny models: one intra-op thread (see conftest).
pytestmark = pytest.mark.usefixtures("one_thread")

CFG = dataclasses.replace(GPTConfig.preset("tiny"), n_layer=4, d_model=64, n_head=4, d_ff=128,
                          max_seq_len=16)
STEPS, B, T, MB = 5, 8, 16, 4
# Measured over 5 seeds: losses <= 4e-16 relative, parameters <= 5.6e-14 apart (docstring).
LOSS_RTOL, PARAM_ATOL = 1e-10, 1e-10
# name, pipeline kwargs: every schedule, plus naive model parallelism and a user loss_fn.
RUNS = [
    ("gpipe", dict(schedule="gpipe", microbatches=MB)),
    ("1f1b", dict(schedule="1f1b", microbatches=MB)),
    ("interleaved_1f1b", dict(schedule="interleaved_1f1b", microbatches=MB, virtual_stages=2)),
    ("zero_bubble", dict(schedule="zero_bubble", microbatches=MB)),
    ("naive", dict(schedule="gpipe", microbatches=1)),
    ("1f1b-user-loss", dict(schedule="1f1b", microbatches=MB, points=[1])),
]


def _batch(ignore: bool = True, seed: int = 1):
    x, y = token_batches(B, T, CFG.vocab_size, seed=seed)
    if ignore:
        y[0, :5] = -100  # ignored targets in one micro-batch only: exact weighting matters
    return x, y


def _model(meta: bool = False) -> GPT:
    # init_weights from a seeded generator (reference.tiny_gpt): the values a meta-built
    # pipeline materialises (build_pipeline's init_seed=0), independent of the global RNG.
    if meta:  # float32 like the reference's init; cast to float64 once materialised
        with torch.device("meta"):
            return GPT(CFG)
    return tiny_gpt(n_layer=4, max_seq_len=T)


def _reference(ignore: bool):
    return reference_run(_model(), [_batch(ignore)] * STEPS)


def _train_pipelines(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("pp",))
    out = {}
    for name, kw in RUNS:
        user_loss = name.endswith("user-loss")
        meta = name == "1f1b"  # one run builds on the meta device: same values as the full
        pipe = build_pipeline(_model(meta), mesh, loss_fn=mean_ce if user_loss else None, **kw)
        if meta:
            for m in pipe.modules:
                m.double()
        x, y = _batch(ignore=not user_loss)  # a per-micro-batch mean cannot weight ignores
        opt = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
        losses, t0 = [], time.perf_counter()
        for _ in range(STEPS):
            losses.append(pipe.step(x, y).item())
            opt.step()
            opt.zero_grad()
        out[name] = dict(losses=losses, state=pipe.state_dict(), stages=pipe.stage_indices,
                         timings=pp.gather_timings(pipe), seconds=time.perf_counter() - t0,
                         points=pipe.points)
    torch.manual_seed(rank)  # an unseeded init differs between ranks: refused
    try:
        build_pipeline(GPT(CFG), mesh, microbatches=MB)
    except ValueError as err:
        out["different_weights"] = str(err)
    # Two steps without zero_grad accumulate like two backward() calls (tied copies included).
    pipe = build_pipeline(_model(), mesh, schedule="1f1b", microbatches=MB)
    for seed in (1, 2):
        pipe.step(*_batch(seed=seed))
    out["accumulated"] = {n: p.grad for n, p in pipe.named_parameters()}
    try:
        pipe.step(x[:6], y[:6])
    except ValueError as err:  # raised on every rank before any communication: no hang
        out["bad_batch"] = str(err)
    out.update(_from_the_request())
    return out


def _from_the_request() -> dict:
    """`Accelerator(parallel=LayoutRequest(pp=2, schedule=..., microbatches=...))`: the
    request travels whole, so `prepare_pipeline` takes its schedule and micro-batches (the
    same steps as the "gpipe" run's), and without micro-batches anywhere it says so."""
    from meshfit import Accelerator, LayoutRequest

    acc = Accelerator(parallel=LayoutRequest(pp=2, schedule="gpipe", microbatches=MB))
    pipe = acc.prepare_pipeline(_model())
    opt = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    losses = []
    for _ in range(STEPS):
        losses.append(pipe.step(*_batch()).item())
        opt.step()
        opt.zero_grad()
    out = {"from_request": dict(losses=losses, schedule=pipe.schedule_name,
                                microbatches=pipe.microbatches)}
    try:
        Accelerator(parallel=LayoutRequest(pp=2)).prepare_pipeline(_model())
    except ValueError as err:
        out["no_microbatches"] = str(err)
    return out


def test_prepare_pipeline_takes_the_layout_requests_schedule(trained):
    for rank in trained:
        got = rank["from_request"]
        assert (got["schedule"], got["microbatches"]) == ("gpipe", MB)
        assert got["losses"] == rank["gpipe"]["losses"]  # the same run, step for step
        assert rank["no_microbatches"].startswith("prepare_pipeline needs microbatches=N")


@pytest.fixture(scope="module")
def trained():
    return run_distributed(_train_pipelines, 2)


@pytest.fixture(scope="module")
def reference():
    return {ignore: _reference(ignore) for ignore in (True, False)}


@pytest.mark.parametrize("name", [name for name, _ in RUNS])
def test_pp2_matches_single_process(trained, reference, name):
    ref_losses, ref_state = reference[not name.endswith("user-loss")]
    r0, r1 = trained[0][name], trained[1][name]
    assert r0["losses"] == r1["losses"]  # broadcast from the last stage's rank
    for ref, got in zip(ref_losses, r0["losses"]):
        assert math.isclose(ref, got, rel_tol=LOSS_RTOL), (ref_losses, r0["losses"])
    assert ref_losses[-1] < ref_losses[0]  # it trained
    # Reassemble: every parameter held by exactly one rank, except the tied embedding/head.
    full = {**r0["state"], **r1["state"]}
    assert full.keys() == ref_state.keys()
    assert not r0["state"].keys() & r1["state"].keys()
    if name == "zero_bubble":  # V-shape: stages 0 and 3, so embedding and head, on rank 0
        assert r0["stages"] == [0, 3]
        assert torch.equal(r0["state"]["tok_emb.weight"], r0["state"]["lm_head.weight"])
    else:  # the two copies of the tied weight received the same updates
        assert torch.equal(r0["state"]["tok_emb.weight"], r1["state"]["lm_head.weight"])
    gaps = {k: (full[k] - ref_state[k]).abs().max().item() for k in ref_state}
    worst = max(gaps, key=gaps.get)
    assert gaps[worst] < PARAM_ATOL, (worst, gaps[worst])


def test_gradients_accumulate_over_steps(trained):
    model = _model()
    for seed in (1, 2):
        x, y = _batch(seed=seed)
        mean_ce(model(x), y).backward()
    ref = dict(model.named_parameters())
    got = {**trained[0]["accumulated"], **trained[1]["accumulated"]}
    assert got.keys() == ref.keys() | {"lm_head.weight"}
    for name, g in got.items():
        expect = ref["tok_emb.weight" if name == "lm_head.weight" else name].grad
        assert (g - expect).abs().max().item() < PARAM_ATOL, name


def test_stage_layout(trained):
    assert [trained[r]["interleaved_1f1b"]["stages"] for r in (0, 1)] == [[0, 2], [1, 3]]
    assert [trained[r]["1f1b"]["stages"] for r in (0, 1)] == [[0], [1]]
    assert trained[0]["1f1b"]["points"] == [2]
    assert trained[0]["1f1b-user-loss"]["points"] == [1]
    assert trained[0]["interleaved_1f1b"]["points"] == [1, 2, 3]


def test_bad_batch_and_different_weights_fail_on_every_rank(trained):
    for r in (0, 1):
        assert trained[r]["bad_batch"].startswith("batch size 6 does not divide into "
                                                  "microbatches=4")
        assert trained[r]["different_weights"].startswith("the pp ranks passed different "
                                                          "model weights")


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "naive"])
def test_timings(trained, name):
    timings = trained[0][name]["timings"]
    assert timings == trained[1][name]["timings"]  # gathered on every rank
    m = 1 if name == "naive" else MB
    phases = ({"forward", "backward_input", "backward_weight"} if name == "zero_bubble"
              else {"forward", "backward"})
    keys = [(t["step"], t["stage"], t["microbatch"], t["phase"]) for t in timings]
    assert len(keys) == len(set(keys))  # one entry per (step, stage, micro-batch, phase)
    assert set(keys) == {(s, st, mb, ph) for s in range(STEPS) for st in
                         range(2 if name in ("gpipe", "1f1b", "naive") else 4)
                         for mb in range(m) for ph in phases}
    # Each entry on the rank that holds its stage.
    holder = {st: r for r in (0, 1) for st in trained[r][name]["stages"]}
    assert all(t["rank"] == holder[t["stage"]] for t in timings)
    # One rank runs one thing at a time: its entries do not overlap (the busy time of a
    # rank is then at most the step's span, and the idle time below is >= 0).
    box = {(t["step"], t["stage"], t["microbatch"], t["phase"]): t for t in timings}
    for r in (0, 1):
        mine = sorted((t for t in timings if t["rank"] == r), key=lambda t: t["start"])
        assert all(t["end"] >= t["start"] for t in mine)
        assert all(b["start"] >= a["end"] for a, b in zip(mine, mine[1:])), r
    # Data dependencies, compared on one rank's clock only (ranks' clocks are not one clock):
    # a micro-batch's backward starts after its forward ended on the same stage, and where a
    # rank holds two stages s < s2 (interleaved, and ZB-V's V), the forward of s2 follows
    # that of s and the backward of s follows that of s2.
    backward = "backward_input" if name == "zero_bubble" else "backward"
    for (step, st, mb, ph), t in box.items():
        if ph == "forward":
            assert box[(step, st, mb, backward)]["start"] >= t["end"], (step, st, mb)
            for s2 in (s2 for s2, r in holder.items() if r == holder[st] and s2 > st):
                assert box[(step, s2, mb, "forward")]["start"] >= t["end"]
                assert box[(step, st, mb, backward)]["start"] >= \
                    box[(step, s2, mb, backward)]["end"]
    # The bubble: pp's figure equals the idle share recomputed from the same timings
    # (reference.idle_share). Not compared between schedules: on 2 loaded CPU cores a
    # micro-batch of this model computes in about the time a send takes, so gpipe with 4
    # micro-batches measured a larger idle share than naive's 1 (0.64-0.74 vs 0.57-0.62).
    frac = pp.bubble_fraction(timings)
    assert frac == pytest.approx(idle_share(timings), rel=1e-9, abs=1e-12)
    ratio = pp.bubble_ratio(timings)
    assert ratio == pytest.approx(frac / (1 - frac), rel=1e-9)
    if name == "naive":  # one rank works at a time: about half of the step is idle
        assert frac > 0.3


# ---------------------------------------------------------------------------- no spawn
def test_split_points_balances_params_by_formula():
    # Per block: 2 LayerNorms + attention + MLP; first stage + token and position tables,
    # last stage + final norm + the head (a copy of the tied embedding on that stage).
    d, f, V, L = CFG.d_model, CFG.d_ff, CFG.vocab_size, CFG.n_layer
    block = 2 * 2 * d + (4 * d * d + 4 * d) + (2 * d * f + f + d)
    first, last = V * d + CFG.max_seq_len * d, 2 * d + V * d
    costs = [block] * L
    costs[0] += first
    costs[-1] += last
    model = _model()
    assert [sum(p.numel() for p in b.parameters()) for b in model.layers.values()] == [block] * L

    def brute(k):  # smallest possible largest stage over all contiguous splits
        import itertools
        best = math.inf
        for cuts in itertools.combinations(range(1, L), k - 1):
            b = [0, *cuts, L]
            best = min(best, max(sum(costs[b[i]:b[i + 1]]) for i in range(k)))
        return best

    for k in range(1, L + 1):
        for source in (CFG, model):
            pts = split_points(source, k)
            b = [0, *pts, L]
            assert max(sum(costs[b[i]:b[i + 1]]) for i in range(k)) == brute(k), (k, pts)
    assert split_points(CFG, 2) == [2]
    # Heavy ends push the cuts inwards: with a big vocabulary the first and last stages hold
    # one block each.
    big = dataclasses.replace(CFG, vocab_size=4096, n_layer=6)
    assert split_points(big, 3) == [1, 5]


def test_split_points_by_time_and_given_points():
    assert split_points(CFG, 2, balance="time", times=[1, 1, 1, 3]) == [3]
    assert split_points(CFG, 2, balance="time", times=[5, 1, 1, 1, 1, 0]) == [1]  # + extras
    assert split_points(CFG, 3, points=[1, 3]) == [1, 3]
    for bad in ([2, 1], [0, 2], [1, 4], [2]):
        with pytest.raises(ValueError, match=r"points=.* must be 2 strictly increasing"):
            split_points(CFG, 3, points=bad)
    with pytest.raises(ValueError, match="balance='time' needs times="):
        split_points(CFG, 2, balance="time")
    with pytest.raises(ValueError, match="balance='flops' must be 'params' or 'time'"):
        split_points(CFG, 2, balance="flops")


def test_block_times_feed_time_balance():
    times = pp.block_times(_model().float(), torch.randint(0, CFG.vocab_size, (2, T)), repeats=1)
    assert len(times) == CFG.n_layer + 2 and all(t > 0 for t in times)
    assert len(split_points(CFG, 2, balance="time", times=times)) == 1


def test_stage_module_keeps_names_and_values():
    model = _model()
    full = model.state_dict()
    parts = [build_stage_module(model, s, 3, [1, 3]) for s in range(3)]
    assert [list(p.layers) for p in parts] == [["0"], ["1", "2"], ["3"]]
    assert parts[0].lm_head is None and parts[0].norm is None and parts[1].tok_emb is None
    assert parts[2].tok_emb is None and parts[2].pos_emb is None
    for p in parts:
        for k, v in p.state_dict().items():
            assert torch.equal(v, full[k]), k
    assert model.state_dict().keys() == full.keys()  # the full model is untouched
    # Run the stages one after another: the same logits as the full model.
    x = _batch()[0]
    h = x
    for p in parts:
        h = p(h)
    assert torch.equal(h, model(x))


def _mesh(size: int):
    return types.SimpleNamespace(ndim=1, size=lambda: size, mesh_dim_names=("pp",))


@pytest.mark.parametrize("kw, message", [
    (dict(schedule="pipedream"), "schedule='pipedream' is not one of gpipe, 1f1b, "
                                 "interleaved_1f1b, zero_bubble"),
    (dict(pp=8), "pp=8 exceeds the model's 4 blocks"),
    (dict(schedule="interleaved_1f1b", virtual_stages=3),
     "pp=2 x virtual_stages=3 = 6 stages exceeds the model's 4 blocks"),
    (dict(microbatches=1), "microbatches=1 is smaller than pp=2, which schedule='1f1b' requires"),
    (dict(schedule="interleaved_1f1b", microbatches=5), "microbatches=5 is not a multiple of "
                                                        "microbatches//pp=2"),
    (dict(schedule="interleaved_1f1b", virtual_stages=1), "virtual_stages=1 must be >= 2"),
    (dict(schedule="zero_bubble", virtual_stages=3), "virtual_stages=3 must be 2"),
    (dict(virtual_stages=2), "virtual_stages=2 needs schedule='interleaved_1f1b'"),
    (dict(batch_size=6), "batch size 6 does not divide into microbatches=4"),
    (dict(microbatches=0), "microbatches=0 must be a positive integer"),
])
def test_bad_input(kw, message):
    kw = {"pp": 2, "schedule": "1f1b", "microbatches": 4, **kw}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_pipeline(CFG.n_layer, **kw)
    # build_pipeline validates first, before touching the mesh or the process group.
    pp_size, batch = kw.pop("pp"), kw.pop("batch_size", None)
    if batch is None:
        with pytest.raises(ValueError, match=message.split(" ", 1)[0]):
            build_pipeline(_model(), _mesh(pp_size), **kw)


def test_gpipe_accepts_one_microbatch_and_theory():
    assert check_pipeline(4, 2, schedule="gpipe", microbatches=1) == 1  # naive model parallel
    assert check_pipeline(4, 2, schedule="zero_bubble", microbatches=3) == 2  # ZB-V: any m
    assert check_pipeline(4, 2, schedule="interleaved_1f1b", microbatches=3) == 2  # 1 round
    assert pp.theoretical_bubble("gpipe", 4, 8) == pp.theoretical_bubble("1f1b", 4, 8) == 3 / 8
    assert pp.theoretical_bubble("interleaved_1f1b", 4, 8, 2) == 3 / 16
    assert pp.theoretical_bubble("zero_bubble", 4, 8, 2) == 0.0
    assert pp.theoretical_bubble("interleaved_1f1b", 4, 2, 2) == 3 / 2  # m < p: no interleaving
    timings = [dict(step=0, rank=0, start=0.0, end=1.0), dict(step=0, rank=1, start=1.0, end=2.0)]
    assert pp.bubble_fraction(timings) == 0.5 and pp.bubble_ratio(timings) == 1.0
