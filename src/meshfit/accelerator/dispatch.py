"""``DataLoaderConfiguration(dispatch_batches=True)``, as Accelerate's ``DataLoaderDispatcher``:
process 0 alone reads the data (its loader's batches, in the epoch's order) and sends every
process its part of each round: of n batches, batch r to process r; with ``split_batches``,
slice r of each batch. A short last round is concatenated and cut into n equal slices,
completed from its own start (so every process gets a batch, as with ``even_batches``; the
completion ends the gathered round, where `Accelerator.gather_for_metrics` drops it).
Each round goes as one pickled object from process 0 (``broadcast_object_list``), with
whether it is the last, so the other processes stop when process 0's loader does.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

__all__ = ["Dispatch"]


def _concat(batches: list):
    first = batches[0]
    if isinstance(first, torch.Tensor):
        return torch.cat([b.reshape(1) if b.dim() == 0 else b for b in batches])
    if isinstance(first, dict):
        return type(first)({k: _concat([b[k] for b in batches]) for k in first})
    if isinstance(first, (list, tuple)) and not isinstance(first, str):
        parts = [_concat(list(items)) for items in zip(*batches)]
        return type(first)(*parts) if hasattr(first, "_fields") else type(first)(parts)
    return [x for b in batches for x in (b if isinstance(b, list) else [b])]


def _rows(batch) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if isinstance(batch, dict):
        return _rows(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)) and batch and not isinstance(batch[0], (int, float)):
        return _rows(batch[0])
    return len(batch)


def _take(batch, rows: list[int]):
    if isinstance(batch, torch.Tensor):
        return batch[torch.tensor(rows, dtype=torch.long)]
    if isinstance(batch, dict):
        return type(batch)({k: _take(v, rows) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)) and batch and not isinstance(batch[0], (int, float)):
        parts = [_take(v, rows) for v in batch]
        return type(batch)(*parts) if hasattr(batch, "_fields") else type(batch)(parts)
    return [batch[i] for i in rows]


class Dispatch:
    """Process `rank` of `num_replicas`'s part of the batches process 0 reads."""

    def __init__(self, num_replicas: int, rank: int, *, split_batches: bool,
                 drop_last: bool):
        self.num_replicas, self.rank = num_replicas, rank
        self.split_batches, self.drop_last = split_batches, drop_last

    def length(self, batches: int) -> int:
        """Batches per process of a loader of `batches` batches."""
        if self.split_batches or self.num_replicas == 1:
            return batches
        return batches // self.num_replicas if self.drop_last \
            else math.ceil(batches / self.num_replicas)

    def remainder(self, sampler) -> int:
        """Real samples in an epoch's last round (0: full; -1: drop_last) of `sampler`'s
        batches (a `ShardedBatchSampler` over one process)."""
        if self.drop_last:
            return -1
        size = sampler.loader_batch_size * (1 if self.split_batches else self.num_replicas)
        return sampler.num_samples % size

    def _rounds(self, batches):
        per_round = 1 if self.split_batches else self.num_replicas
        group: list = []
        for batch in batches:
            group.append(batch)
            if len(group) == per_round:
                yield group
                group = []
        if group and not self.drop_last:
            yield group

    def _part(self, group: list):
        n, r = self.num_replicas, self.rank
        if len(group) == n and not self.split_batches and \
                len({_rows(b) for b in group}) == 1:
            return group[r]
        whole = _concat(group)
        total = _rows(whole)
        per = math.ceil(total / n)
        return _take(whole, [i % total for i in range(r * per, (r + 1) * per)])

    def batches(self, source):
        """This process's batches; `source` (process 0's loader iterator) is read on process 0
        only. A collective per round."""
        if self.num_replicas == 1:
            yield from source
            return
        rounds = self._rounds(source) if self.rank == 0 else None
        current = next(rounds, None) if self.rank == 0 else None
        while True:
            message = [None, True]
            if self.rank == 0:
                upcoming = next(rounds, None) if current is not None else None
                message = [current, upcoming is None]
            dist.broadcast_object_list(message, src=0)
            group, last = message
            if group is None:
                return
            yield self._part(group)
            if last:
                return
            if self.rank == 0:
                current = upcoming
