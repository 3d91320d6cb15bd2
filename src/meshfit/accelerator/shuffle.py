"""Where a prepared map-style loader's epoch order comes from (`Shuffle`, `shuffle_for`), and
the random-generator helpers the loaders share. It draws from the generators Accelerate draws
from, at the same moments, so that a seeded script sees the same samples in the same order:
the loader's ``generator`` (a copy), carried from epoch to epoch; without one, on several
ranks a generator seeded from the global one when prepared, on one rank a seed drawn from
the global generator each pass (as ``RandomSampler`` does); ``use_seedable_sampler``:
``data_seed + epoch``. A carried generator's state is broadcast from rank 0 at every pass's
start (``rng_types=["generator"]``). Each pass draws one permutation, and a second when the
order is read out; the inner ``DataLoader`` draws its workers' base seed from the loader's
generator (or the global one) when each pass starts, as torch's own loader does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

from meshfit import distributed as mdist

__all__ = ["SeedableRandomSampler", "Shuffle", "broadcast_state", "clone_generator",
           "draw_seed", "shuffle_for", "sync_global_generators"]


def draw_seed(generator: torch.Generator | None = None) -> int:
    """One int64 drawn as torch's RandomSampler and DataLoader draw their seeds."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


def clone_generator(generator: torch.Generator) -> torch.Generator:
    """A new generator on `generator`'s device, in its state."""
    copy = torch.Generator(device=generator.device)
    copy.set_state(generator.get_state())
    return copy


def _world() -> int:
    return dist.get_world_size() if mdist.is_initialized() else 1


def broadcast_state(state: torch.Tensor) -> torch.Tensor:
    """Process 0's generator state (a CPU byte tensor) on every process."""
    if _world() == 1:
        return state
    device = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend() == "nccl" else torch.device("cpu")
    moved = state.to(device)
    dist.broadcast(moved, src=0)
    return moved.cpu()


def sync_global_generators(rng_types, device: torch.device) -> None:
    """Give every process process 0's global torch (``"torch"``) and CUDA (``"cuda"``)
    generators, as Accelerate's loaders do at the start of each pass (a collective)."""
    if "torch" in rng_types:
        torch.set_rng_state(broadcast_state(torch.get_rng_state()))
    if "cuda" in rng_types and device.type == "cuda":
        torch.cuda.set_rng_state(broadcast_state(torch.cuda.get_rng_state()))


class Shuffle:
    """A map-style loader's epoch order: ``"carried"``, ``"global"`` or ``"seedable"`` (see
    this module's docstring). `pass_state` reproduces the order of the pass being read;
    `resume` (a saved position's, `load`) is used instead at the next draw."""

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
            self.generator.manual_seed(self.epoch + self.initial_seed)
            return torch.randperm(n, generator=self.generator).tolist()
        if self.mode == "carried":
            if self.resume is not None:
                self.generator.set_state(self.resume)
                self.resume = None
            self.pass_state = self.generator.get_state()
            return torch.randperm(n, generator=self.generator).tolist()
        seed = self.resume if self.resume is not None else draw_seed()
        self.resume = None
        if self.sync and _world() > 1:  # every process takes process 0's draw
            seed = int(broadcast_state(torch.tensor([seed], dtype=torch.int64)).item())
        self.pass_state = seed
        self.generator = torch.Generator().manual_seed(seed)
        return torch.randperm(n, generator=self.generator).tolist()

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


class SeedableRandomSampler(RandomSampler):
    """A RandomSampler whose order is a function of ``data_seed + epoch`` (Accelerate's):
    every process draws the same order without exchanging anything, and a run resumed at an
    epoch sees that epoch's order. `data_seed` defaults to torch's initial seed; the epoch
    advances after each pass read out, or is set (`set_epoch`)."""

    def __init__(self, *args, data_seed: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.initial_seed = data_seed if data_seed is not None else torch.random.initial_seed()
        self.epoch = 0

    def __iter__(self):
        if self.generator is None:
            self.generator = torch.Generator()
        self.generator.manual_seed(self.epoch + self.initial_seed)
        yield from super().__iter__()
        self.set_epoch(self.epoch + 1)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


def shuffle_for(loader: DataLoader, num_replicas: int, *, seedable: bool, data_seed: int | None,
                sync: bool, sampler=None) -> tuple[Shuffle | None, torch.Generator | None]:
    """The `Shuffle` of `loader`'s sampler (or of `sampler`, the one inside a custom batch
    sampler; None: the dataset's order), and the generator the inner DataLoader draws its
    workers' base seeds from (the loader's own, shared with the shuffle, or None: the global
    one). The user's generator itself is used, not a copy, as Accelerate does: a script
    re-seeding it after `prepare` gets the order a plain DataLoader would give."""
    sampler = loader.sampler if sampler is None else sampler
    if not isinstance(sampler, (RandomSampler, SequentialSampler)):
        raise ValueError(f"prepare(dataloader): sampler {type(sampler).__name__} is not "
                         "supported yet; use shuffle=True or shuffle=False")
    base = loader.generator
    user = getattr(sampler, "generator", None)  # (a shuffled loader's: the loader's)
    if not isinstance(sampler, RandomSampler):
        return None, base
    if sampler.replacement or sampler.num_samples != len(loader.dataset):
        raise ValueError("prepare(dataloader): a RandomSampler with replacement or "
                         "num_samples is not supported yet; use shuffle=True")
    if isinstance(sampler, SeedableRandomSampler):
        return Shuffle("seedable", sampler.generator, seed=sampler.initial_seed,
                       sync=sync), base
    if seedable:
        seed = data_seed if data_seed is not None else torch.random.initial_seed()
        return Shuffle("seedable", None, seed=seed, sync=sync), base
    if user is not None:
        return Shuffle("carried", user, sync=sync), base
    if num_replicas > 1:  # seeded now from the global generator, as Accelerate does
        carried = torch.Generator().manual_seed(draw_seed())
        return Shuffle("carried", carried, sync=sync), base
    return Shuffle("global", None, sync=sync), base
