"""Data loaders prepared for data parallel training, sharded as Hugging Face Accelerate does.

Map-style datasets (`ShardedBatchSampler`). The epoch's sample order is drawn as the loader's
own ``RandomSampler`` would draw it (or ``range(n)`` without shuffling) and cut into batches
of the loader's ``batch_size``, as its ``BatchSampler`` would; with ``split_batches=False``
(Accelerate's default) rank r of n takes batches r, r + n, r + 2n, ... (each rank receives
batches of ``batch_size``, the global batch is ``batch_size x n``), with
``split_batches=True`` every batch is cut into n equal slices. Gathering the ranks' outputs
in rank order restores the global order. When the global batch does not divide the dataset:

- ``even_batches=True`` (default): the last round is completed with samples from the start of
  the epoch, so that every rank receives the same number of full batches; the duplicates sit
  at the end of the gathered last round, where `Accelerator.gather_for_metrics` drops them
  (``remainder`` = ``len(dataset) % total_batch_size`` real samples).
- ``even_batches=False``: the short last batch goes to its rank alone; ranks may receive
  different numbers of batches (see `Accelerator.join_uneven_inputs`).
- ``drop_last=True``: the incomplete round is dropped.

On one data-parallel rank nothing is sharded or padded: the batches are the loader's own.

Shuffling draws from the generators that Accelerate draws from, at the same moments, so that
a seeded script sees the same samples in the same order under Accelerate and meshfit:

- the loader's ``generator`` (a copy of it, taken when prepared), carried from epoch to epoch;
- with several data-parallel ranks and no generator: a generator seeded, when the loader is
  prepared, from the global torch generator (one draw);
- on one rank without a generator: a seed drawn from the global torch generator at the start
  of each pass, as ``RandomSampler`` does;
- ``use_seedable_sampler``: a generator seeded ``data_seed + epoch`` each epoch.

With more than one process, a carried generator's state is broadcast from rank 0 at the start
of every pass (Accelerate's ``rng_types=["generator"]``), so every rank draws the same order.
Each pass draws one permutation, then a second one when the order is read out, and the inner
``DataLoader`` draws its workers' base seed from the loader's generator (or the global one)
when each pass starts, as torch's own loader does.

Streams (a DataLoader over an ``IterableDataset``) have no index to permute, so they are
sharded by position instead: item i of the stream (counted from its start) goes to rank
``i % world``, and a rank's items are cut into batches of ``batch_size``, so batch b of every
rank comes from round b, items ``[b x round, (b+1) x round)`` with
``round = batch_size x world`` (gathered in rank order, a round's items arrive as rank 0's
every-world-th item, then rank 1's, ...: the round's items, interleaved). This is meshfit's
own scheme, not Accelerate's (which reads a stream on rank 0 only and sends each rank its
slice). Every rank (and, with ``num_workers > 0``, every worker) iterates the whole stream and
keeps only its own items; worker w of W keeps the rank's batches ``b % W == w``, which the
DataLoader hands out in order, so the batches are the same with any number of workers. The
stream is therefore read ``world x max(1, num_workers)`` times and must yield the same items
in the same order each time (a dataset that splits itself between DataLoader workers, as a
``datasets`` ``IterableDataset`` does, is iterated with the worker information hidden, so it
too yields the whole stream). Because every rank sees the whole stream, every rank also knows
where it ends: a batch is handed out only once the stream has reached the end of its round,
so all ranks stop after the same number of batches with no collective and no ``__len__``. The
tail that does not fill a round is dropped (``drop_last=True``), or (``drop_last=False``)
shared as a last, smaller batch of ``tail // world`` items per rank, dropping at most
``world - 1`` items. Nothing is padded, so ``gather_for_metrics`` has nothing to trim.

A loader's position is the epoch being read and the samples of all ranks handed out in it
(for a stream: its items consumed), plus the shuffling generator's state at the start of the
pass: it means the same on any number of ranks. `Accelerator.load_state` restores it when the
loaders are stateful (``DataLoaderConfiguration(use_stateful_dataloader=True)``); a stream is
re-read from its start and skipped to its position, it cannot seek.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler
from torch.utils.data import get_worker_info

from meshfit.distributed.collectives import apply_to_tensors


def _draw_seed(generator: torch.Generator | None = None) -> int:
    """One int64 drawn as torch's RandomSampler and DataLoader draw their seeds."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


class ShardedBatchSampler(Sampler[list[int]]):
    """One rank's batches of sample indices (see the module docstring).

    `shuffle` is None (the dataset's order) or a callable ``order(n) -> list[int]`` that draws
    an epoch's permutation and is called once per pass, when the first batch is asked for;
    `after_order` (optional) is called when the order has been read out (the second draw of
    torch's RandomSampler)."""

    def __init__(self, num_samples: int, batch_size: int, *, num_replicas: int, rank: int,
                 order=None, after_order=None, drop_last: bool = False,
                 even_batches: bool = True, split_batches: bool = False):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank={rank} must be in [0, num_replicas={num_replicas})")
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

    def _global_batches(self) -> int:
        if self.drop_last:
            return self.num_samples // self.loader_batch_size
        return math.ceil(self.num_samples / self.loader_batch_size)

    def __len__(self) -> int:
        batches, n = self._global_batches(), self.num_replicas
        if n == 1 or self.split_batches or batches % n == 0:
            return batches if (n == 1 or self.split_batches) else batches // n
        if self.drop_last:
            return batches // n
        if self.even_batches:
            return batches // n + 1
        return batches // n + (1 if self.rank < batches % n else 0)

    @property
    def remainder(self) -> int:
        """Real samples in the last round of an epoch (0: the rounds are full); -1 with
        drop_last, where nothing is padded."""
        return -1 if self.drop_last else self.num_samples % self.round_size

    # ------------------------------------------------------------- the global order
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

    # ------------------------------------------------------------- one rank's share
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
    remainder: int = -1  # real samples in the final round (0: full); -1: nothing to trim


def _clone(generator: torch.Generator) -> torch.Generator:
    copy = torch.Generator(device=generator.device)
    copy.set_state(generator.get_state())
    return copy


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def broadcast_state(state: torch.Tensor) -> torch.Tensor:
    """Process 0's generator state (a CPU byte tensor) on every process."""
    if _world() == 1:
        return state
    device = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend() == "nccl" else torch.device("cpu")
    moved = state.to(device)
    dist.broadcast(moved, src=0)
    return moved.cpu()


class Shuffle:
    """Where a map-style loader's epoch order comes from (see the module docstring):
    ``"carried"`` (a generator carried from epoch to epoch), ``"global"`` (a seed drawn from
    the global torch generator each pass) or ``"seedable"`` (``seed + epoch``).

    `pass_state` is what reproduces the order of the pass being read (the carried
    generator's state when the pass drew it, or the pass's seed); `resume`, set by
    `PreparedDataLoader.load_state_dict`, is used instead at the next draw."""

    def __init__(self, mode: str, generator: torch.Generator | None, *, seed: int | None = None,
                 sync: bool = True):
        self.mode, self.generator, self.initial_seed, self.sync = mode, generator, seed, sync
        self.epoch = 0
        self.pass_state = None
        self.resume = None

    def start_pass(self, epoch: int) -> None:
        """Before a pass's DataLoader iterator is made: every process takes process 0's
        carried generator (Accelerate's ``synchronize_rng_states(["generator"])``)."""
        self.epoch = epoch
        if self.mode == "carried" and self.sync and self.resume is None and _world() > 1:
            self.generator.set_state(broadcast_state(self.generator.get_state()))

    def order(self, n: int) -> list[int]:
        if self.mode == "seedable":
            if self.generator is None:
                self.generator = torch.Generator()
                self.generator.manual_seed(self.initial_seed)
            self.generator.manual_seed(self.epoch + self.initial_seed)
            return torch.randperm(n, generator=self.generator).tolist()
        if self.mode == "carried":
            if self.resume is not None:
                self.generator.set_state(self.resume)
                self.resume = None
            self.pass_state = self.generator.get_state()
            return torch.randperm(n, generator=self.generator).tolist()
        seed = self.resume if self.resume is not None else _draw_seed()
        self.resume = None
        if self.sync and _world() > 1:  # every process takes process 0's draw
            seed = int(broadcast_state(torch.tensor([seed], dtype=torch.int64)).item())
        self.pass_state = seed
        local = torch.Generator()
        local.manual_seed(seed)
        self.generator = local
        return torch.randperm(n, generator=local).tolist()

    def after_order(self, n: int) -> None:
        """torch's RandomSampler draws a second, empty slice of a permutation when its order
        is read out; so do we, to leave the generator where it leaves it."""
        if self.generator is not None:
            torch.randperm(n, generator=self.generator)

    def state(self, mid_pass: bool) -> dict:
        """``{"seed": int, "generator": uint8 tensor}``: what restores the order of the pass
        being read (`mid_pass`) or of the next one (-1 and a 1-byte tensor: nothing)."""
        seed, state = -1, torch.zeros(1, dtype=torch.uint8)
        if self.mode == "carried":
            state = self.pass_state if mid_pass and self.pass_state is not None \
                else self.generator.get_state()
        elif self.mode == "global" and mid_pass and self.pass_state is not None:
            seed = int(self.pass_state)
        return {"seed": seed, "generator": state}

    def load(self, state: dict, mid_pass: bool) -> None:
        generator = state.get("generator")
        if self.mode == "carried" and generator is not None and generator.numel() > 1:
            if mid_pass:
                self.resume = generator.clone()
            else:
                self.generator.set_state(generator.clone())
        elif self.mode == "global" and mid_pass and int(state.get("seed", -1)) >= 0:
            self.resume = int(state["seed"])


class PreparedDataLoader:
    """A DataLoader whose batches are this rank's shard, moved to the device.

    It looks one batch ahead, so the accelerator knows when the last batch is being used
    (gradient accumulation syncs there; gather_for_metrics trims the padding there), and so
    the next batch's host-to-device copy is issued while the current batch computes: on CUDA
    the copy runs on a side stream from pinned memory (``non_blocking``), and the compute
    stream waits for it only when the batch is handed out.

    The loader's ``num_workers``, ``prefetch_factor``, ``persistent_workers``,
    ``worker_init_fn``, ``collate_fn``, ``timeout`` and ``generator`` (a copy) are kept;
    ``pin_memory`` is honoured where it helps (a CUDA device) and dropped elsewhere.
    `even_batches`, `split_batches`, `seedable` (with `data_seed`) and `sync_generator` are
    `meshfit.utils.DataLoaderConfiguration`'s and the Accelerator's ``rng_types`` (see the
    module docstring).

    A loader over an ``IterableDataset`` (a stream) is sharded by position (see the module
    docstring); its workers are started afresh for each pass (``persistent_workers`` is not
    kept), since each pass re-reads the stream with that pass's skip and epoch.
    """

    def __init__(self, loader: DataLoader, *, device: torch.device, num_replicas: int,
                 rank: int, on_iter=None, on_end=None, even_batches: bool = True,
                 split_batches: bool = False, seedable: bool = False,
                 data_seed: int | None = None, sync_generator: bool = True):
        self.base = loader
        self.device = device
        self.state = LoaderState()
        self._on_iter = on_iter
        self._on_end = on_end  # called when an iteration stops (read out, or left early)
        self._epoch = 0  # Accelerate's `iteration`: passes read out (or set_epoch)
        # (epoch being read, batches handed out in it; for a stream: its items consumed)
        self._position = (0, 0)
        self._resumed = False  # the next pass continues a restored, partly read pass
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.stream: StreamShard | None = None
        self.shuffle: Shuffle | None = None
        if isinstance(loader.dataset, IterableDataset):
            if loader.batch_size is None:
                raise ValueError("prepare(dataloader): an IterableDataset loader needs a "
                                 "batch_size; give the DataLoader batch_size=N (the stream "
                                 "yields single samples, which are batched per rank)")
            if split_batches:
                raise ValueError("prepare(dataloader): split_batches=True is not available "
                                 "for an IterableDataset; give the per-process batch size")
            self.batch_sampler = None
            self.stream = StreamShard(loader.dataset, loader.batch_size,
                                      num_replicas=num_replicas, rank=rank,
                                      drop_last=loader.drop_last, collate_fn=loader.collate_fn)
            self.loader = None  # built per pass, see _stream_loader
            return
        # torch's loader draws each pass's workers' base seed from this generator (a copy of
        # the loader's, shared with the shuffle) or, when None, from the global one
        self._base_generator = self._make_shuffle(loader, num_replicas, seedable=seedable,
                                                  data_seed=data_seed, sync=sync_generator)
        self.batch_sampler = self._make_batch_sampler(loader, num_replicas, rank,
                                                      even_batches=even_batches,
                                                      split_batches=split_batches)
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

    def _make_shuffle(self, loader: DataLoader, num_replicas: int, *, seedable: bool,
                      data_seed: int | None, sync: bool) -> torch.Generator | None:
        """Set `self.shuffle` from the loader's sampler; returns the generator the inner
        DataLoader draws its base seeds from (a copy of the loader's, shared with the
        shuffle, or None: the global one)."""
        sampler = loader.sampler
        if not isinstance(sampler, (RandomSampler, torch.utils.data.SequentialSampler)):
            raise ValueError(f"prepare(dataloader): sampler {type(sampler).__name__} is not "
                             "supported yet; use shuffle=True or shuffle=False")
        user = loader.generator
        generator = _clone(user) if user is not None else None
        if not isinstance(sampler, RandomSampler):
            return generator
        if sampler.replacement or sampler.num_samples != len(loader.dataset):
            raise ValueError("prepare(dataloader): a RandomSampler with replacement or "
                             "num_samples is not supported yet; use shuffle=True")
        if seedable:
            seed = data_seed if data_seed is not None else torch.random.initial_seed()
            self.shuffle = Shuffle("seedable", generator, seed=seed, sync=sync)
        elif generator is not None:
            self.shuffle = Shuffle("carried", generator, sync=sync)
        elif num_replicas > 1:  # seeded now from the global generator, as Accelerate does
            carried = torch.Generator()
            carried.manual_seed(_draw_seed())
            self.shuffle = Shuffle("carried", carried, sync=sync)
        else:
            self.shuffle = Shuffle("global", None, sync=sync)
        return generator

    def _make_batch_sampler(self, loader: DataLoader, num_replicas: int, rank: int, *,
                            even_batches: bool, split_batches: bool) -> ShardedBatchSampler:
        if loader.batch_size is None or not isinstance(loader.batch_sampler, BatchSampler):
            raise ValueError("prepare(dataloader): a custom batch_sampler is not supported yet; "
                             "give the DataLoader a batch_size (and shuffle=True/False) instead")
        shuffle = self.shuffle
        return ShardedBatchSampler(
            len(loader.dataset), loader.batch_size, num_replicas=num_replicas, rank=rank,
            order=None if shuffle is None else shuffle.order,
            after_order=None if shuffle is None else shuffle.after_order,
            drop_last=loader.drop_last, even_batches=even_batches, split_batches=split_batches)

    @property
    def dataset(self):
        return self.base.dataset

    @property
    def batch_size(self) -> int:
        """Samples per batch on this rank."""
        return (self.batch_sampler if self.stream is None else self.stream).batch_size

    @property
    def total_batch_size(self) -> int:
        """Samples of all data-parallel ranks per batch."""
        return (self.batch_sampler if self.stream is None else self.stream).round_size

    @property
    def total_dataset_length(self) -> int:
        return len(self.dataset)

    @property
    def end_of_dataloader(self) -> bool:
        return self.state.end_of_dataloader

    @property
    def remainder(self) -> int:
        return self.state.remainder

    @property
    def iteration(self) -> int:
        """Passes read out so far (Accelerate's name; `set_epoch` sets it)."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch of the next iteration (otherwise each pass read out advances it);
        it seeds the shuffle with use_seedable_sampler, and is handed to a dataset that has
        ``set_epoch``."""
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
        """Leave out the first `num_batches` batches (of this rank; a round of all ranks
        each) of the next iteration, as a resumed run does for what it had already consumed;
        the order is drawn as for a whole pass. A stream is re-read from its start and its
        first ``num_batches x total_batch_size`` items are read and dropped."""
        if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 0:
            raise ValueError(f"num_batches={num_batches!r} must be an integer >= 0")
        if self.stream is not None:
            self.stream.skip = num_batches * self.stream.round_size
            return
        self.batch_sampler.skip = num_batches

    def state_dict(self) -> dict:
        """Where reading stands, by global position: the epoch being read, the samples of
        all ranks handed out in it, and what reproduces its shuffle (``seed``,
        ``generator``; see `Shuffle.state`). The order of samples is the epoch's permutation
        (for a stream: the stream) cut into batches of `total_batch_size`, so the position
        means the same on any number of ranks."""
        epoch, batches = self._position
        if self.stream is not None:
            return {"epoch": epoch, "samples": batches}  # a stream counts items directly
        out = {"epoch": epoch, "samples": batches * self.total_batch_size}
        if self.shuffle is not None:
            out.update(self.shuffle.state(mid_pass=batches > 0))
        return out

    def load_state_dict(self, state: dict) -> None:
        """Continue at `state`'s position: the next iteration reads that epoch, in the same
        order, from the sample after the last one handed out (which must fall on a batch
        boundary of this job's global batch; a stream is re-read and skipped to it, at any
        boundary)."""
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
        if self.shuffle is not None:
            self.shuffle.load(state, mid_pass=samples > 0)
        self._resumed = samples > 0

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
        # Accelerate's order: synchronise the carried generator, begin (remainder known),
        # the epoch to the dataset, then a fresh DataLoader iterator (which draws the
        # workers' base seed), then the first batch (which draws the order).
        epoch, resumed, self._resumed = self._epoch, self._resumed, False
        if self.shuffle is not None:
            self.shuffle.start_pass(epoch)
        handed = self.batch_sampler.skip
        self._position = (epoch, handed)
        self.state.end_of_dataloader = False
        self.state.remainder = self.batch_sampler.remainder
        if self._on_iter is not None:
            self._on_iter(self)
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)
        base = self._base_generator
        if base is not None:
            # The base seed is drawn from the loader's generator at every pass, as by a
            # loader without persistent workers, so that the order does not depend on
            # persistent_workers; the inner loader draws the same value from a copy.
            self.loader.generator = _clone(base)
            _draw_seed(base)
        elif resumed:
            # The interrupted run drew this pass's base seed from the global generator
            # before its state was saved (and restored): not again.
            self.loader.generator = torch.Generator()
        try:
            it = iter(self.loader)
        finally:
            self.loader.generator = None
        try:
            current = self._to_device(next(it))
        except StopIteration:
            return
        while True:
            try:
                upcoming = self._to_device(next(it))
            except StopIteration:
                self.state.end_of_dataloader = True
                handed += 1
                self._position = (epoch, handed)
                yield self._ready(current)
                self._epoch = epoch + 1
                self._position = (self._epoch, 0)  # the epoch is read out
                return
            handed += 1
            self._position = (epoch, handed)
            yield self._ready(current)
            current = upcoming
