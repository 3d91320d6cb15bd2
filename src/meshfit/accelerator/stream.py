"""Streams (a DataLoader over an ``IterableDataset``) sharded over the data-parallel ranks by
position, meshfit's own scheme (Accelerate reads a stream on rank 0 and sends each rank its
slice): item i goes to rank ``i % world``, and batch b of every rank comes from round b,
items ``[b x round, (b+1) x round)``, ``round = batch_size x world`` (gathered in rank order:
the round's items, interleaved). Every rank, and every DataLoader worker w of W (keeping the
rank's batches ``b % W == w``: the same batches with any number of workers), reads the whole
stream, so it must yield the same items in the same order each time (a dataset that splits
itself between workers is iterated with the worker information hidden). As every rank sees
the whole stream, a batch is handed out only once its round is complete: all ranks stop
after the same number of batches with no collective and no ``__len__``. A tail that does not
fill a round is dropped (``drop_last``) or shared as a last batch of ``tail // world`` items
per rank (at most ``world - 1`` items dropped); nothing is padded. A stream cannot seek: a
resumed one is re-read and its first items dropped.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from meshfit._compat import data as data_internals
from meshfit.accelerator.sampler import check_shard

__all__ = ["StreamShard", "stream_loader", "worker_options"]


class StreamShard(IterableDataset):
    """One rank's batches of a stream (see this module's docstring): yields
    ``(items per rank in the batch, collated batch)`` for the rank's batches, this worker's
    share of them, after skipping the stream's first ``skip`` items."""

    def __init__(self, dataset, batch_size: int, *, num_replicas: int, rank: int,
                 drop_last: bool, collate_fn, skip: int = 0, epoch: int = 0):
        check_shard(batch_size, num_replicas, rank)
        self.dataset, self.batch_size = dataset, batch_size
        self.num_replicas, self.rank, self.drop_last = num_replicas, rank, drop_last
        self.collate_fn, self.skip, self.epoch = collate_fn, skip, epoch

    @property
    def round_size(self) -> int:
        return self.batch_size * self.num_replicas

    def batches(self, n_items: int) -> int:
        """Batches per rank for a stream of ``n_items`` items (after the skip)."""
        full, tail = divmod(n_items, self.round_size)
        return full + (0 if self.drop_last or tail < self.num_replicas else 1)

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(self.epoch)
        n, rank, size = self.num_replicas, self.rank, self.round_size
        stream = _hidden_workers(self.dataset)
        for _ in range(self.skip):  # a stream cannot seek: read and drop
            if next(stream, _END) is _END:
                return
        mine: list = []
        count = 0
        for i, item in enumerate(stream):
            count = i + 1
            batch, pos = divmod(i, size)
            if batch % workers != worker:
                continue
            if pos % n == rank:
                mine.append(item)
            if pos == size - 1:  # the round is complete on every rank: hand it out
                yield len(mine), self.collate_fn(mine)
                mine = []
        tail = count % size
        keep = tail // n  # equal on every rank; the last tail % n items are dropped
        if mine and not self.drop_last and keep and (count // size) % workers == worker:
            yield keep, self.collate_fn(mine[:keep])


_END = object()


def _hidden_workers(dataset):
    """Iterate ``dataset`` with ``get_worker_info()`` reporting None (while ``iter`` and each
    ``next`` run): the whole stream, which the shard splits."""
    if not data_internals.can_hide_worker():  # pragma: no cover - other torch layouts
        yield from dataset
        return
    with data_internals.hidden_worker():
        it = iter(dataset)
    while True:
        with data_internals.hidden_worker():
            item = next(it, _END)
        if item is _END:
            return
        yield item


def _unpack(item):
    """The DataLoader's collate_fn for a StreamShard: batches arrive already collated."""
    return item


def stream_loader(shard: StreamShard, base: DataLoader, device: torch.device,
                  epoch: int) -> DataLoader:
    """One pass's DataLoader over a fresh copy of `shard` (with its skip, and `epoch`: workers
    pickle it when they start, afresh each pass), with the user's loader `base`'s workers."""
    fresh = StreamShard(shard.dataset, shard.batch_size, num_replicas=shard.num_replicas,
                        rank=shard.rank, drop_last=shard.drop_last,
                        collate_fn=shard.collate_fn, skip=shard.skip, epoch=epoch)
    return DataLoader(fresh, batch_size=None, collate_fn=_unpack, persistent_workers=False,
                      **worker_options(base, device))


def worker_options(base: DataLoader, device: torch.device) -> dict:
    """The user's loader `base`'s worker settings for an inner DataLoader, and its memory
    pinning where it helps (a CUDA device)."""
    return dict(num_workers=base.num_workers, pin_memory=base.pin_memory and device.type == "cuda",
                timeout=base.timeout, worker_init_fn=base.worker_init_fn,
                multiprocessing_context=base.multiprocessing_context,
                prefetch_factor=base.prefetch_factor if base.num_workers > 0 else None)
