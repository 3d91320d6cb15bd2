"""Distributed checkpoints: sharded (`torch.distributed.checkpoint`), committed atomically
with a manifest, loaded without unpickling, resharded to any layout.

    manifest.py    what a checkpoint holds: files, sizes, block digests; checking a folder
    save.py        writing: a temporary folder, DCP's writer, the commit; in the background
    load.py        reading: the index, `load_dcp` filling a state in place, a whole entry
    store.py       the checkpoints under a folder: complete or not, the newest, pruning
    _writer.py     DCP's writer hashing every block as it writes
    _reader.py     DCP's reader made safe; a data file read with every block checked
    _writer_process.py  a background save's writer process of each rank's own
    state.py       what is saved: model and optimizer states by parameter name, RNG states
    export.py      a checkpoint read whole in one process, written as safetensors
    saved.py       a trained model as a folder (safetensors, config.json, tokenizer)
    weight_digests.py  the digests beside weights written outside a checkpoint, and their check
    pretrained.py  a local Hugging Face model folder loaded rank-efficiently
"""

from meshfit.checkpoint.manifest import CheckpointError, Manifest
from meshfit.checkpoint.store import latest, list_complete, prune, skipped

__all__ = ["CheckpointError", "Manifest", "latest", "list_complete", "prune", "skipped"]
