"""Tensor parallel (Megatron-LM) and sequence parallel on a 1-D DTensor mesh.

    apply.py   `apply_tp(model, mesh["tp"], plan=...)`, `tp_cross_entropy` (vocabulary-parallel)
    styles.py  meshfit's styles beside PyTorch's, and a plan's `Style` data -> `ParallelStyle`

The head-grouped layout of fused projections that a split leaves (GPT-2's ``c_attn``) and
its way back to the model's own layout are in `meshfit.models.plans.regroup`.
"""

from meshfit.parallel.tp.apply import apply_tp, tp_cross_entropy
from meshfit.parallel.tp.styles import (Conv1DColwiseParallel, Conv1DRowwiseParallel,
                                        ReplicateParallel, SequenceParallelBroadcast,
                                        to_torch_style)

__all__ = ["Conv1DColwiseParallel", "Conv1DRowwiseParallel", "ReplicateParallel",
           "SequenceParallelBroadcast", "apply_tp", "to_torch_style", "tp_cross_entropy"]
