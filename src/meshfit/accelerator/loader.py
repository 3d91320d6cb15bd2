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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler

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
    """

    def __init__(self, loader: DataLoader, *, device: torch.device, num_replicas: int,
                 rank: int, on_iter=None):
        self.base = loader
        self.device = device
        self.state = LoaderState()
        self._on_iter = on_iter
        self._epoch = 0
        self._position = (0, 0)  # (epoch being read, batches handed out in it)
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        if isinstance(loader.dataset, IterableDataset):
            raise ValueError("prepare(dataloader): IterableDataset loaders are not supported "
                             "yet; use a map-style Dataset (with __len__ and __getitem__)")
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
        return self.batch_sampler.batch_size

    @property
    def total_batch_size(self) -> int:
        return self.batch_sampler.round_size

    def set_epoch(self, epoch: int) -> None:
        """Choose the shuffling of the next iteration (otherwise each iteration advances it)."""
        self._epoch = epoch

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def skip_first_batches(self, num_batches: int) -> None:
        """Leave out the first `num_batches` batches (rounds of all ranks) of the next
        iteration, as a resumed run does for what it had already consumed."""
        if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 0:
            raise ValueError(f"num_batches={num_batches!r} must be an integer >= 0")
        self.batch_sampler.skip = num_batches

    def state_dict(self) -> dict[str, int]:
        """Where reading stands, by global position: the epoch being read (its shuffle) and
        the samples of all ranks handed out in it. The order of samples is the epoch's
        permutation cut into rounds of `total_batch_size`, so the position means the same
        on any number of ranks."""
        epoch, batches = self._position
        return {"epoch": epoch, "samples": batches * self.total_batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue at `state`'s position: the next iteration reads that epoch from the
        sample after the last one handed out (which must fall on a batch boundary of this
        job's global batch)."""
        epoch, samples = int(state["epoch"]), int(state["samples"])
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

    def __iter__(self):
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
