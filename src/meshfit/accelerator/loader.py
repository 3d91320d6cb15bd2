"""`PreparedDataLoader`: a data loader prepared for data parallel training, sharded as
Hugging Face Accelerate shards it (`sampler`, `stream`, `shuffle`), batches on the device ahead.

Its position is the epoch being read and the samples of all ranks handed out in it (a
stream's items consumed), plus the shuffling generator's state at the pass's start: the order
is the epoch's permutation (or the stream) cut into global batches, so the position means the
same on any number of ranks. `load_state` restores it for stateful loaders; a stream cannot
seek: it is re-read and skipped to its position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from meshfit.accelerator.dispatch import Dispatch
from meshfit.accelerator.sampler import ShardedBatchSampler, custom_batches, inner_sampler
from meshfit.accelerator.shuffle import (SeedableRandomSampler, Shuffle, clone_generator,
                                         draw_seed, shuffle_for)
from meshfit.accelerator.stream import StreamShard, stream_loader, worker_options
from meshfit.distributed.collectives import apply_to_tensors

__all__ = ["LoaderState", "PreparedDataLoader"]


@dataclass
class LoaderState:
    """What the accelerator needs to know about the loader being iterated."""

    end_of_dataloader: bool = False
    remainder: int = -1  # real samples in the final round (0: full); -1: nothing to trim


class PreparedDataLoader:
    """A DataLoader whose batches are this rank's shard, moved to the device one batch ahead:
    the accelerator knows when the last batch is being used (accumulation syncs there,
    gather_for_metrics trims the padding there), and the next batch's copy overlaps the
    current batch's compute (on CUDA: a side stream from pinned memory, waited for only when
    the batch is handed out). The loader's workers, ``collate_fn`` and ``generator`` (a copy)
    are kept; a stream's workers are started afresh each pass (which re-reads it). The other
    arguments are `DataLoaderConfiguration`'s and the ``rng_types``' (``"generator"``)."""

    def __init__(self, loader: DataLoader, *, device: torch.device, num_replicas: int,
                 rank: int, on_iter=None, on_end=None, even_batches: bool = True,
                 split_batches: bool = False, seedable: bool = False,
                 data_seed: int | None = None, sync_generator: bool = True,
                 dispatch: bool = False):
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
        self.dispatch: Dispatch | None = None
        if isinstance(loader.dataset, IterableDataset):
            if loader.batch_size is None:
                raise ValueError("prepare(dataloader): an IterableDataset loader needs a "
                                 "batch_size; give the DataLoader batch_size=N (the stream "
                                 "yields single samples, which are batched per rank)")
            if dispatch and num_replicas > 1:
                raise ValueError("prepare(dataloader): dispatch_batches=True is not available "
                                 "for an IterableDataset (each process reads the stream and "
                                 "keeps its share); leave dispatch_batches None")
            if split_batches:
                raise ValueError("prepare(dataloader): split_batches=True is not available "
                                 "for an IterableDataset; give the per-process batch size")
            self.batch_sampler = None
            self.stream = StreamShard(loader.dataset, loader.batch_size,
                                      num_replicas=num_replicas, rank=rank,
                                      drop_last=loader.drop_last, collate_fn=loader.collate_fn)
            self.loader = None  # built per pass (`stream_loader`)
            return
        self._init_map_style(loader, device, num_replicas, rank, even_batches=even_batches,
                             split_batches=split_batches, seedable=seedable,
                             data_seed=data_seed, sync_generator=sync_generator,
                             dispatch=dispatch)

    def _init_map_style(self, loader: DataLoader, device: torch.device, num_replicas: int,
                        rank: int, *, even_batches: bool, split_batches: bool, seedable: bool,
                        data_seed: int | None, sync_generator: bool, dispatch: bool) -> None:
        """The shard of a map-style dataset (`sampler`), its order (`shuffle`), process 0's
        batches handed out (`dispatch`), and the inner DataLoader reading them."""
        # The batches a custom batch sampler makes (None: the loader's batch_size ones).
        custom = custom_batches(loader)
        if custom is None and seedable and isinstance(loader.sampler, RandomSampler):
            # Accelerate's use_seedable_sampler: the loader's sampler becomes a
            # SeedableRandomSampler (data_seed + epoch), whose batches are sharded
            custom = BatchSampler(SeedableRandomSampler(range(len(loader.dataset)),
                                                        data_seed=data_seed),
                                  loader.batch_size, loader.drop_last)
        self.dispatch = None
        if dispatch and num_replicas > 1:
            # process 0 reads the loader's own batches: shard over one process, unsynchronised
            self.dispatch = Dispatch(num_replicas, rank, split_batches=split_batches,
                                     drop_last=loader.drop_last)
            num_replicas, rank, split_batches, sync_generator = 1, 0, False, False
        # torch's loader draws each pass's workers' base seed from the loader's generator
        # (shared with the shuffle) or, when None, from the global one
        inner = None if custom is None else inner_sampler(custom, num_replicas)
        if custom is not None and inner is None:  # the batch sampler orders itself
            self.shuffle, self._base_generator = None, loader.generator
        else:  # (a custom one's inner sampler: only its generator is synchronised)
            self.shuffle, self._base_generator = shuffle_for(
                loader, num_replicas, seedable=seedable, data_seed=data_seed,
                sync=sync_generator, sampler=inner)
        self.batch_sampler = self._make_batch_sampler(loader, num_replicas, rank, custom,
                                                      even_batches=even_batches,
                                                      split_batches=split_batches)
        if custom is not None and loader.batch_sampler is None:  # a sampler of whole batches
            self.loader = DataLoader(loader.dataset, sampler=self.batch_sampler,
                                     batch_size=None, collate_fn=loader.collate_fn,
                                     **worker_options(loader, device))
            return
        self.loader = DataLoader(loader.dataset, batch_sampler=self.batch_sampler,
                                 collate_fn=loader.collate_fn,
                                 persistent_workers=loader.persistent_workers,
                                 **worker_options(loader, device))

    def _make_batch_sampler(self, loader: DataLoader, num_replicas: int, rank: int, custom, *,
                            even_batches: bool, split_batches: bool) -> ShardedBatchSampler:
        shuffle = None if custom is not None else self.shuffle
        batch_size = loader.batch_size if custom is None else getattr(custom, "batch_size", None)
        if batch_size is None:
            raise ValueError(f"prepare(dataloader): the batch sampler {type(custom).__name__} "
                             "has no batch_size attribute; give it one (the size of its full "
                             "batches), which sharding over the processes needs")
        return ShardedBatchSampler(
            len(loader.dataset), batch_size, num_replicas=num_replicas, rank=rank,
            order=None if shuffle is None else shuffle.order,
            after_order=None if shuffle is None else shuffle.after_order,
            drop_last=loader.drop_last if custom is None else getattr(custom, "drop_last", False),
            even_batches=even_batches, split_batches=split_batches, batches=custom)

    dataset = property(lambda self: self.base.dataset)
    total_dataset_length = property(lambda self: len(self.dataset))
    end_of_dataloader = property(lambda self: self.state.end_of_dataloader)
    remainder = property(lambda self: self.state.remainder)
    iteration = property(lambda self: self._epoch,
                         doc="Passes read out so far (Accelerate's name; `set_epoch` sets it).")
    _shard = property(lambda self: self.batch_sampler if self.stream is None else self.stream)
    batch_size = property(lambda self: self._shard.batch_size,
                          doc="Samples per batch on this rank.")
    total_batch_size = property(lambda self: self._shard.round_size,
                                doc="Samples of all data-parallel ranks per batch.")

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch of the next iteration (otherwise each pass read out advances it):
        it seeds use_seedable_sampler's shuffle and goes to a dataset's ``set_epoch``."""
        self._epoch = epoch

    def __len__(self) -> int:
        if self.stream is not None:
            try:
                n_items = len(self.stream.dataset)
            except TypeError:
                raise TypeError("this prepared loader streams an IterableDataset without "
                                "__len__, so its number of batches is unknown") from None
            return self.stream.batches(n_items)
        if self.dispatch is not None:
            return self.dispatch.length(len(self.batch_sampler))
        return len(self.batch_sampler)

    def skip_first_batches(self, num_batches: int) -> None:
        """Leave out the first `num_batches` batches (rounds of all ranks) of the next
        iteration, its order drawn as for a whole pass (a stream's items read and dropped)."""
        if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 0:
            raise ValueError(f"num_batches={num_batches!r} must be an integer >= 0")
        if self.stream is not None:
            self.stream.skip = num_batches * self.stream.round_size
            return
        self.batch_sampler.skip = num_batches

    def state_dict(self) -> dict:
        """Where reading stands (see this module's docstring): ``epoch``, ``samples`` and, for
        a shuffled loader, ``seed`` and ``generator`` (`Shuffle.state`)."""
        epoch, batches = self._position
        if self.stream is not None:
            return {"epoch": epoch, "samples": batches}  # a stream counts items directly
        out = {"epoch": epoch, "samples": batches * self.total_batch_size}
        if self.shuffle is not None:
            out.update(self.shuffle.state(mid_pass=batches > 0))
        return out

    def load_state_dict(self, state: dict) -> None:
        """Continue at `state`'s position: the next iteration reads that epoch, in the same
        order, from the sample after the last one handed out (on a boundary of this job's
        global batch; a stream's at any)."""
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
        """Start copying `batch` to the device; returns (batch, event) for `_ready`."""
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
        try:
            yield from (self._iter_batches() if self.stream is None else self._iter_stream())
        finally:
            if self._on_end is not None:
                self._on_end(self)

    def _iter_stream(self):
        handed = self.stream.skip  # items of the stream consumed, all ranks together
        loader = stream_loader(self.stream, self.base, self.device, self._epoch)
        self.stream.skip = 0
        epoch = self._epoch
        self._position = (epoch, handed)
        self._epoch += 1
        self.state.end_of_dataloader = False
        self.state.remainder = -1  # nothing is padded
        if self._on_iter is not None:
            self._on_iter(self)
        n = self.stream.num_replicas
        yield from self._ahead(((count * n, batch) for count, batch in loader), epoch, handed)
        self._position = (self._epoch, 0)  # the stream is read out

    def _iter_batches(self):
        # Accelerate's order: synchronise the carried generator, begin (remainder known),
        # the epoch to the dataset, then a fresh DataLoader iterator (which draws the
        # workers' base seed), then the first batch (which draws the order).
        epoch, resumed, self._resumed = self._epoch, self._resumed, False
        if self.shuffle is not None:
            self.shuffle.start_pass(epoch)
        sampler = getattr(self.batch_sampler.batch_sampler, "sampler", None)
        if hasattr(sampler, "set_epoch"):  # (a SeedableRandomSampler's order is the epoch's)
            sampler.set_epoch(epoch)
        handed = self.batch_sampler.skip
        self._position = (epoch, handed)
        self.state.end_of_dataloader = False
        self.state.remainder = self.batch_sampler.remainder
        if self.dispatch is not None:  # rounds of n of process 0's batches (or 1, split)
            self.state.remainder = self.dispatch.remainder(self.batch_sampler)
        if self._on_iter is not None:
            self._on_iter(self)
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)
        base = self._base_generator
        if base is not None:
            # The base seed is drawn from the loader's generator at every pass, as by a
            # loader without persistent workers, so that the order does not depend on
            # persistent_workers; the inner loader draws the same value from a copy.
            self.loader.generator = clone_generator(base)
            draw_seed(base)
        elif resumed:
            # The interrupted run drew this pass's base seed from the global generator
            # before its state was saved (and restored): not again.
            self.loader.generator = torch.Generator()
        try:
            it = iter(self.loader)
        finally:
            self.loader.generator = None
        if self.dispatch is not None:
            it = self.dispatch.batches(it)
        if (yield from self._ahead(((1, batch) for batch in it), epoch, handed)):
            self._epoch = epoch + 1
            self._position = (self._epoch, 0)  # the epoch is read out

    def _ahead(self, batches, epoch: int, handed: int):
        """Hand out `batches` ((how far each moves the position, batch) pairs) one ahead, the
        next one's copy started first, the last one known (``end_of_dataloader``); keeps the
        position (`epoch`, `handed`). Returns whether any batch came."""
        current = None
        for count, batch in batches:
            upcoming = (count, self._to_device(batch))
            if current is not None:
                handed += current[0]
                self._position = (epoch, handed)
                yield self._ready(current[1])
            current = upcoming
        if current is None:
            return False
        self.state.end_of_dataloader = True
        handed += current[0]
        self._position = (epoch, handed)
        yield self._ready(current[1])
        return True
