"""Activation offload (`meshfit.parallel.activation_offload`) and memory-budget checkpointing
(`meshfit.parallel.activation_budget`) against the run without them.

Offload: the same loss and gradients bit for bit in fp32 (the hooks copy saved tensors out and
back; nothing is recomputed or reordered), with and without checkpointing, on the meshfit GPT
and a transformers model, and under every layout (one spawn of 2 ranks: DDP, ZeRO-3, TP, PP,
CP); on the CPU the copies stay in host memory, so what is checked is that the saved tensors
really travel (the offloader's counts) and come back right; the CUDA side-stream path
(`StreamTransfers`) runs only on a GPU. The prefetch order is checked on the CPU with a
recording transfer object. Budget: the bytes the compiled block saves fall with the budget,
measured by the same hooks (the offloader's counts), and the results stay those of eager.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
import torch

from conftest import case_result, run_cases
from reference import hf_llama, tiny_gpt, token_batches
from meshfit.parallel.activation import apply_activation_checkpointing
from meshfit.parallel.activation_offload import (SyncTransfers, apply_activation_offload,
                                                 offloader_of, remove_activation_offload)
from meshfit.parallel.options import ModelOptions

pytestmark = pytest.mark.usefixtures("one_thread")

T = 16


def _gpt(**overrides):
    return tiny_gpt(max_seq_len=T, dtype=torch.float32, **overrides)  # (d_model 64)


def _grads(model, x, y):
    model.zero_grad(set_to_none=True)
    loss = model(x, y)
    loss = loss if isinstance(loss, torch.Tensor) else loss.loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_equal(a, b):
    assert torch.equal(a[0], b[0]), (a[0], b[0])
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), name


@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
def test_offload_equals_the_run_without_it_bitwise(checkpointing):
    """fp32, meshfit GPT: offloading alone moves every block's saved tensors; with full
    checkpointing it moves what checkpointing keeps (each block's input: 4 tensors here),
    with selective both kinds; the loss and every gradient equal the plain run's bitwise,
    and the offloader brought back every tensor it moved."""
    x, y = token_batches(2, T)
    plain = _gpt(n_layer=4)
    model = copy.deepcopy(plain)
    apply_activation_checkpointing(plain, checkpointing) if checkpointing != "none" else None
    apply_activation_checkpointing(model, checkpointing) if checkpointing != "none" else None
    offloader = apply_activation_offload(model)
    _assert_equal(_grads(model, x, y), _grads(plain, x, y))
    moved = offloader.stats
    assert moved["tensors"] > 0 and moved["fetched"] == moved["tensors"]
    if checkpointing == "full":  # one saved input per block (the checkpoint's)
        assert moved["tensors"] == 4
        assert moved["bytes"] == 4 * x.numel() * 64 * 4
    # a copy (deepcopy, pickle) keeps its own offloader and the same results
    moved = dict(moved)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert offloader_of(twin) is not offloader
        before = offloader_of(twin).stats["tensors"]
        _assert_equal(_grads(twin, x, y), _grads(plain, x, y))
        assert offloader_of(twin).stats["tensors"] - before == moved["tensors"]
    # inference saves nothing; removing the offload gives the plain classes back
    with torch.no_grad():
        model(x, y)
    assert offloader.stats["tensors"] == moved["tensors"]
    remove_activation_offload(model)
    assert offloader_of(model) is None
    assert type(model.layers["0"]) is type(plain.layers["0"])


def test_offload_composes_with_transformers_checkpointing():
    """A transformers Llama with its own per-layer checkpointing (its layer overrides
    ``__call__``): the offload holds around that call, so it moves the checkpoint's inputs
    (one per layer), not every activation, and the gradients equal the plain model's."""
    pytest.importorskip("transformers")
    plain = hf_llama(n_layer=3, dtype=torch.float32).train()
    model = copy.deepcopy(plain)
    apply_activation_checkpointing(model, "full")
    offloader = apply_activation_offload(model)
    ids, _ = token_batches(2, T)

    def run(m):
        m.zero_grad(set_to_none=True)
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}

    _assert_equal(run(model), run(plain))
    assert offloader.stats["tensors"] == 3 and offloader.stats["fetched"] == 3


class _Recording(SyncTransfers):
    """Records each copy: ("out", size) in the forward, ("in", size) in the backward."""

    def __init__(self):
        self.log = []

    def to_host(self, tensor):
        self.log.append(("out", tensor.shape[-1]))
        return super().to_host(tensor)

    def to_device(self, host, device):
        self.log.append(("in", host.shape[-1]))
        return super().to_device(host, device)


def test_backward_brings_each_block_back_with_the_next_one_prefetched():
    """Three blocks whose saved tensors have distinct widths (1, 2, 3 columns: block k saves
    its input, width k): the forward copies them out in order; the backward of block 3 brings
    block 3 back and prefetches block 2 before block 2's backward asks for anything, then
    block 2's brings block 1; each copy is made once, and the host copies are released."""
    from meshfit.parallel.activation_offload import ActivationOffloader

    class Block(torch.nn.Module):
        def __init__(self, k):
            super().__init__()
            self.k = k

        def forward(self, x):
            return (x[:, :self.k].contiguous() ** 2).sum(1, keepdim=True).expand(-1, 3)

    offloader = ActivationOffloader("cpu", transfers=_Recording())
    x = torch.randn(4, 3, requires_grad=True)
    h = x
    for k in (1, 2, 3):
        with offloader.group():
            h = Block(k)(h)
    log = offloader.transfers.log
    assert log == [("out", 1), ("out", 2), ("out", 3)]
    h.sum().backward()
    assert log[3:] == [("in", 3), ("in", 2), ("in", 1)]
    # each block's backward ran with its own input: the gradient of the plain computation
    y = x.detach().requires_grad_()
    g = y
    for k in (1, 2, 3):
        g = (g[:, :k].contiguous() ** 2).sum(1, keepdim=True).expand(-1, 3)
    g.sum().backward()
    assert torch.equal(x.grad, y.grad)


class _Counting(SyncTransfers):
    def __init__(self):
        self.calls = []

    def to_device(self, host, device):
        self.calls.append(len(self.calls))
        return super().to_device(host, device)


def test_prefetch_starts_before_the_previous_block_is_asked():
    """When block 2's backward asks for its first tensor, block 1's come too (before block
    1's backward runs): the side stream's copy overlaps block 2's compute on CUDA."""
    from meshfit.parallel.activation_offload import ActivationOffloader

    offloader = ActivationOffloader("cpu", transfers=_Counting())
    seen_at_block2 = []
    x = torch.randn(5, requires_grad=True)

    class Spy(torch.autograd.Function):  # runs in the backward between the blocks
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            seen_at_block2.append(offloader.stats["fetched"])
            return g

    with offloader.group():
        a = x.exp()  # block 1 saves its output
    with offloader.group():
        b = Spy.apply(a).sin()  # block 2 saves Spy's output
    b.sum().backward()
    # Spy's backward runs after block 2's sin backward: both blocks are already back
    assert seen_at_block2 == [2]
    torch.testing.assert_close(x.grad, (x.exp().cos() * x.exp()), rtol=0, atol=0)


def test_budget_saves_less_as_the_budget_falls():
    """Memory-budget checkpointing under torch.compile (backend aot_eager_decomp_partition:
    the min-cut partitioner without inductor's C++ compile): the bytes the compiled blocks
    save (counted by the offload hooks, which see what the compiled forward keeps) fall as
    the budget falls, and the gradients stay close to eager's (recomputation reorders
    nothing, but compile's decompositions may round differently)."""
    from meshfit.parallel.activation_budget import apply_memory_budget, memory_budget_of
    from meshfit.parallel.compile import apply_compile

    x, y = token_batches(2, T)
    eager = _gpt(n_layer=1)
    want = _grads(eager, x, y)
    saved = {}
    for budget in (1.0, 0.5, 0.0):
        torch.compiler.reset()
        model = copy.deepcopy(eager)
        apply_activation_checkpointing(model, "budget", budget=budget)
        assert memory_budget_of(model) == (None if budget == 1 else budget)
        apply_compile(model, backend="aot_eager_decomp_partition")
        offloader = apply_activation_offload(model)
        got = _grads(model, x, y)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
        for name in want[1]:
            torch.testing.assert_close(got[1][name], want[1][name], rtol=1e-4, atol=1e-5)
        saved[budget] = offloader.stats["bytes"]
    assert saved[1.0] > saved[0.5] > saved[0.0] > 0, saved
    with pytest.raises(ValueError, match=r"budget=1\.5 must be a number in \[0, 1\]"):
        apply_memory_budget(eager, 1.5)


@pytest.mark.parametrize("options, message", [
    (dict(activation_checkpointing="budget"),
     r"^train\.activation_checkpointing='budget' needs train\.compile=true"),
    (dict(activation_checkpointing="budget", compile=True, compile_backend="eager"),
     r"^train\.activation_checkpointing='budget' with train\.compile_backend='eager': only "
     r"inductor and aot_eager_decomp_partition"),
    (dict(activation_checkpointing_budget=2),
     r"^train\.activation_checkpointing_budget=2 must be a number in \[0, 1\]"),
    (dict(activation_offload="yes"), r"^train\.activation_offload='yes' must be True or False"),
])
def test_bad_options_are_refused_in_one_line(options, message):
    """Refused when the options are read (a config's [train], `Accelerator`'s keywords),
    before any model or process exists; the TOML path names the [train] keys."""
    from meshfit.train.configfile import load_config

    args = [f"--train.{k}={str(v).lower() if isinstance(v, bool) else v}"
            for k, v in options.items()]
    with pytest.raises(ValueError, match=message) as err:
        load_config(None, args)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=message.replace("train\\.", "")):
        ModelOptions(**options)


# ----------------------------------------------------------------------- every layout
STEPS = 2
LAYOUTS = {  # ParallelDims, Accelerator options, pipeline kwargs
    "ddp": (dict(dp_replicate=2), {}, None),
    "zero3-full": (dict(dp_shard=2), dict(zero_stage=3, activation_checkpointing="full"), None),
    "tp": (dict(tp=2, dp_replicate=1), dict(sequence_parallel=True), None),
    "pp": (dict(pp=2, dp_replicate=1), {}, dict(schedule="1f1b", microbatches=2)),
    "cp": (dict(cp=2, dp_replicate=1), {}, None),
}


def _train(dims, options, pipeline, offload):
    from meshfit import Accelerator, ParallelDims

    acc = Accelerator(parallel=ParallelDims(**dims), activation_offload=offload, **options)
    x, y = token_batches(4 * STEPS, T)
    model = tiny_gpt(n_layer=4, max_seq_len=2 * T, dtype=torch.float32)
    model = acc.prepare_pipeline(model, **pipeline) if pipeline else acc.prepare(model)
    opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=3e-3))
    losses = []
    for step in range(STEPS):
        xb, yb = x[4 * step:4 * step + 4], y[4 * step:4 * step + 4]
        if pipeline:
            loss = model.step(xb, yb)
        else:
            loss = model(xb, yb)
            acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    stages = model.modules if pipeline else [model]
    offloaders = [o for o in map(offloader_of, stages) if o is not None]
    moved = {k: sum(o.stats[k] for o in offloaders) for k in ("tensors", "dtensors")}
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
             for k, v in acc.get_state_dict(model).items()}
    return losses, state, moved


def _layout_worker(rank, world, dims, options, pipeline):
    plain, offloaded = (_train(dims, options, pipeline, o) for o in (False, True))
    return {"plain": plain, "offloaded": offloaded}


@pytest.fixture(scope="module")
def two_ranks():
    return run_cases({name: (_layout_worker, *case) for name, case in LAYOUTS.items()}, 2,
                     timeout=300)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_trains_the_same_with_offload_bitwise(two_ranks, layout):
    for res in case_result(two_ranks, layout):
        (losses, state, none_moved), (o_losses, o_state, moved) = res["plain"], res["offloaded"]
        assert none_moved == {"tensors": 0, "dtensors": 0} and moved["tensors"] > 0
        if layout == "tp":  # tensor parallel saves DTensors: their local shards moved
            assert moved["dtensors"] > 0
        assert all(torch.equal(a, b) for a, b in zip(losses, o_losses)), (losses, o_losses)
        assert state.keys() == o_state.keys()
        for key in state:
            assert torch.equal(state[key], o_state[key]), key


# ----------------------------------------------------------------------- the estimate
def test_estimate_moves_the_offloaded_bytes_to_the_host():
    """The estimator's activations on the host equal, within the closed form's known misses
    (norm statistics and the like, tests/memory/test_estimate_measured.py), the bytes the
    offloader really moved for the same model and batch; the device keeps two blocks' worth;
    with full checkpointing the host gets only the blocks' inputs."""
    from meshfit.memory import LayoutSpec, ModelShape
    from meshfit.memory.estimate import estimate

    x, y = token_batches(4, 64)
    for mode in ("none", "full"):
        model = tiny_gpt(n_layer=4, max_seq_len=64, d_model=128, d_ff=512,
                         dtype=torch.float32)
        if mode != "none":
            apply_activation_checkpointing(model, mode)
        offloader = apply_activation_offload(model)
        _grads(model, x, y)
        spec = LayoutSpec(micro_batch_size=4, activation_checkpointing=mode)
        shape = ModelShape.from_module(model)
        plain = estimate(shape, spec, seq_len=64, attention="flash")
        est = estimate(shape, dataclasses.replace(spec, activation_offload=True), seq_len=64,
                       attention="flash")
        on_host = est.detail["activations_on_host"]
        assert est.host == on_host
        assert on_host == pytest.approx(offloader.stats["bytes"], rel=0.15)
        per_block = on_host / 4
        assert est.activations == pytest.approx(plain.activations - on_host + 2 * per_block)


def test_accelerator_applies_budget_and_offload():
    """`Accelerator(activation_checkpointing="budget", activation_offload=True, compile=...)`
    gives the prepared model its budget and its offloader; a step runs and moves tensors."""
    from meshfit import Accelerator
    from meshfit.parallel.activation_budget import memory_budget_of

    torch.compiler.reset()
    acc = Accelerator(activation_checkpointing="budget", activation_checkpointing_budget=0.25,
                      compile=True, compile_backend="aot_eager_decomp_partition",
                      activation_offload=True)
    model = acc.prepare(_gpt(n_layer=2))
    assert memory_budget_of(model) == 0.25
    x, y = token_batches(2, T)
    acc.backward(model(x, y))
    assert offloader_of(model).stats["tensors"] > 0


def test_offload_without_enough_host_memory_is_refused_before_launch():
    """On GPUs the offloaded activations of the local ranks share the host's memory: a run
    whose activations fit only offloaded, on a host too small for them, is refused in one
    line naming activation offload, the host memory it needs and what there is, per rank
    the saved activations (the estimate's); with a large enough host it passes."""
    from meshfit.memory import ModelShape
    from meshfit.memory.estimate import estimate
    from meshfit.train.configfile import load_config
    from meshfit.train.fits import check_fits
    from meshfit.train.models import check_model_source
    from meshfit.train.preflight import _checked_model
    from meshfit.train import tokens
    from meshfit.memory import LayoutSpec

    GiB = 2**30
    cfg = load_config(None, ["--model.preset=llama-1b", "--train.seq_len=4096",
                             "--train.micro_batch_size=8", "--train.global_batch_size=16",
                             "--train.activation_offload=true"])
    model = _checked_model(cfg, tokens.vocab_size(cfg), check_model_source)
    est = estimate(ModelShape.from_module(model),
                   LayoutSpec(dp_replicate=2, micro_batch_size=8, activation_offload=True),
                   seq_len=4096, dtype="fp32", optimizer="adamw_fused")
    acts = est.detail["activations_on_host"]
    assert acts > 0 and est.host == acts
    with pytest.raises(ValueError) as err:
        check_fits(cfg, model, cfg.layout(2, 2), world_size=2, local_world_size=2,
                   device=torch.device("cuda"), available=est.total + GiB, host=acts)
    line = str(err.value)
    assert "\n" not in line and "activations offloaded" in line
    assert (f"activation offload needs {2 * acts / GiB:.1f} GiB of host memory for the 2 local "
            f"rank(s) and {acts / GiB:.1f} GiB is available (per rank: saved activations "
            f"{acts / GiB:.1f} GiB)") in line
    assert check_fits(cfg, model, cfg.layout(2, 2), world_size=2, local_world_size=2,
                      device=torch.device("cuda"), available=est.total + GiB,
                      host=3 * acts) is None


def test_planner_proposes_offload_when_activations_do_not_fit():
    """A GPU whose memory holds the model states but not one micro-batch's activations even
    with full checkpointing: the planner's plans are the layouts with activation offload,
    each saying so; with room for the activations none of them offloads."""
    import dataclasses as dc

    from meshfit.memory import LayoutSpec
    from meshfit.memory.estimate import estimate
    from meshfit.plan import DEVICES, Cluster, search

    seq = 2048
    full = estimate("llama-1b", LayoutSpec(activation_checkpointing="full"), seq_len=seq,
                    dtype="bf16")
    offloaded = estimate("llama-1b", LayoutSpec(activation_checkpointing="full",
                                            activation_offload=True), seq_len=seq, dtype="bf16")
    memory = (full.total + offloaded.total) / 2 / 0.9  # between the two, with the margin
    cluster = Cluster(gpus_per_node=1, device=dc.replace(DEVICES["h100"], memory=memory))
    plans = search("llama-1b", cluster, seq_len=seq, global_batch_size=1, dtype="bf16").plans
    assert plans and all(p.layout.activation_offload for p in plans)
    assert "activations are what does not fit the device" in plans[0].why
    roomy = dc.replace(DEVICES["h100"], memory=full.total / 0.9 * 1.5)
    plans = search("llama-1b", Cluster(gpus_per_node=1, device=roomy), seq_len=seq,
                   global_batch_size=1, dtype="bf16").plans
    assert plans and not any(p.layout.activation_offload for p in plans)


def test_estimate_of_a_budget_lies_between_full_and_none():
    """The estimate of memory-budget checkpointing: budget 0 keeps what full checkpointing
    keeps (each block's input, one block recomputed at a time), budget 1 what no
    checkpointing keeps, and a budget b the share b of the difference in the blocks."""
    from meshfit.memory import LayoutSpec
    from meshfit.memory.estimate import estimate

    def acts(**spec):
        return estimate("gpt2", LayoutSpec(micro_batch_size=2, **spec), seq_len=512)

    none, full = acts(), acts(activation_checkpointing="full")
    budget = {b: acts(activation_checkpointing="budget", activation_checkpointing_budget=b)
              for b in (0.0, 0.5, 1.0)}
    assert budget[0.0].activations == pytest.approx(full.activations)
    assert budget[1.0].activations == pytest.approx(none.activations)
    assert budget[0.0].activations < budget[0.5].activations < budget[1.0].activations
    assert "budget 0.5 checkpointing" in budget[0.5].layout.describe()
    assert budget[0.5].to_json()["layout"]["activation_checkpointing_budget"] == 0.5
