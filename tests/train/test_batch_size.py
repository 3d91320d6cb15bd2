"""find_executable_batch_size against a simulated allocator limit; tensor-core shape advice."""

from __future__ import annotations

import pytest
import torch

from meshfit.train.batch_size import find_executable_batch_size, is_out_of_memory, shape_advice


class FakeAllocator:
    """Raises the allocator's own out-of-memory error above a byte budget."""

    def __init__(self, budget_samples: int, error: type[BaseException] = torch.OutOfMemoryError):
        self.budget, self.error, self.calls = budget_samples, error, []

    def train(self, micro_batch_size, gradient_accumulation_steps):
        self.calls.append((micro_batch_size, gradient_accumulation_steps))
        if micro_batch_size > self.budget:
            raise self.error("CUDA out of memory. Tried to allocate 2.00 GiB")
        return micro_batch_size * gradient_accumulation_steps


def test_halves_on_oom_and_keeps_the_effective_batch():
    fake = FakeAllocator(budget_samples=12)
    run = find_executable_batch_size(fake.train, starting_batch_size=64, effective_batch_size=64)
    assert run() == 64  # the effective batch is the same as asked
    assert fake.calls == [(64, 1), (32, 2), (16, 4), (8, 8)]


def test_without_an_effective_batch_behaves_like_accelerate():
    fake = FakeAllocator(budget_samples=20)
    run = find_executable_batch_size(starting_batch_size=128)(fake.train)
    assert run() == 16
    assert [b for b, _ in fake.calls] == [128, 64, 32, 16]
    assert all(a == 1 for _, a in fake.calls)


def test_only_divisors_of_the_effective_batch_are_tried():
    fake = FakeAllocator(budget_samples=10)
    run = find_executable_batch_size(fake.train, starting_batch_size=48, effective_batch_size=48)
    assert run() == 48
    assert fake.calls == [(48, 1), (24, 2), (12, 4), (6, 8)]


def test_cpu_allocator_message_counts_as_oom():
    err = RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate "
                       "memory: you tried to allocate 1099511627776 bytes.")
    assert is_out_of_memory(err)
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    # A real CPU allocation failure is recognised (1 TiB on a 24 GB machine).
    with pytest.raises(RuntimeError) as info:
        torch.empty(2**40, dtype=torch.uint8).fill_(1)
    assert is_out_of_memory(info.value)


def test_gives_up_below_the_minimum_and_lets_other_errors_through():
    fake = FakeAllocator(budget_samples=0)
    run = find_executable_batch_size(fake.train, starting_batch_size=4)
    with pytest.raises(RuntimeError, match="no micro-batch size >= 1 fits"):
        run()
    assert [b for b, _ in fake.calls] == [4, 2, 1]

    def broken(micro_batch_size, gradient_accumulation_steps):
        raise ValueError("a bug, not memory")

    with pytest.raises(ValueError, match="a bug"):
        find_executable_batch_size(broken, starting_batch_size=8)()


@pytest.mark.parametrize("kwargs,match", [
    (dict(starting_batch_size=0), "starting_batch_size=0 must be an integer >= 1"),
    (dict(starting_batch_size=24, effective_batch_size=64), "starting_batch_size=24 must divide"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        find_executable_batch_size(lambda b, a: None, **kwargs)


def test_shape_advice_pads_to_the_tile():
    # A100-class tile (64): GPT-2's vocabulary 50257 -> 50304, as nanoGPT pads it.
    msgs = shape_advice(tile=64, batch_size=32, d_model=768, vocab_size=50257)
    assert [m.split(" is not")[0] for m in msgs] == ["batch_size=32", "vocab_size=50257"]
    assert "pad it to 64 " in msgs[0] and "pad it to 50304 " in msgs[1]
    # Elsewhere the guide's multiple of 8.
    assert shape_advice(device="cpu", batch_size=30, d_model=128) == [
        "batch_size=30 is not a multiple of 8: pad it to 32 so that tensor-core kernels run on "
        "full tiles"]
