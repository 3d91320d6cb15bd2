"""Distributed checkpoints: sharded (`torch.distributed.checkpoint`), committed atomically
with a manifest, loaded without unpickling, resharded to any layout.

    store.py   folders on disk: save, commit, verify, find the newest complete, prune
    state.py   what is saved: model and optimizer states by parameter name, RNG states
"""

from meshfit.checkpoint.store import CheckpointError, Manifest, latest, list_complete, prune

__all__ = ["CheckpointError", "Manifest", "latest", "list_complete", "prune"]
