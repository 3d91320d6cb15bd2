"""Data loaders prepared for data parallel training.

Each data-parallel rank receives batches of the loader's own ``batch_size`` (Accelerate's
default, ``split_batches=False``), so the global batch is ``batch_size x dp ranks``.

Sharding is by *global batch*: the epoch's sample order (a seeded permutation, identical on
every rank) is cut into rounds of ``batch_size x world`` samples and rank r takes the r-th
slice of each round. Gathering the ranks' outputs in rank order therefore restores the global
order. When the dataset does not divide evenly, the R samples of the last round are split into
equal slices of ceil(R / world) (completed with samples from the start of the epoch); those
duplicates sit at the end of the gathered last round, where `Accelerator.gather_for_metrics`
drops them.

Streams (a DataLoader over an ``IterableDataset``) have no index to permute, so they are
sharded by position instead: item i of the stream (counted from its start) goes to rank
``i % world``, and a rank's items are cut into batches of ``batch_size``, so batch b of every
rank comes from round b, items ``[b x round, (b+1) x round)`` with
``round = batch_size x world`` (gathered in rank order, a round's items arrive as rank 0's
every-world-th item, then rank 1's, ...: the round's items, interleaved). Every rank
(and, with ``num_workers > 0``, every worker) iterates the whole stream and keeps only its own
items; worker w of W keeps the rank's batches ``b % W == w``, which the DataLoader hands out
in order, so the batches are the same with any number of workers. The stream is therefore
read ``world x max(1, num_workers)`` times and must yield the same items in the same order
each time (a dataset that splits itself between DataLoader workers, as a ``datasets``
``IterableDataset`` does, is iterated with the worker information hidden, so it too yields
the whole stream). Because every rank sees the whole stream, every rank also knows where it
ends: a batch is handed out only once the stream has reached the end of its round, so all
ranks stop after the same number of batches with no collective and no ``__len__``. The tail
that does not fill a round is dropped (``drop_last=True``), or (``drop_last=False``) shared
as a last, smaller batch of ``tail // world`` items per rank, dropping at most ``world - 1``
items. Nothing is padded, so ``gather_for_metrics`` has nothing to trim.

A stream's position is the number of its items the ranks consumed together; resuming (or
``skip_first_batches``) re-reads the stream from its start and skips that many items; it
cannot seek. That position means the same on any number of ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler
from torch.utils.data import get_worker_info

from meshfit.distributed.collectives import apply_to_tensors

_DEFAULT_SEED = 1234


class ShardedBatchSampler(Sampler[list[int]]):
    """Batches of sample indices for one rank; the same seed and epoch give the same order on
    every rank, a new epoch gives a new order."""

    def __init__(self, num_samples: int, batch_size: int, *, num_replicas: int, rank: int,
                 shuffle: bool, seed: int = _DEFAULT_SEED, drop_last: bool = False):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank={rank} must be in [0, num_replicas={num_replicas})")
        self.num_samples, self.batch_size = num_samples, batch_size
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        self.skip = 0  # rounds the next iteration leaves out (to resume inside an epoch)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def round_size(self) -> int:
        return self.batch_size * self.num_replicas

    def __len__(self) -> int:
        rounds = self.num_samples / self.round_size
        return math.floor(rounds) if self.drop_last else math.ceil(rounds)

    @property
    def remainder(self) -> int:
        """Real (not padded) samples in the last round of an epoch."""
        return min(self.num_samples - (len(self) - 1) * self.round_size, self.round_size)

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_samples, generator=g).tolist()

    def __iter__(self):
        order = self._order()
        rounds = len(self)
        first, self.skip = min(self.skip, rounds), 0
        for i in range(first, rounds):
            start = i * self.round_size
            chunk = order[start: start + self.round_size]
            # An uneven last round gives every rank ceil(R / world) samples, completed with
            # samples from the epoch's start, so ranks keep equal shapes (DDP and gather need
            # it) and a single process sees exactly the dataset.
            per_rank = math.ceil(len(chunk) / self.num_replicas)
            while len(chunk) < per_rank * self.num_replicas:
                chunk += order[: per_rank * self.num_replicas - len(chunk)]
            yield chunk[self.rank * per_rank: (self.rank + 1) * per_rank]


class StreamShard(IterableDataset):
    """One rank's batches of a stream (see the module docstring): yields
    ``(items per rank in the batch, collated batch)`` for the rank's batches, this worker's
    share of them, after skipping the stream's first ``skip`` items."""

    def __init__(self, dataset, batch_size: int, *, num_replicas: int, rank: int,
                 drop_last: bool, collate_fn, skip: int = 0, epoch: int = 0):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank={rank} must be in [0, num_replicas={num_replicas})")
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
    ``next`` run), so a dataset that would split itself between DataLoader workers yields
    the whole stream (the shard splits it)."""
    from torch.utils.data._utils import worker as worker_mod

    if not hasattr(worker_mod, "_worker_info"):  # pragma: no cover - other torch layouts
        yield from dataset
        return
    saved = worker_mod._worker_info
    worker_mod._worker_info = None
    try:
        it = iter(dataset)
    finally:
        worker_mod._worker_info = saved
    while True:
        saved = worker_mod._worker_info
        worker_mod._worker_info = None
        try:
            item = next(it)
        except StopIteration:
            return
        finally:
            worker_mod._worker_info = saved
        yield item


class _Unpack:
    """The DataLoader's collate_fn for a StreamShard: batches arrive already collated."""

    def __call__(self, item):
        return item


@dataclass
class LoaderState:
    """What the accelerator needs to know about the loader being iterated."""

    end_of_dataloader: bool = False
    remainder: int = -1  # real samples in the final round; -1: no padding to drop


class PreparedDataLoader:
    """A DataLoader whose batches are this rank's shard, moved to the device.

    It looks one batch ahead, so the accelerator knows when the last batch is being used
    (gradient accumulation syncs there; gather_for_metrics trims the padding there), and so
    the next batch's host-to-device copy is issued while the current batch computes: on CUDA
    the copy runs on a side stream from pinned memory (``non_blocking``), and the compute
    stream waits for it only when the batch is handed out.

    The loader's ``num_workers``, ``prefetch_factor``, ``persistent_workers``,
    ``worker_init_fn``, ``collate_fn`` and ``timeout`` are kept; ``pin_memory`` is honoured
    where it helps (a CUDA device) and dropped elsewhere.

    A loader over an ``IterableDataset`` (a stream) is sharded by position (see the module
    docstring); its workers are started afresh for each pass (``persistent_workers`` is not
    kept), since each pass re-reads the stream with that pass's skip and epoch.
    """

    def __init__(self, loader: DataLoader, *, device: torch.device, num_replicas: int,
                 rank: int, on_iter=None, on_end=None):
        self.base = loader
        self.device = device
        self.state = LoaderState()
        self._on_iter = on_iter
        self._on_end = on_end  # called when an iteration stops (read out, or left early)
        self._epoch = 0
        # (epoch being read, batches handed out in it; for a stream: its items consumed)
        self._position = (0, 0)
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.stream: StreamShard | None = None
        if isinstance(loader.dataset, IterableDataset):
            if loader.batch_size is None:
                raise ValueError("prepare(dataloader): an IterableDataset loader needs a "
                                 "batch_size; give the DataLoader batch_size=N (the stream "
                                 "yields single samples, which are batched per rank)")
            self.batch_sampler = None
            self.stream = StreamShard(loader.dataset, loader.batch_size,
                                      num_replicas=num_replicas, rank=rank,
                                      drop_last=loader.drop_last, collate_fn=loader.collate_fn)
            self.loader = None  # built per pass, see _stream_loader
            return
        self.batch_sampler = self._make_batch_sampler(loader, num_replicas, rank)
        self.loader = DataLoader(
            loader.dataset,
            batch_sampler=self.batch_sampler,
            num_workers=loader.num_workers,
            collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory and device.type == "cuda",
            timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn,
            multiprocessing_context=loader.multiprocessing_context,
            prefetch_factor=loader.prefetch_factor if loader.num_workers > 0 else None,
            persistent_workers=loader.persistent_workers,
        )

    @staticmethod
    def _make_batch_sampler(loader: DataLoader, num_replicas: int, rank: int):
        if loader.batch_size is None or not isinstance(loader.batch_sampler, BatchSampler):
            raise ValueError("prepare(dataloader): a custom batch_sampler is not supported yet; "
                             "give the DataLoader a batch_size (and shuffle=True/False) instead")
        sampler = loader.sampler
        if not isinstance(sampler, (RandomSampler, torch.utils.data.SequentialSampler)):
            raise ValueError(f"prepare(dataloader): sampler {type(sampler).__name__} is not "
                             "supported yet; use shuffle=True or shuffle=False")
        shuffle = isinstance(sampler, RandomSampler)
        seed = _DEFAULT_SEED
        if loader.generator is not None:
            seed = loader.generator.initial_seed()
        return ShardedBatchSampler(len(loader.dataset), loader.batch_size,
                                   num_replicas=num_replicas, rank=rank, shuffle=shuffle,
                                   seed=seed, drop_last=loader.drop_last)

    @property
    def dataset(self):
        return self.base.dataset

    @property
    def batch_size(self) -> int:
        return (self.batch_sampler if self.stream is None else self.stream).batch_size

    @property
    def total_batch_size(self) -> int:
        return (self.batch_sampler if self.stream is None else self.stream).round_size

    def set_epoch(self, epoch: int) -> None:
        """Choose the shuffling of the next iteration (otherwise each iteration advances it)."""
        self._epoch = epoch

    def __len__(self) -> int:
        if self.stream is not None:
            try:
                n_items = len(self.stream.dataset)
            except TypeError:
                raise TypeError("this prepared loader streams an IterableDataset without "
                                "__len__, so its number of batches is unknown") from None
            return self.stream.batches(n_items)
        return len(self.batch_sampler)

    def skip_first_batches(self, num_batches: int) -> None:
        """Leave out the first `num_batches` batches (rounds of all ranks) of the next
        iteration, as a resumed run does for what it had already consumed. A stream is
        re-read from its start and its first ``num_batches x total_batch_size`` items are
        read and dropped."""
        if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 0:
            raise ValueError(f"num_batches={num_batches!r} must be an integer >= 0")
        if self.stream is not None:
            self.stream.skip = num_batches * self.stream.round_size
            return
        self.batch_sampler.skip = num_batches

    def state_dict(self) -> dict[str, int]:
        """Where reading stands, by global position: the epoch being read (its shuffle) and
        the samples of all ranks handed out in it. The order of samples is the epoch's
        permutation (for a stream: the stream) cut into rounds of `total_batch_size`, so the
        position means the same on any number of ranks."""
        epoch, batches = self._position
        if self.stream is not None:
            return {"epoch": epoch, "samples": batches}  # a stream counts items directly
        return {"epoch": epoch, "samples": batches * self.total_batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue at `state`'s position: the next iteration reads that epoch from the
        sample after the last one handed out (which must fall on a batch boundary of this
        job's global batch; a stream is re-read and skipped to it, at any boundary)."""
        epoch, samples = int(state["epoch"]), int(state["samples"])
        if self.stream is not None:
            if samples < 0:
                raise ValueError(f"the saved loader position samples={samples} must be >= 0")
            self._epoch = epoch
            self._position = (epoch, samples)
            self.stream.skip = samples
            return
        if samples % self.total_batch_size:
            raise ValueError(f"the saved loader had handed out {samples} samples of epoch "
                             f"{epoch}, which is not a whole number of this job's global "
                             f"batches of {self.total_batch_size}; resume with a global batch "
                             "that divides it")
        self._epoch = epoch
        self._position = (epoch, samples // self.total_batch_size)
        self.skip_first_batches(samples // self.total_batch_size)

    def _to_device(self, batch):
        """Start copying `batch` to the device; returns (batch, event). Pass both to `_ready`
        before using the batch."""
        if self._copy_stream is None:
            return apply_to_tensors(lambda t: t.to(self.device), batch), None
        with torch.cuda.stream(self._copy_stream):
            moved = apply_to_tensors(lambda t: t.to(self.device, non_blocking=True), batch)
            done = torch.cuda.Event()
            done.record(self._copy_stream)  # this batch's copies only, not later ones
        return moved, done

    def _ready(self, pending):
        """Make the compute stream wait for this batch's copy (and no later one), and own the
        batch's memory from now on."""
        batch, done = pending
        if done is None:
            return batch
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(done)

        def own(t: torch.Tensor) -> torch.Tensor:
            if t.device.type == "cuda":
                t.record_stream(compute)  # the allocator must not reuse it while compute runs
            return t

        return apply_to_tensors(own, batch)

    def _stream_loader(self) -> DataLoader:
        """This pass's DataLoader over a fresh StreamShard (workers pickle the shard when
        they start, so its skip and epoch must be set before)."""
        base, shard = self.base, self.stream
        fresh = StreamShard(shard.dataset, shard.batch_size, num_replicas=shard.num_replicas,
                            rank=shard.rank, drop_last=shard.drop_last,
                            collate_fn=shard.collate_fn, skip=shard.skip, epoch=self._epoch)
        return DataLoader(
            fresh,
            batch_size=None,
            num_workers=base.num_workers,
            collate_fn=_Unpack(),
            pin_memory=base.pin_memory and self.device.type == "cuda",
            timeout=base.timeout,
            worker_init_fn=base.worker_init_fn,
            multiprocessing_context=base.multiprocessing_context,
            prefetch_factor=base.prefetch_factor if base.num_workers > 0 else None,
            persistent_workers=False,
        )

    def _iter_stream(self):
        try:
            yield from self._iter_stream_body()
        finally:
            if self._on_end is not None:
                self._on_end(self)

    def _iter_stream_body(self):
        handed = self.stream.skip  # items of the stream consumed, all ranks together
        loader = self._stream_loader()
        self.stream.skip = 0
        self._position = (self._epoch, handed)
        self._epoch += 1
        self.state.end_of_dataloader = False
        self.state.remainder = -1  # nothing is padded
        if self._on_iter is not None:
            self._on_iter(self)
        n = self.stream.num_replicas
        it = iter(loader)
        try:
            count, batch = next(it)
        except StopIteration:
            self._position = (self._epoch, 0)
            return
        current = (count, self._to_device(batch))
        while True:
            try:
                count, batch = next(it)
                upcoming = (count, self._to_device(batch))
            except StopIteration:
                self.state.end_of_dataloader = True
                handed += current[0] * n
                self._position = (self._position[0], handed)
                yield self._ready(current[1])
                self._position = (self._epoch, 0)  # the stream is read out
                return
            handed += current[0] * n
            self._position = (self._position[0], handed)
            yield self._ready(current[1])
            current = upcoming

    def __iter__(self):
        if self.stream is not None:
            yield from self._iter_stream()
            return
        try:
            yield from self._iter_batches()
        finally:
            if self._on_end is not None:
                self._on_end(self)

    def _iter_batches(self):
        self.batch_sampler.set_epoch(self._epoch)
        handed = self.batch_sampler.skip
        self._position = (self._epoch, handed)
        self._epoch += 1
        self.state.end_of_dataloader = False
        self.state.remainder = -1
        if self._on_iter is not None:
            self._on_iter(self)
        it = iter(self.loader)
        try:
            current = self._to_device(next(it))
        except StopIteration:
            return
        while True:
            try:
                upcoming = self._to_device(next(it))
            except StopIteration:
                self.state.end_of_dataloader = True
                if self.batch_sampler.remainder < self.batch_sampler.round_size:
                    self.state.remainder = self.batch_sampler.remainder
                handed += 1
                self._position = (self._position[0], handed)
                yield self._ready(current)
                self._position = (self._epoch, 0)  # the epoch is read out
                return
            handed += 1
            self._position = (self._position[0], handed)
            yield self._ready(current)
            current = upcoming
