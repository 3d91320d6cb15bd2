"""Prepared dataloaders keep the loader's feeding options (workers, prefetching)."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

from meshfit.accelerator.loader import PreparedDataLoader


def _dataset():
    return TensorDataset(torch.arange(40.0).view(20, 2), torch.arange(20))


def _batches(loader, epochs=2):
    return [[tuple(t.clone() for t in b) for b in loader] for _ in range(epochs)]


def test_worker_options_are_kept_and_batches_match_in_process_loading():
    # (one generator each: a prepared loader draws from the user's generator itself)
    plain = PreparedDataLoader(DataLoader(_dataset(), batch_size=3, shuffle=True,
                                          generator=torch.Generator().manual_seed(3)),
                               device=torch.device("cpu"), num_replicas=2, rank=1)
    workers = PreparedDataLoader(
        DataLoader(_dataset(), batch_size=3, shuffle=True,
                   generator=torch.Generator().manual_seed(3), num_workers=2,
                   prefetch_factor=4, persistent_workers=True, pin_memory=True),
        device=torch.device("cpu"), num_replicas=2, rank=1)
    inner = workers.loader
    assert (inner.num_workers, inner.prefetch_factor, inner.persistent_workers) == (2, 4, True)
    assert inner.pin_memory is False  # pinning helps only a CUDA copy; dropped on CPU
    want, got = _batches(plain), _batches(workers)
    assert len(got[0]) == 4 and len(got[1]) == 4  # ceil(20 / (3 x 2)) rounds
    for e in range(2):
        for (wx, wy), (gx, gy) in zip(want[e], got[e]):
            assert torch.equal(wx, gx) and torch.equal(wy, gy)
    assert not all(torch.equal(a[1], b[1]) for a, b in zip(got[0], got[1]))  # new epoch order
    # persistent workers: the same worker processes serve both epochs
    assert workers.loader._iterator is not None
