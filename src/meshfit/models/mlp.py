"""The dense feed-forward blocks of the reference GPT (also a mixture of experts' shared
expert): GPT-2's GELU MLP and Llama's SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshfit.models.config import GPTConfig

__all__ = ["GeluMLP", "SwiGLUMLP"]


class GeluMLP(nn.Module):
    """GPT-2 MLP: w_out(gelu(w_in x)), tanh-approximate GELU as in the GPT-2 release."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.w_in = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.w_out = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.w_out(F.gelu(self.w_in(x), approximate="tanh")))


class SwiGLUMLP(nn.Module):
    """Llama MLP (Shazeer 2020, "GLU Variants"): w2(silu(w1 x) * w3 x); w1 gate, w3 up, w2 down."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.w3 = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.w2 = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.w2(F.silu(self.w1(x)) * self.w3(x)))
