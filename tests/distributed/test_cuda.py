"""The CUDA + NCCL path, on machines that have a GPU (CI machines have none).

These run the same comparisons as the CPU tests on the device the user trains on: the launcher
picks NCCL and ``cuda:LOCAL_RANK``, prepared objects land on the GPU, accumulation under DDP
equals the big-batch step, and fp16 loss scaling skips a step whose gradients overflowed.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MESHFIT = [sys.executable, "-m", "meshfit"]

SCRIPT = '''
import sys, torch, torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
from meshfit import Accelerator
acc = Accelerator(gradient_accumulation_steps=4)
g = torch.Generator().manual_seed(0)
x, y = torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
loader = DataLoader(TensorDataset(x, y), batch_size=2)
model, opt, loader = acc.prepare(model, opt, loader)
devices = set()
for i, (xb, yb) in enumerate(loader):
    if i == 12:
        break
    devices.add(str(xb.device))
    with acc.accumulate(model):
        acc.backward(torch.nn.functional.mse_loss(model(xb), yb))
        opt.step()
        opt.zero_grad()
torch.save({"backend": dist.get_backend(), "device": str(acc.device), "batches": sorted(devices),
            "params": [p.detach().cpu() for p in acc.unwrap_model(model).parameters()]},
           sys.argv[1])
acc.end_training()
'''


def test_launch_uses_nccl_and_accumulates_like_a_big_batch(tmp_path, subprocess_env):
    env = dict(subprocess_env)
    env.pop("MESHFIT_CPU")
    script, out = tmp_path / "s.py", tmp_path / "out.pt"
    script.write_text(SCRIPT)
    proc = subprocess.run([*MESHFIT, "launch", "--nproc", "1", "--gpus", "0", str(script),
                           str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = torch.load(out)
    assert got["backend"] == "nccl" and got["device"] == "cuda:0"
    assert got["batches"] == ["cuda:0"]
    # Reference on the same GPU: 3 steps of one global batch of 2 x 4 samples.
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 8, generator=g).cuda(), torch.randn(64, 4, generator=g).cuda()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 4)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for s in range(3):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[8 * s:8 * s + 8]), y[8 * s:8 * s + 8]).backward()
        opt.step()
    # fp32: four micro-batch means summed against one mean over 8 samples differ by rounding
    # (~1e-7 relative); Adam turns that into ~1e-7 of lr per element per step.
    for a, b in zip(got["params"], model.parameters()):
        torch.testing.assert_close(a, b.detach().cpu(), rtol=0, atol=1e-6)


def test_fp16_overflow_skips_the_step_and_halves_the_scale():
    from meshfit import Accelerator

    acc = Accelerator(mixed_precision="fp16")
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    x = torch.randn(8, 16, device=acc.device)
    with acc.autocast():
        out = model(x)
    assert out.dtype == torch.float32  # prepared forward returns fp32 outputs
    acc.backward(out.square().mean())
    before = [p.detach().clone() for p in model.parameters()]
    scale = opt.scaler.get_scale()
    next(iter(model.parameters())).grad[0, 0] = float("inf")  # an overflowed gradient
    opt.step()
    opt.zero_grad()
    assert opt.step_was_skipped
    assert opt.scaler.get_scale() == scale / 2
    for a, b in zip(before, model.parameters()):
        assert torch.equal(a, b)
    with acc.autocast():
        loss = model(x).square().mean()
    acc.backward(loss)
    opt.step()
    assert not opt.step_was_skipped
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not torch.equal(before[0], next(iter(model.parameters())))


def test_train_runs_on_the_gpu(tmp_path, subprocess_env):
    env = dict(subprocess_env)
    env.pop("MESHFIT_CPU")
    out = tmp_path / "run"
    proc = subprocess.run([*MESHFIT, "train", "--nproc", "1", "--out", str(out),
                           "--train.steps=60", "--train.eval_every=30",
                           "--train.mixed_precision=bf16"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(s) for s in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r["val_loss"] for r in lines if "val_loss" in r]
    assert evals[-1] < evals[0] - 0.5, evals


def test_prepared_loader_copies_ahead_from_pinned_memory():
    from torch.utils.data import DataLoader, TensorDataset

    from meshfit.accelerator.loader import PreparedDataLoader

    data = TensorDataset(torch.randn(64, 256), torch.arange(64))
    loader = PreparedDataLoader(DataLoader(data, batch_size=8, pin_memory=True, num_workers=2),
                                device=torch.device("cuda", 0), num_replicas=1, rank=0)
    assert loader.loader.pin_memory and loader._copy_stream is not None
    seen = []
    for x, i in loader:
        assert x.device.type == "cuda"
        seen.append((x @ x.T).diagonal().cpu())  # compute on the batch as it arrives
        torch.testing.assert_close(x.cpu(), data.tensors[0][i.cpu()])
    assert len(seen) == 8
