"""Accelerator under DDP (2 gloo ranks) against single-process references."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from conftest import case_result, run_cases
from meshfit import Accelerator, ParallelDims

# The parent's one-process references are tiny models: one intra-op thread (see conftest).
pytestmark = pytest.mark.usefixtures("one_thread")

# Not reference.py's GPT: the data-parallel mechanics checked here (accumulation, no_sync,
# all-reduce rounds, sharded loaders) need no language model, and a small tanh MLP on
# regression data trains in milliseconds and keeps the fp32 comparison's rounding small.
N_SAMPLES, IN, OUT = 64, 8, 4


def _data(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_SAMPLES, IN, generator=g, dtype=dtype)
    y = torch.randn(N_SAMPLES, OUT, generator=g, dtype=dtype)
    return x, y


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, OUT)).to(dtype)


def _loss(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


# ---------------------------------------------------------------- accumulate(k) == big batch
MICRO, K, STEPS = 2, 4, 3


@pytest.fixture(scope="module")
def two_ranks():
    """Every 2-rank worker of this file in one spawn (see conftest.run_cases)."""
    return run_cases({
        "accumulate-float64": (_ddp_accumulate, torch.float64),
        "accumulate-float32": (_ddp_accumulate, torch.float32),
        "no_sync": (_ddp_no_sync_by_hand,),
        "allreduce-accumulate": (_count_allreduces, True),
        "allreduce-every-batch": (_count_allreduces, False),
        "gather-23": (_gather_epochs, 23, False),
        "gather-23-shuffled": (_gather_epochs, 23, True),
        "gather-24-shuffled": (_gather_epochs, 24, True),
        "fsdp-plugin": (_fsdp_plugin,),
        "scheduler-per-process": (_scheduler_steps, True),
        "scheduler-once": (_scheduler_steps, False),
        "join-uneven": (_join_uneven,),
    }, 2)


def _ddp_accumulate(rank, world, dtype):
    acc = Accelerator(gradient_accumulation_steps=K)
    x, y = _data(dtype)
    model = _model(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(TensorDataset(x, y), batch_size=MICRO, shuffle=False)
    model, opt, loader = acc.prepare(model, opt, loader)
    for i, (xb, yb) in enumerate(loader):
        if i == STEPS * K:
            break
        with acc.accumulate(model):
            acc.backward(_loss(model, xb, yb))
            opt.step()
            opt.zero_grad()
    return _params(acc.unwrap_model(model))


@pytest.mark.parametrize("dtype,tol", [
    # fp64: only the order of the all-reduce's sums differs from the single process, so the
    # parameters agree to a few ulps of the Adam update (measured over 5 seeds: 8.3e-17 at
    # most; 1e-12 is 1e4 times that).
    (torch.float64, 1e-12),
    # fp32: the same rounding differences are ~1e-7 of the gradient; Adam divides by
    # sqrt(v) ~ |g|, so an element's update can move by ~1e-7 relative of lr=1e-2 per step.
    (torch.float32, 1e-6),
])
def test_ddp_accumulate_matches_single_process(two_ranks, dtype, tol):
    ranks = case_result(two_ranks, f"accumulate-{str(dtype).removeprefix('torch.')}")
    # Reference: one process, one optimizer step per global batch of MICRO * 2 ranks * K.
    x, y = _data(dtype)
    model = _model(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    global_batch = MICRO * 2 * K
    for s in range(STEPS):
        sl = slice(s * global_batch, (s + 1) * global_batch)
        opt.zero_grad()
        _loss(model, x[sl], y[sl]).backward()
        opt.step()
    for got0, got1, want in zip(*ranks, _params(model)):
        torch.testing.assert_close(got0, got1, rtol=0, atol=0)  # replicas stay identical
        torch.testing.assert_close(got0, want, rtol=0, atol=tol)
    assert not torch.equal(want, _params(_model(dtype))[-1])  # training did move the weights


# ---------------------------------------------------------------- the seed's no_sync loop
def _ddp_no_sync_by_hand(rank, world):
    acc = Accelerator()
    x, y = _data()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(x[:16], y[:16]), batch_size=MICRO)
    ddp_model, loader, opt = acc.prepare(model, loader, opt)
    for index, (inputs, targets) in enumerate(loader):
        if index != len(loader) - 1:
            with acc.no_sync(ddp_model):
                acc.backward(_loss(ddp_model, inputs, targets))
        else:
            acc.backward(_loss(ddp_model, inputs, targets))
            opt.step()
            opt.zero_grad()
    return _params(acc.unwrap_model(ddp_model))


def test_no_sync_by_hand_matches_single_process(two_ranks):
    ranks = case_result(two_ranks, "no_sync")
    x, y = _data()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # Each rank sums 4 micro-batch means, DDP averages over 2 ranks: 4 x the mean over 16.
    (4 * _loss(model, x[:16], y[:16])).backward()
    opt.step()
    for got0, got1, want in zip(*ranks, _params(model)):
        torch.testing.assert_close(got0, got1, rtol=0, atol=0)
        # fp32 SGD: differences are the all-reduce's summation order, ~1e-7 relative.
        torch.testing.assert_close(got0, want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- all-reduce rounds
def _count_allreduces(rank, world, use_accumulate):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    acc = Accelerator(gradient_accumulation_steps=K if use_accumulate else 1)
    x, y = _data()
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(TensorDataset(x, y), batch_size=MICRO)
    model, opt, loader = acc.prepare(model, opt, loader)
    calls = []

    def counting_hook(state, bucket):  # DDP calls this once per bucket it all-reduces
        calls.append(bucket.index())
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, counting_hook)
    # Buckets per synchronised backward, measured on one plain backward.
    _loss(model, x[:MICRO], y[:MICRO]).backward()
    buckets = len(calls)
    opt.zero_grad()
    calls.clear()
    optimizer_steps = 0
    for i, (xb, yb) in enumerate(loader):
        if i == STEPS * K:
            break
        with acc.accumulate(model):
            acc.backward(_loss(model, xb, yb))
            if acc.sync_gradients:
                optimizer_steps += 1
            opt.step()
            opt.zero_grad()
    return buckets, len(calls), optimizer_steps


def test_one_allreduce_round_per_optimizer_step(two_ranks):
    for buckets, calls, steps in case_result(two_ranks, "allreduce-accumulate"):
        assert buckets >= 1 and steps == STEPS
        assert calls == STEPS * buckets  # one round per optimizer step, none in between
    for buckets, calls, steps in case_result(two_ranks, "allreduce-every-batch"):
        assert calls == STEPS * K * buckets  # without accumulate: every micro-batch


# ---------------------------------------------------------------- sharded data
def _gather_epochs(rank, world, n, shuffle):
    acc = Accelerator()
    ds = TensorDataset(torch.arange(n))
    loader = acc.prepare(DataLoader(ds, batch_size=3, shuffle=shuffle))
    epochs = []
    for _ in range(2):
        seen, gathered = [], []
        for (idx,) in loader:
            seen.extend(idx.tolist())
            gathered.append(acc.gather_for_metrics(idx))
        epochs.append((seen, torch.cat(gathered).tolist()))
    return epochs


@pytest.mark.parametrize("shuffle", [False, True])
def test_gather_for_metrics_returns_exactly_the_dataset(two_ranks, shuffle):
    n = 23  # not a multiple of 2 ranks x batch 3
    results = case_result(two_ranks, "gather-23-shuffled" if shuffle else "gather-23")
    for epoch in range(2):
        gathered0, gathered1 = results[0][epoch][1], results[1][epoch][1]
        assert gathered0 == gathered1
        assert len(gathered0) == n and sorted(gathered0) == list(range(n))
        if not shuffle:
            assert gathered0 == list(range(n))  # global order is kept
    # Every rank saw the same number of samples (equal shapes for DDP and gather).
    assert len(results[0][0][0]) == len(results[1][0][0])


def test_shuffling_identical_across_ranks_and_new_each_epoch(two_ranks):
    results = case_result(two_ranks, "gather-24-shuffled")
    (e0_r0, g0), (e1_r0, g1) = results[0]
    (e0_r1, _), (e1_r1, _) = results[1]
    # Ranks draw from one shared permutation: disjoint shards that cover the dataset.
    assert sorted(e0_r0 + e0_r1) == list(range(24))
    assert sorted(e1_r0 + e1_r1) == list(range(24))
    assert g0 != list(range(24)) and g0 != g1  # shuffled, differently in each epoch


def test_single_process_sees_each_sample_once():
    acc = Accelerator()
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(10)), batch_size=3))
    sizes = [idx.shape[0] for (idx,) in loader]
    assert sizes == [3, 3, 3, 1]


# ---------------------------------------------------------------- facade behaviour
def test_prepare_returns_objects_in_the_given_order():
    acc = Accelerator()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    loader = DataLoader(TensorDataset(torch.zeros(4, IN)), batch_size=2)
    out = acc.prepare(sched, loader, opt, model)
    assert [type(o).__name__ for o in out] == ["PreparedScheduler", "PreparedDataLoader",
                                               "PreparedOptimizer", "Sequential"]


def test_optimizer_and_scheduler_act_only_on_boundaries():
    acc = Accelerator(gradient_accumulation_steps=2)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = _data()
    loader = DataLoader(TensorDataset(x[:8], y[:8]), batch_size=2)
    model, opt, sched, loader = acc.prepare(model, opt, sched, loader)
    before = _params(model)
    lrs, changed = [], []
    for xb, yb in loader:
        with acc.accumulate(model):
            acc.backward(_loss(model, xb, yb))
            opt.step()
            sched.step()
            opt.zero_grad()
        lrs.append(sched.get_last_lr()[0])
        changed.append(not all(torch.equal(a, b) for a, b in zip(before, _params(model))))
        before = _params(model)
    assert changed == [False, True, False, True]
    assert lrs == [1.0, 0.5, 0.5, 0.25]


def test_evaluation_loop_inside_an_epoch_keeps_the_accumulation_boundaries():
    # A read-out evaluation loader used to stay "active": its end-of-data flag then made
    # every later training micro-batch an optimizer (and scheduler) step — the learning rate
    # ran ahead k times and gradients were applied at 1/k scale.
    acc = Accelerator(gradient_accumulation_steps=2)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = _data()
    loader = DataLoader(TensorDataset(x[:8], y[:8]), batch_size=2)
    val = DataLoader(TensorDataset(x[8:12], y[8:12]), batch_size=2)
    model, opt, sched, loader, val = acc.prepare(model, opt, sched, loader, val)
    lrs = []
    for i, (xb, yb) in enumerate(loader):
        with acc.accumulate(model):
            acc.backward(_loss(model, xb, yb))
            opt.step()
            sched.step()
            opt.zero_grad()
        lrs.append(sched.get_last_lr()[0])
        if i == 1:  # evaluate after the first optimizer step, as meshfit train does
            with torch.no_grad():
                for vx, vy in val:
                    _loss(model, vx, vy)
    assert lrs == [1.0, 0.5, 0.5, 0.25]


def test_backward_scales_loss_by_accumulation_steps():
    acc = Accelerator(gradient_accumulation_steps=4)
    w = torch.nn.Parameter(torch.ones(()))
    acc.backward(w * 8.0)
    assert w.grad.item() == 2.0


def test_fp16_overflow_skips_step_and_halves_scale():
    acc = Accelerator(mixed_precision="fp16")
    model = torch.nn.Linear(4, 1)
    opt = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    model = acc.prepare(model)
    scale = acc.precision.scaler.get_scale()
    before = _params(model)
    x = torch.full((1, 4), 0.01)  # small enough that loss x scale stays finite in fp16
    acc.backward(model(x).sum() * float("inf"))
    opt.step()
    assert opt.step_was_skipped and acc.precision.scaler.get_scale() == scale / 2
    assert all(torch.equal(a, b) for a, b in zip(before, _params(model)))
    opt.zero_grad()
    acc.backward(model(x).sum())
    opt.step()
    assert not opt.step_was_skipped
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not all(torch.equal(a, b) for a, b in zip(before, _params(model)))


def test_bf16_autocast_outputs_fp32_close_to_fp32():
    model = _model()
    ref = copy.deepcopy(model)
    acc = Accelerator(mixed_precision="bf16")
    model = acc.prepare(model)
    x, _ = _data()
    out = model(x)
    assert out.dtype == torch.float32
    # bf16 keeps 8 bits of mantissa: relative error ~2^-8 per operation.
    torch.testing.assert_close(out, ref(x), rtol=0.05, atol=0.05)


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs,match", [
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps=0"),
    ({"gradient_accumulation_steps": 1.5}, "gradient_accumulation_steps=1.5"),
    ({"mixed_precision": "fp4"}, "mixed_precision='fp4'.*'no', 'bf16', 'fp16'"),
    ({"parallel": ParallelDims(dp_replicate=2)}, "product 2 but the world size is 1"),
    ({"parallel": ParallelDims(dp_replicate=1, tp=2)}, "product 2 but the world size is 1"),
])
def test_bad_accelerator_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Accelerator(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    ({"tp": 0}, r"ParallelDims.tp=0 must be >= 1"),
    ({"dp_shard": -1}, "at most one axis"),
    ({"pp": 2, "world_size": 3}, "multiple of 2"),
    ({"dp_replicate": 2, "world_size": 4}, "product 2 but the world size is 4"),
])
def test_bad_parallel_dims(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelDims(**kwargs)


def test_parallel_dims_resolve():
    dims = ParallelDims().resolve(4)
    assert dims.dp_replicate == 4 and dims.dp == 4
    assert ParallelDims(tp=2).resolve(4).dp_replicate == 2


# ---------------------------------------------------------------- Accelerate's options
def _fsdp_plugin(rank, world):
    """Accelerate's FSDP plugin is meshfit's ZeRO-3 over every process: the same training as
    DDP up to the order of the sums."""
    from meshfit.utils import FullyShardedDataParallelPlugin
    from reference import full_params

    out = {}
    for name, kwargs in (("ddp", {}), ("fsdp", {"fsdp_plugin": FullyShardedDataParallelPlugin()})):
        acc = Accelerator(gradient_accumulation_steps=2, **kwargs)
        x, y = _data()
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loader = DataLoader(TensorDataset(x, y), batch_size=MICRO)
        model, opt, loader = acc.prepare(model, opt, loader)
        for xb, yb in loader:
            with acc.accumulate(model):
                acc.backward(_loss(model, xb, yb))
                opt.step()
                opt.zero_grad()
        out[name] = {"type": str(acc.distributed_type.value), "stage": acc.zero_stage,
                     "params": full_params(model)}
    return out


def test_fsdp_plugin_is_zero3_over_every_process(two_ranks):
    for res in case_result(two_ranks, "fsdp-plugin"):
        assert (res["ddp"]["type"], res["ddp"]["stage"]) == ("MULTI_CPU", 0)
        assert (res["fsdp"]["type"], res["fsdp"]["stage"]) == ("FSDP", 3)
        for key, value in res["ddp"]["params"].items():
            # fp32: the reduce-scatter sums in another order than DDP's all-reduce (~1e-7
            # relative per step, as in the accumulation test above)
            torch.testing.assert_close(res["fsdp"]["params"][key], value, rtol=0, atol=1e-6)


def test_fsdp_plugin_options_map_to_zero_stages():
    from meshfit.utils import FullyShardedDataParallelPlugin as Plugin

    assert Plugin().zero_stage() == 3 and Plugin(reshard_after_forward=False).zero_stage() == 2
    assert Plugin(sharding_strategy="SHARD_GRAD_OP").zero_stage() == 2
    assert Plugin(sharding_strategy="NO_SHARD").zero_stage() == 0
    assert Plugin(cpu_offload=True).offload() == "cpu" and Plugin().offload() == "none"
    assert Plugin(mixed_precision_policy="bf16").mixed_precision() == "bf16"
    assert Plugin(mixed_precision_policy={"param_dtype": torch.float16}).mixed_precision() == "fp16"
    with pytest.raises(ValueError, match="HYBRID_SHARD is not available"):
        Plugin(sharding_strategy="HYBRID_SHARD").zero_stage()


def _scheduler_steps(rank, world, per_process):
    acc = Accelerator(gradient_accumulation_steps=2, step_scheduler_per_process=per_process)
    x, y = _data()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    loader = DataLoader(TensorDataset(x[:16], y[:16]), batch_size=2)
    model, opt, sched, loader = acc.prepare(model, opt, sched, loader)
    lrs = []
    for xb, yb in loader:
        with acc.accumulate(model):
            acc.backward(_loss(model, xb, yb))
            opt.step()
            sched.step()
            opt.zero_grad()
        lrs.append(sched.get_last_lr()[0])
    return lrs


def test_scheduler_steps_per_process_by_default_once_on_request(two_ranks):
    # 16 samples, 2 per rank and batch: 4 batches per rank, 2 optimizer steps.
    for lrs in case_result(two_ranks, "scheduler-per-process"):
        assert lrs == [1.0, 1 / 3, 1 / 3, 1 / 5]  # Accelerate's: 2 ranks, 2 steps each
    for lrs in case_result(two_ranks, "scheduler-once"):
        assert lrs == [1.0, 1 / 2, 1 / 2, 1 / 3]  # meshfit's: the schedule counts steps


def test_accelerate_defaults_and_refusals(monkeypatch):
    acc = Accelerator(mixed_precision=None)
    assert acc.mixed_precision == "no" and acc.distributed_type == "NO"
    assert not acc.use_distributed and acc.state.num_processes == 1
    assert acc.gradient_state.num_steps == 1 and not acc.gradient_state.end_of_dataloader
    assert acc.gradient_state.remainder == -1 and not acc.optimizer_step_was_skipped
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert Accelerator().mixed_precision == "bf16"  # what `accelerate launch` sets
    with pytest.raises(ValueError, match="deepspeed_plugin=.... is not available"):
        Accelerator(deepspeed_plugin=object())
    from meshfit.utils import DataLoaderConfiguration, GradientAccumulationPlugin

    with pytest.raises(ValueError, match="only pass one of `gradient_accumulation_steps`"):
        Accelerator(gradient_accumulation_steps=2,
                    gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2))
    # dispatch_batches is taken (process 0 reads; tests/accelerator/test_accelerate_suite.py)
    assert Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=True)
                       ).dispatch_batches is True
    with pytest.warns(UserWarning, match="split_batches=.... is ignored"):
        Accelerator(split_batches=True)


def test_gather_and_clip_value_and_trigger_on_one_process():
    acc = Accelerator()
    w = torch.nn.Parameter(torch.ones(3))
    loss = (w * 2).sum()
    gathered = acc.gather(loss)  # a tensor that requires grad
    assert not gathered.requires_grad and gathered.item() == 6.0
    acc.backward(loss * 10)
    acc.clip_grad_value_([w], 0.5)
    assert torch.equal(w.grad, torch.full((3,), 0.5))
    assert not acc.check_trigger()
    acc.set_trigger()
    assert acc.check_trigger() and not acc.check_trigger()


def _join_uneven(rank, world):
    from meshfit.utils import DataLoaderConfiguration

    acc = Accelerator(dataloader_config=DataLoaderConfiguration(even_batches=False))
    x, y = _data()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(x[:20], y[:20]), batch_size=3)
    model, opt, loader = acc.prepare(model, opt, loader)
    batches = 0
    with acc.join_uneven_inputs([model]):
        for xb, yb in loader:
            acc.backward(_loss(model, xb, yb))
            opt.step()
            opt.zero_grad()
            batches += 1
    return batches, _params(acc.unwrap_model(model))


def test_uneven_batches_train_under_join(two_ranks):
    # 20 samples in batches of 3 over 2 ranks, not padded: rank 0 gets 4 batches, rank 1 3;
    # DDP's Join lets rank 0 take its last step alone, then the replicas agree again.
    (n0, params0), (n1, params1) = case_result(two_ranks, "join-uneven")
    assert (n0, n1) == (4, 3)
    for a, b in zip(params0, params1):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
