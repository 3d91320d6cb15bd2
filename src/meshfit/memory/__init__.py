"""Per-rank memory: measured on live tensors (report.py: `rank_report`), and estimated before
anything runs (estimate.py: `estimate`, `model_state_bytes`; shape.py: `ModelShape`).

    report = rank_report(model, optimizer)                  # after a step
    shape = ModelShape.of("llama-7b")                       # preset, config.json or module:factory
    est = estimate(shape, LayoutSpec(dp_shard=8, micro_batch_size=1), seq_len=4096,
                   dtype="bf16")                             # per-rank bytes, by part
    model_state_bytes(7.5e9, dp=64, zero_stage=3)            # the ZeRO paper's formula
    estimate("mixtral-8x7b", LayoutSpec(dp_shard=8, ep=8, zero_stage=1), seq_len=4096)
                                                              # experts split over 8 ranks
"""

from meshfit.memory.estimate import (ActivationBytes, Adapters, Estimate, LayoutSpec,
                                     activation_bytes, estimate, model_state_bytes)
from meshfit.memory.report import RankMemory, net_peak_bytes, rank_report, zero_formula
from meshfit.memory.shape import ModelShape

__all__ = ["ActivationBytes", "Adapters", "Estimate", "LayoutSpec", "ModelShape", "RankMemory",
           "activation_bytes", "estimate", "model_state_bytes", "net_peak_bytes", "rank_report",
           "zero_formula"]
