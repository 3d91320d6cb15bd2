"""`Accelerator.save_state` / `load_state` in a user's loop: interrupted at step 3 of 6 and
resumed, a run equals the uninterrupted one.

- Asynchronous saves (DDP, ZeRO-3) hold the state of the step they were taken at, though
  training went on while they were written.
- Same layout (fp32): bitwise — losses and every parameter — for DDP, ZeRO-1, ZeRO-2,
  ZeRO-3, TP2, PP2 (1f1b) and context parallel cp2 on 2 ranks and dp2 x tp2 on 4. The
  checkpoint holds the model, the optimizer's state (ZeRO-1 partitions, FSDP2 shards), the
  LR schedule, the data loader's position (mid-epoch) and each rank's random generators.
- Another layout or world size (fp64): saved as ZeRO-3 on 2 ranks, resumed as DDP, TP2, PP2,
  ZeRO-1, cp2 and cp2 x ZeRO-3 on 2 ranks and as dp2 x tp2 on 4; saved as cp2 x ZeRO-3,
  resumed as DDP; saved as dp2 x tp2 on 4, resumed as ZeRO-3 and DDP on 2; saved as ZeRO-3
  on 4, resumed as DDP on 2. Layouts differ in the order of sums only (~1e-16 relative per operation,
  grown by Adam over 3 steps to ~1e-13 at most); the tolerance is 1e-9 relative, and a
  resume that lost the optimizer state, the schedule or the data position misses by > 1e-3.

Every global batch is the same 8 sequences whatever the layout: each data-parallel rank's
loader takes 8 / dp of them.
"""

from __future__ import annotations

import re
import shutil

import pytest
import torch

from conftest import run_distributed
from reference import tiny_gpt, token_batches

STEPS, SAVE_AT, GLOBAL = 6, 3, 8
LAYOUTS = {
    "ddp": (dict(), {}),
    "zero1": (dict(dp_shard=2, dp_replicate=1), dict(zero_stage=1)),
    "zero2": (dict(dp_shard=2, dp_replicate=1), dict(zero_stage=2)),
    "zero3": (dict(dp_shard=2, dp_replicate=1), dict(zero_stage=3)),
    "tp2": (dict(tp=2, dp_replicate=1), {}),
    "pp2": (dict(pp=2, dp_replicate=1), {}),
    "dp2xtp2": (dict(dp_replicate=2, tp=2), {}),
    "zero3x4": (dict(dp_shard=4, dp_replicate=1), dict(zero_stage=3)),
    "cp2": (dict(cp=2, dp_replicate=1), {}),
    "cp2-zero3": (dict(cp=2, dp_replicate=1), dict(zero_stage=3)),
}
RTOL = 1e-9  # fp64 across layouts: summation order only (see the module docstring)


def _run(name: str, dtype, *, save: str | None = None, load: str | None = None,
         async_save: bool | str = False) -> dict:
    """Train LAYOUTS[name] to STEPS optimizer steps (saving at SAVE_AT into `save`, or
    starting from the checkpoint `load`); the losses of the steps taken and the whole model."""
    from torch.utils.data import DataLoader, TensorDataset

    from meshfit import Accelerator, DataLoaderConfiguration, ParallelDims

    dims, options = LAYOUTS[name]
    # The schedule counts optimizer steps on any number of ranks, and load_state puts the
    # loader back where it stood (meshfit's options; Accelerate's defaults differ).
    acc = Accelerator(parallel=ParallelDims(**dims), step_scheduler_per_process=False,
                      dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
                      **options)
    x, y = token_batches(6 * GLOBAL + 4, 16)  # one epoch, resumed in its middle
    loader = DataLoader(TensorDataset(x, y), batch_size=GLOBAL // acc.runtime.dp_size,
                        shuffle=True, generator=torch.Generator().manual_seed(7))
    if acc.parallel.pp > 1:
        model = acc.prepare_pipeline(tiny_gpt(n_layer=2, dtype=dtype), schedule="1f1b",
                                     microbatches=2)
        params, step = model.parameters(), model.step
    else:
        model = acc.prepare(tiny_gpt(n_layer=2, dtype=dtype))
        params = model.parameters()

        def step(xb, yb):
            loss = model(*acc.shard_sequence(xb, yb))  # (under cp: this rank's part)
            acc.backward(loss)
            return loss
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    opt, loader, sched = acc.prepare(opt, loader, sched)
    if load:
        acc.load_state(load)
    losses, done, at_save = [], acc._registry.optimizer_steps, None
    for xb, yb in loader:
        if done == STEPS:
            break
        with acc.accumulate():  # the global batch's mean loss (the mean over dp ranks)
            losses.append(acc.reduce(step(xb, yb).detach(), "mean").item())
            opt.step()
            sched.step()
            opt.zero_grad()
        done += 1
        if save and done == SAVE_AT:  # async: written while steps 4.. run, committed after
            acc.save_state(save, async_save=async_save)
            at_save = acc.get_state_dict(model)
    acc.wait_for_checkpoint(close=True)
    return {"losses": losses, "state": acc.get_state_dict(model), "at_save": at_save}


def _two_ranks(rank, world, root):
    out = {}
    for name in ("ddp", "zero1", "zero2", "zero3", "tp2", "pp2", "cp2"):  # same layout, fp32
        folder = f"{root}/{name}"
        out[name] = (_run(name, torch.float32, save=folder),
                     _run(name, torch.float32, load=folder))
    for name in ("ddp", "zero3"):  # the state copied at step 3, written in the background
        folder = f"{root}/{name}-async"
        out[f"{name}-async"] = (_run(name, torch.float32, save=folder, async_save=True),
                                _run(name, torch.float32, load=folder))
    # ... by a writer process of each rank's own, from shared memory
    folder = f"{root}/zero3-async-process"
    out["zero3-async-process"] = (_run("zero3", torch.float32, save=folder,
                                       async_save="process"),
                                  _run("zero3", torch.float32, load=folder))
    out["fp64"] = _run("ddp", torch.float64)  # the uninterrupted reference across layouts
    out["zero3-fp64"] = _run("zero3", torch.float64, save=f"{root}/zero3-fp64")
    for name in ("ddp", "tp2", "pp2", "zero1", "cp2", "cp2-zero3"):
        out[f"from-zero3:{name}"] = _run(name, torch.float64, load=f"{root}/zero3-fp64")
    _run("cp2-zero3", torch.float64, save=f"{root}/cp2-zero3-fp64")
    out["from-cp2-zero3:ddp"] = _run("ddp", torch.float64, load=f"{root}/cp2-zero3-fp64")
    return out


def _four_ranks(rank, world, root):
    folder = f"{root}/dp2xtp2"
    out = {"same": (_run("dp2xtp2", torch.float32, save=folder),
                    _run("dp2xtp2", torch.float32, load=folder))}
    _run("dp2xtp2", torch.float64, save=f"{root}/dp2xtp2-fp64")
    _run("zero3x4", torch.float64, save=f"{root}/zero3x4-fp64")
    out["from-zero3-on-2"] = _run("dp2xtp2", torch.float64, load=f"{root}/zero3-fp64")
    return out


def _resharded(rank, world, root):
    out = {name: _run(name, torch.float64, load=f"{root}/dp2xtp2-fp64")
           for name in ("zero3", "ddp")}
    out["zero3x4:ddp"] = _run("ddp", torch.float64, load=f"{root}/zero3x4-fp64")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    two = run_distributed(_two_ranks, 2, str(root), timeout=300)[0]
    four = run_distributed(_four_ranks, 4, str(root), timeout=300)[0]
    back = run_distributed(_resharded, 2, str(root), timeout=300)[0]
    yield {"two": two, "four": four, "back": back, "root": root}
    shutil.rmtree(root, ignore_errors=True)


def _bitwise(full, resumed):
    assert len(full["losses"]) == STEPS and len(resumed["losses"]) == STEPS - SAVE_AT
    assert resumed["losses"] == full["losses"][SAVE_AT:]
    assert full["state"].keys() == resumed["state"].keys()
    for key, value in full["state"].items():
        assert torch.equal(value, resumed["state"][key]), key


@pytest.mark.parametrize("name", ["ddp", "zero1", "zero2", "zero3", "tp2", "pp2", "cp2"])
def test_resume_same_layout_is_bitwise(runs, name):
    _bitwise(*runs["two"][name])


@pytest.mark.parametrize("name", ["ddp", "zero3", "zero3-async-process"])
def test_asynchronous_save_holds_the_state_of_its_step(runs, name):
    _bitwise(*runs["two"][name if name.endswith("process") else f"{name}-async"])


def test_resume_dp2xtp2_on_four_ranks_is_bitwise(runs):
    _bitwise(*runs["four"]["same"])


def _close(reference, resumed):
    assert len(resumed["losses"]) == STEPS - SAVE_AT
    torch.testing.assert_close(torch.tensor(resumed["losses"], dtype=torch.float64),
                               torch.tensor(reference["losses"][SAVE_AT:], dtype=torch.float64),
                               rtol=RTOL, atol=0)
    for key, value in reference["state"].items():
        torch.testing.assert_close(resumed["state"][key], value, rtol=RTOL, atol=1e-12,
                                   msg=key)


@pytest.mark.parametrize("name", ["ddp", "tp2", "pp2", "zero1", "cp2", "cp2-zero3"])
def test_resume_in_another_layout(runs, name):
    _close(runs["two"]["fp64"], runs["two"][f"from-zero3:{name}"])


def test_a_context_parallel_checkpoint_resumes_without_cp(runs):
    """Saved under cp2 x ZeRO-3 (the parameters sharded over the cp ranks), resumed as DDP."""
    _close(runs["two"]["fp64"], runs["two"]["from-cp2-zero3:ddp"])


def test_resume_on_more_and_fewer_ranks(runs):
    _close(runs["two"]["fp64"], runs["four"]["from-zero3-on-2"])  # 2 -> 4 ranks
    for name in ("zero3", "ddp", "zero3x4:ddp"):  # 4 -> 2 ranks (dp2 x tp2, ZeRO-3)
        _close(runs["two"]["fp64"], runs["back"][name])


def test_export_reads_a_sharded_checkpoint_in_one_process(runs, tmp_path):
    """The ZeRO-3 checkpoint of 2 ranks, read whole here, without a process group: exactly
    the weights the ranks held at that step; its safetensors loads into a plain model."""
    from safetensors.torch import load_file

    from meshfit.checkpoint.export import export, read_model

    folder = runs["root"] / "zero3-fp64"
    state, manifest = read_model(folder)
    assert manifest.world_size == 2 and manifest.layout["engine"] == "fsdp2"
    expected = runs["two"]["zero3-fp64"]["at_save"]
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(state[key], value), key
    path = export(folder, "safetensors", tmp_path / "out")
    model = tiny_gpt(n_layer=2, dtype=torch.float64)
    model.load_state_dict(load_file(str(path)), strict=True)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())


def _writer_process():
    """This rank's writer process (the one child started by `spawn`)."""
    import psutil

    found = [p for p in psutil.Process().children() if "spawn_main" in " ".join(p.cmdline())]
    assert len(found) == 1, found
    return found[0]


def _one_writer_killed(rank, world, root):
    """Three background saves by writer processes; rank 1's writer is SIGKILLed while the
    second is being written (stopped first, so that the kill lands mid-save: rank 0's writer
    is then inside the save's collectives, waiting for rank 1's)."""
    import os
    import signal

    from meshfit import Accelerator
    from meshfit.checkpoint import CheckpointError

    acc = Accelerator()
    model = acc.prepare(tiny_gpt(n_layer=1, dtype=torch.float32))
    acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    acc.save_state(f"{root}/first", async_save="process")
    acc.wait_for_checkpoint()
    writer = _writer_process()
    if rank == 1:
        os.kill(writer.pid, signal.SIGSTOP)
    acc.save_state(f"{root}/second", async_save="process")
    if rank == 1:
        os.kill(writer.pid, signal.SIGKILL)
    try:
        acc.wait_for_checkpoint()
        failure = None
    except CheckpointError as err:
        failure = str(err)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # (what the third checkpoint holds differs from the first's)
    acc.save_state(f"{root}/third", async_save="process")
    acc.wait_for_checkpoint(close=True)
    return failure, {k: v.clone() for k, v in acc.get_state_dict(model).items()}


def test_a_writer_process_killed_mid_save_is_one_line_and_the_next_save_is_written(tmp_path):
    """SIGKILL of one rank's writer process during a background save: every rank reports
    that save in the same one line, naming the rank whose writer died and the signal; the run
    goes on, and its next checkpoint is written (complete, holding the state of its step)."""
    from meshfit.checkpoint.export import read_model
    from meshfit.checkpoint.store import is_complete

    ranks = run_distributed(_one_writer_killed, 2, str(tmp_path), timeout=120)
    failures = [failure for failure, _ in ranks]
    assert failures[0] == failures[1], failures
    assert "\n" not in failures[0]
    assert re.fullmatch(rf"the background save of {re.escape(str(tmp_path))}/second failed on "
                        r"rank 1 \(.*SIGKILL.*\); it was removed, the checkpoints before it "
                        r"are untouched", failures[0]), failures[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["first", "third"]
    assert is_complete(tmp_path / "first") and is_complete(tmp_path / "third")
    state, _ = read_model(tmp_path / "third")
    weights = ranks[0][1]
    assert state.keys() == weights.keys()
    assert all(torch.equal(state[k], v) for k, v in weights.items())
