"""Prepared dataloaders over an IterableDataset (a stream): sharding by position over ranks
and workers, equal batch counts, resumable position; TokenStream through them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from meshfit.accelerator import Accelerator
from meshfit.accelerator.loader import PreparedDataLoader
from meshfit.utils import DataLoaderConfiguration
from meshfit.data import ByteTokenizer, TokenDataset, TokenStream
from conftest import run_distributed

CPU = torch.device("cpu")


class Numbers(IterableDataset):
    """0, 1, ..., n-1, as 0-d tensors; optionally with a __len__."""

    def __init__(self, n: int, *, sized: bool = False):
        self.n, self.sized = n, sized
        self.passes = 0

    def __iter__(self):
        self.passes += 1
        return iter(range(self.n))

    def __len__(self):
        if not self.sized:
            raise TypeError("no len")
        return self.n


class SplitsItselfByWorker(Numbers):
    """Like many streaming datasets (``datasets.IterableDataset`` among them): inside a
    DataLoader worker it yields only that worker's share."""

    def __iter__(self):
        info = get_worker_info()
        if info is None:
            return iter(range(self.n))
        return iter(range(info.id, self.n, info.num_workers))


def _loader(ds, world, rank, bs, *, workers=0, drop_last=False):
    return PreparedDataLoader(DataLoader(ds, batch_size=bs, num_workers=workers,
                                         drop_last=drop_last),
                              device=CPU, num_replicas=world, rank=rank)


def _reference(items: list[int], world: int, bs: int, drop_last: bool) -> list[list[list[int]]]:
    """Each rank's batches, computed independently: the stream cut into rounds of
    bs x world, rank r taking every world-th item of a round; a tail that does not fill a
    round is dropped or shared as tail // world items per rank."""
    size = bs * world
    full = len(items) // size
    ranks = [[items[k * size:(k + 1) * size][r::world] for k in range(full)]
             for r in range(world)]
    tail = items[full * size:]
    keep = len(tail) // world
    if not drop_last and keep:
        for r in range(world):
            ranks[r].append(tail[r::world][:keep])
    return ranks


def _read(loader) -> list[list[int]]:
    return [b.tolist() for b in loader]


@pytest.mark.parametrize("n,world,bs,drop_last", [
    (23, 2, 3, False), (23, 2, 3, True), (24, 3, 2, False), (5, 4, 1, False),
    (7, 1, 3, False), (2, 3, 2, False)])
def test_ranks_take_disjoint_shards_that_cover_the_stream(n, world, bs, drop_last):
    got = [_read(_loader(Numbers(n), world, r, bs, drop_last=drop_last)) for r in range(world)]
    assert got == _reference(list(range(n)), world, bs, drop_last)
    assert len({len(b) for b in got}) == 1  # equal batch counts: no rank waits in a collective
    seen = [i for batches in got for b in batches for i in b]
    assert len(seen) == len(set(seen))  # nothing read twice
    dropped = n - len(seen)
    assert dropped < (bs * world if drop_last else world)  # only the tail is dropped
    assert sorted(seen) == list(range(len(seen)))  # ...and only the tail


def test_workers_share_a_rank_without_duplicates_or_losses():
    n, world, bs = 41, 2, 3
    want = _reference(list(range(n)), world, bs, False)
    for ds in (Numbers(n), SplitsItselfByWorker(n)):
        got = [_read(_loader(ds, world, r, bs, workers=2)) for r in range(world)]
        assert got == want  # same batches, same order as without workers


def test_len_needs_a_sized_stream():
    assert len(_loader(Numbers(23, sized=True), 2, 1, 3)) == len(_reference(
        list(range(23)), 2, 3, False)[1]) == 4
    assert len(_loader(Numbers(23, sized=True), 2, 1, 3, drop_last=True)) == 3
    with pytest.raises(TypeError, match="without __len__"):
        len(_loader(Numbers(23), 2, 0, 3))


def test_resume_after_k_batches_continues_exactly():
    n, world, bs, k = 50, 2, 3, 3
    full = [_read(_loader(Numbers(n), world, r, bs)) for r in range(world)]
    states = []
    for r in range(world):
        first = _loader(Numbers(n), world, r, bs)
        it = iter(first)
        for _ in range(k):
            next(it)
        states.append(first.state_dict())
    assert states[0] == states[1] == {"epoch": 0, "samples": k * bs * world}
    for r in range(world):
        ds = Numbers(n)
        resumed = _loader(ds, world, r, bs)
        resumed.load_state_dict(states[r])
        assert _read(resumed) == full[r][k:]
        assert ds.passes == 1  # re-read from the start, the first k rounds skipped
        assert resumed.state_dict() == {"epoch": 1, "samples": 0}  # read out
        assert _read(resumed) == full[r]  # the next pass starts over
    skipped = _loader(Numbers(n), world, 1, bs)
    skipped.skip_first_batches(k)
    assert _read(skipped) == full[1][k:]


def test_resume_on_another_number_of_ranks_continues_the_stream():
    n, bs = 50, 2
    first = _loader(Numbers(n), 2, 0, bs)
    it = iter(first)
    for _ in range(4):
        next(it)
    state = first.state_dict()  # 4 rounds of 2 ranks x 2 = 16 items consumed
    assert state["samples"] == 16
    resumed = []
    for r in range(3):
        loader = _loader(Numbers(n), 3, r, bs)
        loader.load_state_dict(state)
        resumed.append(_read(loader))
    assert resumed == _reference(list(range(16, n)), 3, bs, False)


def test_position_counts_a_short_last_batch_and_epochs_advance():
    loader = _loader(Numbers(23), 2, 0, 3)
    positions = []
    for _ in loader:
        positions.append(loader.state_dict()["samples"])
    assert positions == [6, 12, 18, 22]  # last batch: 2 items per rank
    assert loader.state_dict() == {"epoch": 1, "samples": 0}


def test_batch_size_none_is_refused():
    with pytest.raises(ValueError, match="IterableDataset loader needs a batch_size"):
        PreparedDataLoader(DataLoader(Numbers(5), batch_size=None), device=CPU,
                           num_replicas=1, rank=0)


def _texts(n_docs: int) -> list[str]:
    rng = np.random.default_rng(0)
    return ["".join(chr(c) for c in rng.integers(97, 123, size=int(rng.integers(1, 40))))
            for _ in range(n_docs)]


def test_token_stream_sharded_over_ranks_and_workers():
    texts = _texts(60)
    stream = TokenStream(texts, ByteTokenizer(), seq_len=8)
    windows = [x for x, _ in stream]
    packed = np.frombuffer(b"".join(t.encode() + b"\n\n" for t in texts), dtype=np.uint8)
    ref = TokenDataset(packed, seq_len=8)  # the cached-stream windows of the same text
    assert len(windows) == len(ref) and all(torch.equal(w, ref[i][0])
                                            for i, w in enumerate(windows))
    world, bs = 2, 4
    for workers in (0, 2):
        got = [[x for x, _ in _loader(stream, world, r, bs, workers=workers)]
               for r in range(world)]
        assert len(got[0]) == len(got[1])
        want = _reference(list(range(len(windows))), world, bs, False)
        for r in range(world):
            for batch, idx in zip(got[r], want[r]):
                assert torch.equal(batch, torch.stack([windows[i] for i in idx]))


def test_accelerator_prepares_a_stream_and_resumes_from_a_checkpoint(tmp_path):
    acc = Accelerator()
    loader = acc.prepare(DataLoader(Numbers(20), batch_size=3))
    assert isinstance(loader, PreparedDataLoader) and loader.stream is not None
    seen, ends = [], []
    for batch in loader:
        seen.append(acc.gather_for_metrics(batch).tolist())  # nothing padded, nothing cut
        ends.append(loader.state.end_of_dataloader)
    assert [i for b in seen for i in b] == list(range(20)) and ends[-1] and not any(ends[:-1])
    it = iter(loader)
    next(it), next(it)
    acc.save_state(tmp_path / "ckpt")
    # stateful loaders: load_state puts them back where they stood (not Accelerate's default)
    again = Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    resumed = again.prepare(DataLoader(Numbers(20), batch_size=3))
    again.load_state(tmp_path / "ckpt")
    assert _read(resumed) == [list(range(i, min(i + 3, 20))) for i in range(6, 20, 3)]


def _two_rank_stream(rank, world):
    acc = Accelerator()
    texts = _texts(12)
    loader = acc.prepare(DataLoader(TokenStream(texts, ByteTokenizer(), seq_len=4),
                                    batch_size=3))
    gathered = [acc.gather(x) for x, _ in loader]  # a collective per batch: must not hang
    return torch.cat(gathered), len(gathered)


def test_two_gloo_ranks_stop_together_and_gather_the_stream_in_order():
    results = run_distributed(_two_rank_stream, 2, timeout=60)
    windows = torch.stack([x for x, _ in TokenStream(_texts(12), ByteTokenizer(), seq_len=4)])
    (g0, n0), (g1, n1) = results
    assert n0 == n1 and torch.equal(g0, g1)
    # Gathered in rank order: per batch, rank 0's items (stream positions 0, 2, 4 of the
    # round) then rank 1's (1, 3, 5); the tail is shared evenly.
    ranks = _reference(list(range(len(windows))), 2, 3, False)
    order = [i for b0, b1 in zip(*ranks) for i in b0 + b1]
    assert n0 == len(ranks[0]) and torch.equal(g0, windows[order])
