"""Which items each data-parallel rank of a prepared loader reads: `ShardedBatchSampler` for
map-style datasets, as Hugging Face Accelerate shards them, and `StreamShard` for streams.

Map-style datasets. The epoch's order (`meshfit.accelerator.shuffle`) is cut into the
loader's batches; rank r of n takes batches r, r + n, ... (the global batch is ``batch_size x
n``), or with ``split_batches=True`` a slice of every batch. Gathering in rank order restores
the global order. When the global batch does not divide the dataset, ``even_batches=True``
(default) completes the last round with samples from the start of the epoch, so that every
rank receives the same number of full batches (the duplicates end the gathered last round,
where `Accelerator.gather_for_metrics` drops them: ``remainder`` = ``len(dataset) %
total_batch_size`` real samples); ``even_batches=False`` gives the short last batch to its
rank alone (see `Accelerator.join_uneven_inputs`); ``drop_last=True`` drops the round. On one
rank the batches are the loader's own.

Streams (a DataLoader over an ``IterableDataset``) are sharded by position, meshfit's own
scheme (Accelerate reads a stream on rank 0 and sends each rank its slice): item i goes to
rank ``i % world``, and batch b of every rank comes from round b, items ``[b x round, (b+1) x
round)``, ``round = batch_size x world`` (gathered in rank order: the round's items,
interleaved). Every rank, and every DataLoader worker w of W (keeping the rank's batches ``b %
W == w``: the same batches with any number of workers), reads the whole stream, so it must
yield the same items in the same order each time (a dataset that splits itself between
workers is iterated with the worker information hidden). As every rank sees the whole stream,
a batch is handed out only once its round is complete: all ranks stop after the same number
of batches with no collective and no ``__len__``. A tail that does not fill a round is
dropped (``drop_last``) or shared as a last batch of ``tail // world`` items per rank (at
most ``world - 1`` items dropped); nothing is padded. A stream cannot seek: a resumed one is
re-read and its first items dropped.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler, get_worker_info

__all__ = ["ShardedBatchSampler", "StreamShard", "stream_loader", "worker_options"]


def _check_shard(batch_size: int, num_replicas: int, rank: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank={rank} must be in [0, num_replicas={num_replicas})")


class ShardedBatchSampler(Sampler[list[int]]):
    """One rank's batches of sample indices (see this module's docstring). `order` is None
    (the dataset's order) or ``order(n) -> list[int]``, called once per pass when the first
    batch is asked for; `after_order` (optional) when the order has been read out (the
    second draw of torch's RandomSampler)."""

    def __init__(self, num_samples: int, batch_size: int, *, num_replicas: int, rank: int,
                 order=None, after_order=None, drop_last: bool = False,
                 even_batches: bool = True, split_batches: bool = False):
        _check_shard(batch_size, num_replicas, rank)
        if split_batches and batch_size % num_replicas:
            raise ValueError(f"split_batches=True: the batch size ({batch_size}) must be a "
                             f"multiple of the number of processes ({num_replicas})")
        self.num_samples, self.loader_batch_size = num_samples, batch_size
        self.num_replicas, self.rank = num_replicas, rank
        self.order, self.after_order = order, after_order
        self.drop_last, self.even_batches = drop_last, even_batches
        self.split_batches = split_batches and num_replicas > 1
        self.skip = 0  # batches the next iteration leaves out (to resume inside an epoch)

    @property
    def batch_size(self) -> int:
        """Samples per batch on this rank."""
        return self.loader_batch_size // self.num_replicas if self.split_batches \
            else self.loader_batch_size

    @property
    def round_size(self) -> int:
        """Samples of all ranks per batch (the loader's ``total_batch_size``)."""
        return self.loader_batch_size if self.split_batches \
            else self.loader_batch_size * self.num_replicas

    def __len__(self) -> int:
        n, size = self.num_replicas, self.loader_batch_size
        batches = self.num_samples // size if self.drop_last else math.ceil(self.num_samples / size)
        if n == 1 or self.split_batches:
            return batches
        if self.drop_last or batches % n == 0:
            return batches // n
        if self.even_batches:
            return batches // n + 1
        return batches // n + (1 if self.rank < batches % n else 0)

    @property
    def remainder(self) -> int:
        """Real samples in an epoch's last round (0: full; -1: drop_last, nothing padded)."""
        return -1 if self.drop_last else self.num_samples % self.round_size

    def _indices(self):
        """The epoch's sample order, drawn lazily as torch's samplers draw it."""
        if self.order is None:
            yield from range(self.num_samples)
            return
        yield from self.order(self.num_samples)
        if self.after_order is not None:
            self.after_order(self.num_samples)

    def _batches(self):
        """The loader's own batches (its BatchSampler over the epoch's order)."""
        batch: list[int] = []
        for i in self._indices():
            batch.append(i)
            if len(batch) == self.loader_batch_size:
                yield batch
                batch = []
        if batch and not self.drop_last:
            yield batch

    def __iter__(self):
        skip, self.skip = self.skip, 0
        if self.num_replicas == 1:
            shards = self._batches()
        elif self.split_batches:
            shards = self._split()
        else:
            shards = self._by_batch()
        for i, batch in enumerate(shards):
            if i >= skip:
                yield batch

    def _by_batch(self):
        """Rank r takes every n-th batch, from the r-th; a round is handed out only when all
        of its batches are full (even_batches: the last round is completed from the start)."""
        n, r, bs = self.num_replicas, self.rank, self.loader_batch_size
        start: list[int] = []  # the first n batches' samples, to complete the last round
        mine = None
        idx, batch = -1, []
        for idx, batch in enumerate(self._batches()):
            if not self.drop_last and idx < n:
                start += batch
            if idx % n == r:
                mine = batch
            if idx % n == n - 1 and len(batch) == bs:
                yield mine
                mine = None
        if self.drop_last or not start:
            return
        if not self.even_batches:
            if mine:
                yield mine
            return
        if mine and len(mine) == bs:
            yield mine
        while len(start) < n * bs:  # fewer samples than one round
            start += start
        if len(batch) == bs:  # the last batch was full: its round continues after it
            batch, idx = [], idx + 1
        taken = 0
        while idx % n != 0 or batch:
            end = taken + bs - len(batch)
            batch = batch + start[taken:end]
            if idx % n == r:
                yield batch
            taken = end
            batch, idx = [], idx + 1

    def _split(self):
        """Every batch cut into n equal slices; a short last batch is completed from the
        epoch's first batch (even_batches) or sliced as far as it goes."""
        n, r, bs = self.num_replicas, self.rank, self.loader_batch_size
        per = bs // n
        first: list[int] = []
        batch: list[int] = []
        for idx, batch in enumerate(self._batches()):
            if idx == 0:
                first = batch
            if len(batch) == bs:
                yield batch[per * r: per * (r + 1)]
        if self.drop_last or not first or len(batch) == bs:
            return
        if not self.even_batches:
            if len(batch) > per * r:
                yield batch[per * r: per * (r + 1)]
            return
        while len(first) < bs:
            first = first + first
        yield (batch + first)[per * r: per * (r + 1)]


# ----------------------------------------------------------------------------- streams
class StreamShard(IterableDataset):
    """One rank's batches of a stream (see this module's docstring): yields
    ``(items per rank in the batch, collated batch)`` for the rank's batches, this worker's
    share of them, after skipping the stream's first ``skip`` items."""

    def __init__(self, dataset, batch_size: int, *, num_replicas: int, rank: int,
                 drop_last: bool, collate_fn, skip: int = 0, epoch: int = 0):
        _check_shard(batch_size, num_replicas, rank)
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
    from torch.utils.data._utils import worker as worker_mod

    if not hasattr(worker_mod, "_worker_info"):  # pragma: no cover - other torch layouts
        yield from dataset
        return

    @contextlib.contextmanager
    def hidden():
        saved, worker_mod._worker_info = worker_mod._worker_info, None
        try:
            yield
        finally:
            worker_mod._worker_info = saved

    with hidden():
        it = iter(dataset)
    while True:
        with hidden():
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
