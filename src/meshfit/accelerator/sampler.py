"""Map-style datasets sharded over the data-parallel ranks as Hugging Face Accelerate shards
them: `ShardedBatchSampler`, one rank's batches of sample indices.

The epoch's order (`meshfit.accelerator.shuffle`) is cut into the loader's batches; rank r of
n takes batches r, r + n, ... (the global batch is ``batch_size x n``), or with
``split_batches=True`` a slice of every batch. Gathering in rank order restores the global
order. When the global batch does not divide the dataset, ``even_batches=True`` (default)
completes the last round with samples from the start of the epoch, so that every rank
receives the same number of full batches (the duplicates end the gathered last round, where
`Accelerator.gather_for_metrics` drops them: ``remainder`` = ``len(dataset) %
total_batch_size`` real samples); ``even_batches=False`` gives the short last batch to its
rank alone (see `Accelerator.join_uneven_inputs`); ``drop_last=True`` drops the round. On one
rank the batches are the loader's own.
"""

from __future__ import annotations

import math

import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, Sampler

__all__ = ["ShardedBatchSampler", "check_shard", "custom_batches", "inner_sampler"]


def custom_batches(loader: DataLoader):
    """The user's own batch sampler, whose batches are sharded as they come (None: the loader
    has a batch_size, and its batches are made here): a ``batch_sampler=``, or a ``sampler=``
    of whole batches with ``batch_size=None``."""
    if loader.batch_size is not None:
        return None
    if loader.batch_sampler is not None:
        return loader.batch_sampler
    if isinstance(loader.sampler, BatchSampler) or hasattr(loader.sampler, "batch_size"):
        return loader.sampler
    raise ValueError("prepare(dataloader): batch_size=None (the dataset yields whole batches) "
                     "is not supported yet: meshfit shards the samples of each batch over the "
                     "processes; give the DataLoader a batch_size or a batch_sampler")


def inner_sampler(batches, num_replicas: int):
    """The sample sampler inside a custom batch sampler, for the shuffle to drive: a
    RandomSampler without a generator gets one, seeded from the global generator, so that
    every process (given process 0's state at each pass) draws the same order, as Accelerate
    does; None when there is no such sampler (the batch sampler orders itself)."""
    sampler = getattr(batches, "sampler", None)
    if not isinstance(sampler, RandomSampler):
        return None
    if sampler.generator is None and num_replicas > 1 and not hasattr(sampler, "initial_seed"):
        # (a SeedableRandomSampler seeds itself from data_seed + epoch)
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
        sampler.generator = torch.Generator().manual_seed(seed)
    return sampler


def check_shard(batch_size: int, num_replicas: int, rank: int) -> None:
    """Refuse a batch size below 1 or a rank outside the ranks (a map-style or stream shard)."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank={rank} must be in [0, num_replicas={num_replicas})")


class ShardedBatchSampler(Sampler[list[int]]):
    """One rank's batches of sample indices. `order` is None (the dataset's order) or ``order(n)
    -> list[int]``, called when a pass's first batch is asked for; `after_order` (optional)
    when the order has been read out (the second draw of torch's RandomSampler)."""

    def __init__(self, num_samples: int, batch_size: int, *, num_replicas: int, rank: int,
                 order=None, after_order=None, drop_last: bool = False,
                 even_batches: bool = True, split_batches: bool = False, batches=None):
        check_shard(batch_size, num_replicas, rank)
        if split_batches and batch_size % num_replicas:
            raise ValueError(f"split_batches=True: the batch size ({batch_size}) must be a "
                             f"multiple of the number of processes ({num_replicas})")
        self.num_samples, self.loader_batch_size = num_samples, batch_size
        self.num_replicas, self.rank = num_replicas, rank
        self.order, self.after_order = order, after_order
        self.drop_last, self.even_batches = drop_last, even_batches
        self.split_batches = split_batches and num_replicas > 1
        self.skip = 0  # batches the next iteration leaves out (to resume inside an epoch)
        # The user's batch sampler (None: batches of batch_size over `order` are made here).
        self.batch_sampler = batches

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
        if self.batch_sampler is not None:
            batches = len(self.batch_sampler)
        else:
            batches = self.num_samples // size if self.drop_last \
                else math.ceil(self.num_samples / size)
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
        """The loader's own batches (its BatchSampler over the epoch's order, or the user's
        batch sampler's)."""
        if self.batch_sampler is not None:
            yield from (list(batch) for batch in self.batch_sampler)
            return
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
