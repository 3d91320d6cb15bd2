"""Distributed checkpoints: sharded (`torch.distributed.checkpoint`), committed atomically
with a manifest, loaded without unpickling, resharded to any layout.

    store.py       folders on disk: save, commit, verify, find the newest complete, prune
    _reader.py     a data file read with every block checked, each tensor copied once
    _writer.py     DCP's writer hashing every block as it writes
    state.py       what is saved: model and optimizer states by parameter name, RNG states
    export.py      a checkpoint read whole in one process, written as safetensors
    saved.py       a trained model as a folder (safetensors, config.json, tokenizer)
    pretrained.py  a local Hugging Face model folder loaded rank-efficiently
"""

from meshfit.checkpoint.store import (CheckpointError, Manifest, latest, list_complete, prune,
                                      skipped)

__all__ = ["CheckpointError", "Manifest", "latest", "list_complete", "prune", "skipped"]
