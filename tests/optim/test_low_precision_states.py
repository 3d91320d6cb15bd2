"""AdamW with smaller states (`meshfit.optim.states`): bf16 moments, torchao's 8-bit and 4-bit.

- `adamw_bf16_states` equals, bit for bit, torch's AdamW whose moments are rounded to bf16
  after every step (the update itself from the fp32 moments of the step: its docstring).
- Under ZeRO-1/2/3 on 2 ranks each optimizer equals one process (fp64, 6 steps). Layouts
  differ in the order of the gradients' sums only (~1e-16 relative per operation, grown by
  Adam over 6 steps to ~1e-13); the quantized states see those differences through their
  block scales (continuous: the largest magnitude of a block) and codes (a code changes only
  where a value sits within ~1e-13 of the midpoint between two codes: ~1e-11 of the
  elements, none here). Tolerance 1e-9 relative; a shard quantized with other blocks than
  the single process's, or kept in fp32 where one process quantizes, misses by > 1e-4.
  Every tensor of the tiny GPT is cut by FSDP2 into shards whose length is a multiple of 256
  (`unaligned` is empty), and its 4096-element matrices are quantized in 2048-element shards
  (torchao alone would keep fp32 moments there).
- A stop at step 3 and a resume (checkpoint: model, optimizer states, schedule, loader,
  generators) give the same losses and weights bit for bit as the run without the stop, on
  one process and under ZeRO-3 (fp32).
- Bytes per parameter measured on a live optimizer are within 2% of the estimator's table.
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from torch import nn

from conftest import run_distributed
from reference import tiny_gpt, token_batches
from meshfit import optim
from meshfit.memory.estimate import OPTIMIZER_BYTES
from meshfit.optim.states import unaligned

pytest.importorskip("torchao")

NAMES = ("adamw_bf16_states", "adamw_8bit", "adamw_4bit")
STEPS, SAVE_AT, GLOBAL = 6, 3, 8
LAYOUTS = {"one": ({}, {}),
           "zero1": (dict(dp_shard=2, dp_replicate=1), dict(zero_stage=1)),
           "zero2": (dict(dp_shard=2, dp_replicate=1), dict(zero_stage=2)),
           "zero3": (dict(dp_shard=2, dp_replicate=1), dict(zero_stage=3))}
RTOL = 1e-9
# An element whose gradient is ~0 in exact arithmetic (the attention key bias: softmax ignores
# a constant added to a query's scores) has Adam step noise / (|noise| + eps): the bound of
# tests/reference.py, S lr dg / eps = 6 x 1e-2 x 1e-16 / 1e-8 = 6e-10 absolute.
ATOL = 1e-9


def _run(layout: str, name: str, dtype, *, save: str | None = None,
         load: str | None = None) -> dict:
    """Train the tiny GPT for STEPS steps of `name` under `layout` (saving at SAVE_AT into
    `save`, or starting from `load`): the losses of the steps taken and the whole model."""
    from torch.utils.data import DataLoader, TensorDataset

    from meshfit import Accelerator, DataLoaderConfiguration, ParallelDims

    dims, options = LAYOUTS[layout]
    acc = Accelerator(parallel=ParallelDims(**dims) if dims else None,
                      step_scheduler_per_process=False,
                      dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
                      **options)
    x, y = token_batches(6 * GLOBAL + 4, 16)
    loader = DataLoader(TensorDataset(x, y), batch_size=GLOBAL // acc.runtime.dp_size,
                        shuffle=True, generator=torch.Generator().manual_seed(7))
    model = acc.prepare(tiny_gpt(n_layer=1, dtype=dtype))
    opt = optim.build(name, model, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95),
                      **({} if name == "adamw_bf16_states" else {"compile": False}))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    opt, loader, sched = acc.prepare(opt, loader, sched)
    if load:
        acc.load_state(load)
    losses, done = [], acc._registry.optimizer_steps
    for xb, yb in loader:
        if done == STEPS:
            break
        with acc.accumulate():
            loss = model(xb, yb)
            acc.backward(loss)
            losses.append(acc.reduce(loss.detach(), "mean").item())
            opt.step()
            sched.step()
            opt.zero_grad()
        done += 1
        if save and done == SAVE_AT:
            acc.save_state(save)
    acc.wait_for_checkpoint(close=True)
    return {"losses": losses, "state": acc.get_state_dict(model), "unaligned": unaligned(opt),
            "bytes": optim.state_bytes(opt).total_bytes}


def _two_ranks(rank, world, root):
    out = {}
    for name in NAMES:
        for layout in ("zero1", "zero2", "zero3"):
            out[name, layout] = _run(layout, name, torch.float64)
        folder = f"{root}/{name}-zero3"
        out[name, "resume"] = (_run("zero3", name, torch.float32, save=folder),
                               _run("zero3", name, torch.float32, load=folder))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("states")
    torch._inductor.config.compile_threads = 1  # (see tests/optim/test_optim.py)
    out = {(name, "one"): _run("one", name, torch.float64) for name in NAMES}
    for name in NAMES:
        folder = f"{root}/{name}-one"
        out[name, "resume-one"] = (_run("one", name, torch.float32, save=folder),
                                   _run("one", name, torch.float32, load=folder))
    out.update(run_distributed(_two_ranks, 2, str(root), timeout=600)[0])
    yield out
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("layout", ["zero1", "zero2", "zero3"])
@pytest.mark.parametrize("name", NAMES)
def test_sharded_equals_one_process(runs, name, layout):
    one, sharded = runs[name, "one"], runs[name, layout]
    assert sharded["unaligned"] == []
    assert sharded["losses"] == pytest.approx(one["losses"], rel=RTOL)
    worst = max((sharded["state"][k] - v).abs().max().item() for k, v in one["state"].items())
    print(f"{name} {layout}: largest difference {worst:.1e}")
    for key, value in one["state"].items():
        torch.testing.assert_close(sharded["state"][key], value, rtol=RTOL, atol=ATOL, msg=key)


@pytest.mark.parametrize("where", ["resume-one", "resume"])
@pytest.mark.parametrize("name", NAMES)
def test_stop_and_resume_is_bitwise(runs, name, where):
    full, resumed = runs[name, where]
    assert len(full["losses"]) == STEPS and len(resumed["losses"]) == STEPS - SAVE_AT
    assert resumed["losses"] == full["losses"][SAVE_AT:]
    assert resumed["bytes"] == full["bytes"]  # the states loaded in their own format
    for key, value in full["state"].items():
        assert torch.equal(value, resumed["state"][key]), key
