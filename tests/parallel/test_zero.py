"""ZeRO stages 1-3, CPU offload, hybrid sharding, accumulation and export through the
Accelerator (gloo ranks on CPU), each against a single-process reference.

The model: the reference GPT cut to 2 blocks of width 64 (d_ff 128, 16 positions, 256
tokens, tied embedding/head), Ψ = 84,480 parameters, in fp64 (in fp32 Adam turns the
all-reduce's 1e-8 rounding noise into 1e-4 parameter differences; in fp64 the only
differences left are summation order, ~1e-16 relative). Every dim 0 (256, 16, 64, 128)
divides by 2, so FSDP2's shards are exact halves and the measured bytes can be compared with
the ZeRO formula without padding.

Training: 3 optimizer steps, 2 micro-batches of 2 sequences per rank each (accumulation 2),
AdamW with two param groups (decay / no decay), a LambdaLR schedule and gradient clipping to
0.5 — so re-pointed groups, re-pointed schedulers and clipping of sharded gradients all have
to be right for the parameters to match. One stage-3 run also checkpoints and compiles each
block before sharding it (aot_eager), and checks that graphs were produced (where dynamo
cannot trace, torch.compile runs the code eagerly without an error).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from conftest import case_result, run_cases, run_distributed
from reference import (full_params, mean_ce, reference_train, step_batches, tiny_gpt,
                       token_batches)
from meshfit import Accelerator, ParallelDims
from meshfit.memory import rank_report, zero_formula

# The parent's one-process references are tiny models: one intra-op thread (see conftest).
pytestmark = pytest.mark.usefixtures("one_thread")

SEQ, MICRO, K, STEPS = 16, 2, 2, 3
LR, WD, CLIP = 1e-2, 0.1, 0.5
B = 8  # bytes per fp64 element
# fp64 and the same operations in a different summation order (reduce-scatter / all-reduce
# vs one process's sum): a gradient element moves by ~1e-16 (k ~ 100 order-sensitive ops x
# u = 1.1e-16 x terms adding up to ~1e-2); AdamW's step g / (sqrt(v) + eps) turns that into
# up to lr * 1e-16 / eps = 1e-10 per step where a gradient is near eps = 1e-8 (3e-10 after 3
# steps, a worst case; derivation in tests/reference.py). Measured over 5 seeds, every stage,
# hybrid sharding and accumulation mode: 8.2e-14 at most (layers.1.mlp.w_in.weight). The
# tolerance was 1e-12, only 12x that, while the same arithmetic in test_tp_accelerator.py
# (same lr and steps) measured up to 3.7e-13 here and 1.35e-12 on a CI machine; 1e-11 is
# ~120x the largest measured here and 8 orders below a real mistake (measured on this
# model: a missing gradient all-reduce or a micro-batch seen twice 4e-2, no clipping 7e-3).
TOL = 1e-11


def _model(dtype=torch.float64, seed: int = 0):
    # The same weights on every rank (initialised before sharding); every dim 0 divides by 2.
    return tiny_gpt(n_layer=2, max_seq_len=SEQ, dtype=dtype, seed=seed)


def _data(n: int):
    return token_batches(n, SEQ)


def _loss(model, x, y):
    # The loss on the logits as the model returns them (fp64 stays fp64); `model` may be a
    # DDP wrapper, which reference.logits does not recognise as a GPT.
    return mean_ce(model(x), y)


def _optimizer(model):
    from meshfit import optim

    return optim.build("adamw", model, lr=LR, weight_decay=WD)


def _scheduler(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.7 ** step)


def _numel() -> int:
    return sum(p.numel() for p in _model().parameters())


def _block_numel() -> int:
    return sum(p.numel() for p in _model().layers["0"].parameters())


def _reference(world: int) -> dict[str, torch.Tensor]:
    """One process, one optimizer step per global batch of MICRO x world x K sequences."""
    per_step = K * MICRO * world
    batches = step_batches(*_data(STEPS * per_step), per_step)
    return reference_train(_model(), batches, _optimizer, make_scheduler=_scheduler,
                           clip=CLIP)[1]


def _train(acc: Accelerator, *, build_before: bool, probe=None, after_backward=None):
    """The loop of the seed's `accumulate` example; returns (model, optimizer, report at the
    last boundary after the step, before zero_grad). The reference steps its scheduler once
    per optimizer step: build `acc` with step_scheduler_per_process=False."""
    world = acc.runtime.dp_size
    model = _model()
    if probe is not None:
        probe(model)
    x, y = _data(STEPS * K * MICRO * world)
    loader = DataLoader(TensorDataset(x, y), batch_size=MICRO, shuffle=False)
    if build_before:  # the user's optimizer and scheduler over the unsharded parameters
        opt = _optimizer(model)
        sched = _scheduler(opt)
        model, opt, sched, loader = acc.prepare(model, opt, sched, loader)
    else:  # torchtitan's order: shard first, then build over the sharded parameters
        model = acc.prepare(model)
        opt = _optimizer(model)
        sched = _scheduler(opt)
        opt, sched, loader = acc.prepare(opt, sched, loader)
    report = None
    for xb, yb in loader:
        with acc.accumulate(model):
            acc.backward(_loss(model, xb, yb))
            if after_backward is not None:
                after_backward(model)
            if acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            sched.step()
            if acc.sync_gradients:
                report = rank_report(model, opt)
            opt.zero_grad()
    return model, opt, report


# ---------------------------------------------------------------- stages 1, 2, 3 on 2 ranks
STAGES = {  # name: (Accelerator keyword arguments, optimizer built before prepare?)
    "zero1": ({"zero_stage": 1}, True),
    "zero2": ({"zero_stage": 2}, True),
    "zero3": ({}, False),  # zero_stage defaults to 3 with dp_shard > 1
    "zero3_offload": ({"zero_stage": 3, "offload": "cpu"}, True),
    # The prepare order under sharding: checkpoint each block, compile it, then fully_shard.
    "zero3_ckpt_compile": ({"zero_stage": 3, "activation_checkpointing": "full",
                            "compile": True, "compile_backend": "aot_eager"}, False),
}


def _stages_worker(rank, world, out_dir):
    from meshfit.parallel.compile import compile_stats

    out = {}
    for name, (kwargs, before) in STAGES.items():
        graphs = compile_stats().graphs
        acc = Accelerator(parallel=ParallelDims(dp_shard=world), gradient_accumulation_steps=K,
                          step_scheduler_per_process=False, **kwargs)
        mid = {}

        def probe(model, mid=mid):
            # Inside block 1's forward (its first child's pre-hook runs after FSDP's unshard):
            # which parameters are gathered just then. First micro-batch only.
            def hook(module, args):
                if "param_bytes" not in mid:
                    mid["param_bytes"] = rank_report(model).param_bytes
            first_child = next(iter(model.layers["1"].children()))
            first_child.register_forward_pre_hook(hook)

        # No hook in the compiled case: a Python hook inside a compiled block breaks its graph.
        model, opt, report = _train(acc, build_before=before,
                                    probe=None if "compile" in kwargs else probe)
        inner = opt.optimizer
        out[name] = {
            "stage": acc.zero_stage, "params": full_params(model),
            "state_dict": acc.get_state_dict(model), "report": report,
            "mid_param_bytes": mid.get("param_bytes"), "optimizer": type(inner).__name__,
            "local_numels": sorted(p.numel() for g in getattr(inner, "optim", inner).param_groups
                                   for p in g["params"]),
            "lrs": [g["lr"] for g in opt.param_groups],
            "weight_decays": [g["weight_decay"] for g in opt.param_groups],
            "saved": str(acc.save_model(model, f"{out_dir}/{name}")),
            "new_graphs": compile_stats().graphs - graphs,  # compiled, not silently eager
        }
    return out


def _zero_greedy(numels: list[int], world: int) -> list[list[int]]:
    """ZeroRedundancyOptimizer's partition: whole tensors, largest first, each to the rank
    with the fewest elements so far (see tests/memory/test_memory.py)."""
    parts: list[list[int]] = [[] for _ in range(world)]
    for n in sorted(numels, reverse=True):
        parts[min(range(world), key=lambda r: sum(parts[r]))].append(n)
    return parts


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Both 2-rank workers (the stages; accumulation, precision and export) in one spawn."""
    return run_cases({"stages": (_stages_worker, str(tmp_path_factory.mktemp("stages"))),
                      "accumulation": (_accumulation_worker,
                                       str(tmp_path_factory.mktemp("accumulation")))},
                     2, timeout=240)


def test_zero_stages_match_single_process_and_the_formula(two_ranks):
    from safetensors.torch import load_file

    world = 2
    results = case_result(two_ranks, "stages")
    want = _reference(world)
    psi, block = _numel(), _block_numel()
    numels = [p.numel() for p in _model().parameters()]
    n_tensors = len(numels)
    assert not torch.equal(want["layers.0.mlp.w_in.weight"],
                           _model().state_dict()["layers.0.mlp.w_in.weight"])  # it trained
    for name, (kwargs, _) in STAGES.items():
        per_rank = [r[name] for r in results]
        for res in per_rank:
            assert res["stage"] == kwargs.get("zero_stage", 3)
            for key, value in res["params"].items():
                torch.testing.assert_close(value, want[key], rtol=0, atol=TOL, msg=name + key)
            # Hyper-parameters of both groups kept, and the schedule followed (0.7^3 lr).
            assert res["weight_decays"] == [WD, 0.0]
            assert res["lrs"] == pytest.approx([LR * 0.7 ** STEPS] * 2)
        # Export: the consolidated state dict on rank 0 only, the user's names, exact values.
        assert per_rank[1]["state_dict"] == {}
        exported = per_rank[0]["state_dict"]
        assert set(exported) == set(want)
        for key, value in exported.items():
            assert value.device.type == "cpu"
            torch.testing.assert_close(value, want[key], rtol=0, atol=TOL)
        # save_model: the same tensors in model.safetensors, loadable strictly.
        assert per_rank[0]["saved"].endswith(f"{name}/model.safetensors")
        saved = load_file(per_rank[0]["saved"])
        assert all(torch.equal(saved[k], v) for k, v in exported.items())
        _model().load_state_dict(saved)
        assert [r["new_graphs"] > 0 for r in per_rank] == [name.endswith("compile")] * world

    # ---- measured bytes per rank against zero_formula (fp64: p = g = 8 B, K = 16 B).
    # AdamW also keeps a 4-byte `step` per parameter tensor, which the formula leaves out.
    fp64 = {"param_bytes": B, "grad_bytes": B, "optim_bytes": 2 * B}
    stage1 = zero_formula(psi, world, 1, **fp64)
    parts = _zero_greedy(numels, world)
    for rank, res in enumerate(r["zero1"] for r in results):
        rep = res["report"]
        assert res["optimizer"] == "ZeroRedundancyOptimizer"
        assert (rep.param_bytes, rep.grad_bytes) == (stage1["params"], stage1["grads"])
        assert res["local_numels"] == sorted(parts[rank])  # whole tensors, greedy
        assert rep.optimizer_bytes == 2 * B * sum(parts[rank]) + 4 * len(parts[rank])
        assert rep.optimizer_bytes == pytest.approx(stage1["optimizer"], rel=0.02)
        assert rep.total_bytes == pytest.approx(stage1["total"], rel=0.02)
        assert res["mid_param_bytes"] == B * psi  # replicated: always the full model
    for name in ("zero2", "zero3", "zero3_offload", "zero3_ckpt_compile"):
        stage = 2 if name == "zero2" else 3
        formula = zero_formula(psi, world, stage, fsdp2=True, **fp64)
        for res in (r[name] for r in results):
            rep = res["report"]
            assert res["optimizer"] == "AdamW"
            # At rest (after the step): FSDP2 holds 1/N of parameters and gradients...
            assert (rep.param_bytes, rep.grad_bytes) == (formula["params"], formula["grads"])
            # ... and optimizer state built on those shards (+ the step scalars).
            assert rep.optimizer_bytes == 2 * B * psi // world + 4 * n_tensors
            assert rep.optimizer_bytes == pytest.approx(formula["optimizer"], rel=0.02)
            assert rep.total_bytes == pytest.approx(formula["total"], rel=0.02)
            assert rep.host_bytes == rep.total_bytes  # CPU (offload or not)
        root = psi - 2 * block  # embeddings (tied head), final norm: the root unit
        mids = {res["mid_param_bytes"] for res in (r[name] for r in results)}
        if name == "zero3_ckpt_compile":
            assert mids == {None}  # not probed
        elif stage == 3:
            # Inside block 1's forward: block 1 gathered, block 0 already resharded, the root
            # gathered (FSDP2 keeps the root unsharded from its forward to its backward) —
            # the 1/N shards plus the gathered block's and root's other halves.
            assert mids == {B * (root + block + block // world)}
            assert mids == {formula["params"] + B * (root + block) // world}
        else:  # stage 2 keeps every block gathered from its forward to its backward
            assert mids == {B * (root + 2 * block)}


def test_single_process_export(tmp_path):
    from safetensors.torch import load_file

    acc = Accelerator()
    model = acc.prepare(_model())
    path = acc.save_model(model, tmp_path / "out")
    state = load_file(path)
    assert set(state) == set(_model().state_dict())  # tied: both names, separate copies
    fresh = _model(seed=1)  # other weights: the loaded ones must replace them
    fresh.load_state_dict(state)
    x, _ = _data(2)
    torch.testing.assert_close(fresh(x), model(x), rtol=0, atol=0)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "meshfit-digests.json", "model.safetensors"]  # no temp; its digests beside it


# ---------------------------------------------------------------- hybrid sharding, 4 ranks
def _hybrid_worker(rank, world):
    acc = Accelerator(parallel=ParallelDims(dp_replicate=2, dp_shard=2),
                      gradient_accumulation_steps=K, step_scheduler_per_process=False)
    model, opt, report = _train(acc, build_before=False)
    p = next(model.parameters())
    dataset = acc.prepare(DataLoader(TensorDataset(torch.arange(10)), batch_size=2))
    seen = torch.cat([acc.gather_for_metrics(idx) for (idx,) in dataset]).tolist()
    return {"params": full_params(model), "state_dict": acc.get_state_dict(model),
            "placements": [repr(pl) for pl in p.placements], "mesh": p.device_mesh.mesh_dim_names,
            "dp": (acc.runtime.dp_rank, acc.runtime.dp_size), "report": report,
            "gathered": seen}


def test_hybrid_sharding_matches_single_process():
    results = run_distributed(_hybrid_worker, 4)
    want = _reference(4)  # 4 data-parallel ranks: dp_replicate x dp_shard
    psi = _numel()
    formula = zero_formula(psi, 2, 3, param_bytes=B, grad_bytes=B, optim_bytes=2 * B)
    assert sorted(r["dp"] for r in results) == [(i, 4) for i in range(4)]
    for res in results:
        # Replicated across dim 0 (dp_replicate), sharded over dim 1 (dp_shard).
        assert res["mesh"] == ("dp_replicate", "dp_shard")
        assert res["placements"] == ["Replicate()", "Shard(dim=0)"]
        for key, value in res["params"].items():
            torch.testing.assert_close(value, want[key], rtol=0, atol=TOL)
        # Sharded over dp_shard = 2, not over all 4 ranks.
        rep = res["report"]
        assert (rep.param_bytes, rep.grad_bytes) == (formula["params"], formula["grads"])
        assert rep.optimizer_bytes == pytest.approx(formula["optimizer"], rel=0.02)
        assert res["gathered"] == list(range(10))  # sharded and gathered over all 4 ranks
    assert all(r["state_dict"] == {} for r in results[1:])
    for key, value in results[0]["state_dict"].items():
        torch.testing.assert_close(value, want[key], rtol=0, atol=TOL)


# ---------------------------------------------------------------- accumulation, precision, export
def _accumulation_worker(rank, world, out_dir):
    import warnings

    from meshfit.parallel import fsdp

    out = {}
    for mode in (False, True, "auto", "auto_low_memory"):
        if mode == "auto_low_memory":  # pretend almost no memory is free: auto must sync
            real, fsdp.available_memory_bytes = fsdp.available_memory_bytes, lambda device: 1
        acc = Accelerator(parallel=ParallelDims(dp_shard=world), gradient_accumulation_steps=K,
                          sync_each_batch="auto" if mode == "auto_low_memory" else mode,
                          step_scheduler_per_process=False)
        peaks = []
        model, opt, _ = _train(acc, build_before=False,
                               after_backward=lambda m: peaks.append(fsdp.held_gradient_bytes(m)))
        if mode == "auto_low_memory":
            fsdp.available_memory_bytes = real
        out[mode] = {"params": full_params(model), "peak": max(peaks),
                     "resolved": acc.sync_each_batch}
    # Export the last model: safetensors on rank 0; its outputs to compare after loading.
    path = acc.save_model(model, out_dir)
    x, _ = _data(4)
    with torch.no_grad():
        out["outputs"] = model(x)
    out["path"] = str(path)

    # bf16 through FSDP's MixedPrecisionPolicy: gathered parameters are bf16 in forward.
    acc = Accelerator(parallel=ParallelDims(dp_shard=world), mixed_precision="bf16")
    model = acc.prepare(_model(torch.float32))
    seen = []
    wq = model.layers["0"].attn.wq
    wq.register_forward_pre_hook(lambda m, args: seen.append((m.weight.dtype, args[0].dtype)))
    opt = acc.prepare(_optimizer(model))
    logits = model(x)
    acc.backward(logits.float().logsumexp(-1).mean())
    opt.step()
    out["bf16"] = {"forward": seen, "output": logits.dtype,
                   "wrapped": hasattr(model, "_meshfit_autocast"),
                   "master": {p.dtype for p in model.parameters()},
                   "grads": {p.grad.dtype for p in model.parameters()}}

    # fp16: torch's GradScaler on DTensor gradients agrees across ranks on an overflow that
    # only rank 0 sees (found_inf is all-reduced), so both skip the step.
    acc = Accelerator(parallel=ParallelDims(dp_shard=world), mixed_precision="fp16")
    model = acc.prepare(_model(torch.float32))
    opt = acc.prepare(_optimizer(model))
    before = full_params(model)
    scale = acc.precision.scaler.get_scale()
    loss = model(x[:, :4]).float().mean()
    acc.backward(loss * (float("inf") if rank == 0 else 1.0))
    opt.step()
    skipped = opt.step_was_skipped
    unchanged = all(torch.equal(before[k], v) for k, v in full_params(model).items())
    opt.zero_grad()
    acc.backward(model(x[:, :4]).float().mean() * 1e-3)
    opt.step()
    out["fp16"] = {"skipped": skipped, "unchanged": unchanged,
                   "scale": (scale, acc.precision.scaler.get_scale()),
                   "second_skipped": opt.step_was_skipped}

    # A model too small to shard: a warning, not an error.
    acc = Accelerator(parallel=ParallelDims(dp_shard=world))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc.prepare(torch.nn.Linear(4, 1))
    out["warnings"] = [str(w.message) for w in caught]
    return out


def test_sync_each_batch_memory_precision_and_export(two_ranks):
    from safetensors.torch import load_file

    world = 2
    results = case_result(two_ranks, "accumulation")
    psi = _numel()
    want = _reference(world)
    for res in results:
        # No reduce-scatter between micro-batches: full unsharded fp64 gradients (8Ψ) wait
        # for the boundary; reduce-scattering every micro-batch keeps only the shards (8Ψ/N).
        assert res[False]["peak"] == B * psi
        assert res[True]["peak"] == B * psi // world
        assert res["auto"]["resolved"] is False  # a tiny model: plenty of memory
        assert res["auto_low_memory"]["resolved"] is True
        assert res["auto_low_memory"]["peak"] == B * psi // world
        for mode in (False, True, "auto", "auto_low_memory"):
            for key, value in res[mode]["params"].items():
                torch.testing.assert_close(value, want[key], rtol=0, atol=TOL)
        bf16 = res["bf16"]
        # Parameters gathered in bf16 and activations computed in bf16 (no fp32 fall-back),
        # fp32 outputs, master weights and gradients, and no autocast wrapper.
        assert set(bf16["forward"]) == {(torch.bfloat16, torch.bfloat16)}
        assert bf16["output"] == torch.float32 and not bf16["wrapped"]
        assert bf16["master"] == {torch.float32} and bf16["grads"] == {torch.float32}
        fp16 = res["fp16"]
        assert fp16["skipped"] and fp16["unchanged"]  # on both ranks
        assert fp16["scale"][1] == fp16["scale"][0] / 2 and not fp16["second_skipped"]
        assert any("too small to shard" in w for w in res["warnings"])
    # Export from stage 3: a fresh single-device model loads the file and computes the same.
    state = load_file(results[0]["path"])
    fresh = _model(seed=1)  # other weights: the loaded ones must replace them
    fresh.load_state_dict(state)  # strict: every name, no FSDP prefixes
    assert fresh.lm_head.weight is fresh.tok_emb.weight  # still tied after loading
    x, _ = _data(4)
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), results[0]["outputs"], rtol=0, atol=0)


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs,match", [
    ({"zero_stage": 5}, r"^zero_stage=5 must be 0 \(DDP\), 1, 2 or 3"),
    ({"zero_stage": True}, r"^zero_stage=True must be"),
    # (one rule, one message: the stage asked for, or the stage the layout resolves to)
    ({"offload": "cpu", "zero_stage": 1},
     r"^offload='cpu' needs zero_stage=3 .*the layout's zero_stage is 1"),
    ({"offload": "gpu"}, r"^offload='gpu' is not one of 'none', 'cpu'"),
    ({"sync_each_batch": "sometimes"}, r"^sync_each_batch='sometimes' must be true, false"),
    ({"zero_stage": 2}, r"^zero_stage=2 shards over the dp_shard axis, which has size 1"),
    ({"offload": "cpu"}, r"^offload='cpu' needs zero_stage=3 .*the layout's zero_stage is 0"),
    ({"parallel": ParallelDims(dp_shard=2)}, r"world size \(1\) to be a multiple of 2"),
])
def test_bad_zero_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match) as err:
        Accelerator(**kwargs)
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------- meshfit train
MESHFIT = [sys.executable, "-m", "meshfit"]


@pytest.mark.parametrize("stage,extra", [
    (2, ["--parallel.sync_each_batch=auto"]),
    (1, []),  # ZeroRedundancyOptimizer around the fused AdamW, its scheduler re-pointed
])
def test_train_zero_two_processes(stage, extra, tmp_path, subprocess_env):
    out = tmp_path / "run"
    proc = subprocess.run(
        [*MESHFIT, "train", "--nproc", "2", "--out", str(out), "--parallel.dp_shard=2",
         "--parallel.dp_replicate=1", f"--parallel.zero_stage={stage}", *extra,
         "--train.steps=8", "--train.eval_every=4", "--train.log_every=4",
         "--train.global_batch_size=16", "--train.micro_batch_size=4", "--train.seq_len=64",
         "--train.eval_batches=2", "--train.warmup_steps=2", "--model.n_layer=2",
         f"--data.cache_dir={tmp_path / 'cache'}"],
        env=subprocess_env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"zero_stage {stage}" in proc.stdout and "accumulation 2" in proc.stdout, proc.stdout
    if extra:
        assert "sync_each_batch='auto' -> False" in proc.stdout, proc.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    evals = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(train_rows) == 2 and all(r["loss"] > 0 for r in train_rows)
    # The warm-up + cosine schedule runs (that it drives the re-pointed optimizer is checked
    # on the optimizer's own groups in test_zero_stages_match_single_process_and_the_formula).
    assert train_rows[0]["lr"] > train_rows[1]["lr"]
    assert evals[-1] < evals[0] - 0.3, evals  # it learns (clipping on, grad_clip=1.0)


@pytest.mark.parametrize("args,match", [
    (["--parallel.zero_stage=5"], r"parallel.zero_stage=5 must be 0 \(DDP\), 1, 2 or 3"),
    (["--parallel.dp_shard=2", "--parallel.zero_stage=1", "--parallel.offload=cpu"],
     "parallel.offload='cpu' needs zero_stage=3"),
    (["--parallel.zero_stage=3"], "parallel.zero_stage=3 shards over the dp_shard axis"),
    (["--parallel.sync_each_batch=maybe"], "parallel.sync_each_batch='maybe' must be"),
    (["--parallel.dp_shard=3"], r"world size \(2\) to be a multiple of 3"),
    (["--parallel.dp_shard=2", "--train.find_batch_size=true"],
     "train.find_batch_size=true is not supported with parallel.zero_stage=3"),
])
def test_bad_zero_train_input_fails_before_launch(args, match, tmp_path, cli_refusal):
    out = tmp_path / "run"
    line = cli_refusal("train", "--nproc", "2", "--out", str(out), *args)
    assert re.search(match, line), line
    assert not out.exists()
