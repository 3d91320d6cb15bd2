"""What the compat scripts share: a tiny classifier built from a config and a labelled
dataset made on the fly (no downloads). Nothing here imports accelerate or meshfit."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import Dataset


@dataclass
class TinyConfig:
    in_features: int = 8
    hidden: int = 16
    num_labels: int = 3
    dropout: float = 0.1


class TinyClassifier(nn.Module):
    """A two-layer classifier with dropout; ``model(x=..., labels=...)`` returns a dict with
    the logits and, given labels, the cross-entropy loss (as a transformers model does)."""

    def __init__(self, config: TinyConfig):
        super().__init__()
        self.config = config
        self.body = nn.Sequential(nn.Linear(config.in_features, config.hidden), nn.GELU(),
                                  nn.Dropout(config.dropout))
        self.head = nn.Linear(config.hidden, config.num_labels)

    def forward(self, x, labels=None):
        logits = self.head(self.body(x))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out


class RandomClassification(Dataset):
    """`n` samples of `config.in_features` features; labels from a fixed random linear
    teacher, so there is something to learn. `seed` fixes the samples."""

    def __init__(self, n: int, config: TinyConfig, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, config.in_features, generator=g)
        teacher = torch.randn(config.in_features, config.num_labels,
                              generator=torch.Generator().manual_seed(1234))
        self.labels = (self.x @ teacher).argmax(dim=-1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "labels": self.labels[i], "index": torch.tensor(i)}


def parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters, detached copies on the CPU."""
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def linear_warmup(warmup: int, total: int):
    """A LambdaLR factor: linear warm-up over `warmup` steps, then linear decay to 0 at
    `total` (what transformers' get_linear_schedule_with_warmup computes)."""
    def factor(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        return max(0.0, (total - step) / max(1, total - warmup))
    return factor
