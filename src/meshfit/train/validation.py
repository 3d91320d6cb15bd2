"""A run's validation loss: the set is the first ``train.eval_windows`` windows of the
validation split, fixed by the data and that setting alone (not by the micro-batch, the
accumulation or the layout, which only decide how the windows are batched), so that the
same weights give the same ``val_loss`` whatever the run's shape (`ValidationBatches`:
each data-parallel rank's share; `evaluate`: the mean over every rank's).
"""

from __future__ import annotations

import math

import torch

from meshfit.accelerator import Accelerator
from meshfit.data import TokenDataset
from meshfit.models.loss import IGNORE_INDEX


class ValidationBatches:
    """This data-parallel rank's share of the first `n` validation windows (windows rank,
    rank + dp, rank + 2 dp, ...) in batches of `rows`, so that each window counts exactly once
    under every layout. Every rank runs the same number of batches (a forward may be a
    collective: FSDP's all-gathers, a pipeline's sends), the last ones filled out with
    windows whose targets are all ignored (-100), which no loss counts."""

    def __init__(self, windows: TokenDataset, n: int, rows: int, dp: int, rank: int):
        self.windows, self.rows = windows, rows
        n = min(n, len(windows))
        self.mine = list(range(rank, n, dp))
        self.batches = math.ceil(math.ceil(n / dp) / rows)

    def __len__(self) -> int:
        return self.batches

    def __iter__(self):
        for b in range(self.batches):
            items = [self.windows[i] for i in self.mine[b * self.rows:(b + 1) * self.rows]]
            x0, y0, *rest = self.windows[0]
            items += [(x0, torch.full_like(y0, IGNORE_INDEX), *rest)] * (self.rows - len(items))
            yield tuple(torch.stack(column) for column in zip(*items))  # (x, y[, positions])


def evaluate(acc: Accelerator, trained, batches: ValidationBatches) -> float:
    """The mean loss per validation token over every data-parallel rank's `batches` (a
    collective), each batch's mean weighted by the targets it counts (padding counts none)."""
    for m in trained.modules:
        m.eval()
    total = torch.zeros(2, dtype=torch.float64, device=acc.device)
    with torch.no_grad():
        for x, y, *packed in batches:
            x, y = x.to(acc.device), y.to(acc.device)
            loss = trained.eval_loss(x, y, *(p.to(acc.device) for p in packed))
            counted = (y != IGNORE_INDEX).sum()
            if counted.item():  # a batch of padding only: its mean is 0/0
                total += torch.stack([loss.detach().double().to(acc.device) * counted,
                                      counted.double()])
    for m in trained.modules:
        m.train()
    total = acc.reduce(total, "sum")
    return (total[0] / total[1]).item()
