"""Tensor parallel (Megatron-LM) and sequence parallel on a 1-D DTensor mesh.

    apply.py   `apply_tp(model, mesh["tp"], plan=...)`, `tp_cross_entropy` (vocabulary-parallel)
    styles.py  meshfit's styles beside PyTorch's, and a plan's `Style` data -> `ParallelStyle`
"""

from meshfit.parallel.tp.apply import apply_tp, tp_cross_entropy
from meshfit.parallel.tp.styles import (Conv1DColwiseParallel, Conv1DRowwiseParallel,
                                        ReplicateParallel, SequenceParallelBroadcast,
                                        canonical_state, regrouped_params, to_torch_style,
                                        unfuse_columns)

__all__ = ["Conv1DColwiseParallel", "Conv1DRowwiseParallel", "ReplicateParallel",
           "SequenceParallelBroadcast", "apply_tp", "canonical_state", "regrouped_params",
           "to_torch_style", "tp_cross_entropy", "unfuse_columns"]
