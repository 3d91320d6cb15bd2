"""A small DDP training script for launcher tests: plain torchrun conventions, meshfit's
Accelerator. Writes this rank's final parameters (and its ranks) to OUT_DIR/rank<R>.pt."""

import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

from meshfit import Accelerator

out_dir = Path(sys.argv[1])
acc = Accelerator(gradient_accumulation_steps=2)
torch.manual_seed(0)
x, y = torch.randn(48, 8), torch.randn(48, 2)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)
model, opt, loader = acc.prepare(model, opt, loader)
for xb, yb in loader:
    with acc.accumulate(model):
        acc.backward(torch.nn.functional.mse_loss(model(xb), yb))
        opt.step()
        opt.zero_grad()
params = [p.detach().clone() for p in acc.unwrap_model(model).parameters()]
torch.save({"rank": acc.process_index, "world": acc.num_processes, "params": params},
           out_dir / f"rank{acc.process_index}.pt")
acc.end_training()
