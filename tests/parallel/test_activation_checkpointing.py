"""Activation checkpointing against the plain model: same loss and gradients, less memory.

Memory is counted as the bytes kept for backward by one forward pass, two ways (CPU torch has
no allocator statistics: nothing like torch.cuda.memory_allocated exists for the CPU):

- `saved_bytes`: a `saved_tensors_hooks` pack hook sees every tensor autograd saves outside
  a checkpointed region, and the inputs a checkpoint keeps for its recompute (they are saved
  through the same mechanism). It does NOT see the op outputs that selective (per-op)
  checkpointing caches, which live in a dispatch mode's dict.
- `forward_bytes`: the profiler's net CPU allocation over the forward pass (allocations minus
  frees), which sees everything, the per-op cache included. Cross-checked against the hooks
  where both apply.
"""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from conftest import run_distributed
from reference import forward_bytes, hf_llama, loss_and_grads, tiny_preset, token_batches
from meshfit.parallel.activation import apply_activation_checkpointing, find_blocks, is_checkpointed

MODES = {  # name -> apply_activation_checkpointing kwargs
    "full": dict(mode="full"),
    "selective-block": dict(mode="selective", every=2),
    "selective-op": dict(mode="selective", policy="op"),
}


pytestmark = pytest.mark.usefixtures("one_thread")


def _batch(batch=2, seq=64):
    return token_batches(batch, seq, seed=1)


def _gpt(dtype=torch.float64, **overrides):
    # The full-width tiny preset with 4 blocks: activations large enough beside the
    # parameters for the memory comparisons to separate the modes.
    return tiny_preset(n_layer=4, dtype=dtype, **overrides)


def _assert_same(a, b, atol):
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=atol)
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], rtol=0, atol=atol, msg=name)


def saved_bytes(model, *inputs) -> int:
    """Bytes of non-parameter tensors autograd saves in one forward (see module docstring).

    Counted per storage, deduplicated by data_ptr, at the storage's full size: autograd saves
    views (per-head q/k/v, transposes) and the same tensor for several ops (x for a norm and a
    residual), all sharing one allocation, so numel*element_size per saved tensor would count
    that memory several times. Every saved tensor stays alive until backward, so no address is
    reused within the pass. Parameters are saved by each linear too but cost no activation
    memory (they exist anyway), so they are left out.
    """
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(*inputs)
    loss.backward()
    return sum(seen.values())


# ----------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("name", list(MODES))
def test_same_loss_and_grads_as_plain(name):
    idx, tgt = _batch()
    plain = _gpt()
    model = apply_activation_checkpointing(copy.deepcopy(plain), **MODES[name])
    # The recompute replays the same kernels on the same inputs, so results are bitwise equal
    # (observed: difference 0); 1e-12 in fp64 leaves room for a summation-order change only.
    _assert_same(loss_and_grads(model, idx, tgt), loss_and_grads(plain, idx, tgt), atol=1e-12)
    assert model.state_dict().keys() == plain.state_dict().keys()  # names unchanged


@pytest.mark.parametrize("name", list(MODES))
def test_dropout_replays_the_same_masks(name):
    # Non-reentrant checkpointing restores the forward's RNG state before recomputing, so the
    # recomputed dropout masks equal the forward's; with a wrong mask gradients would differ.
    idx, tgt = _batch()
    plain = _gpt(dropout=0.1)
    model = apply_activation_checkpointing(copy.deepcopy(plain), **MODES[name])
    got, expected = loss_and_grads(model, idx, tgt, seed=3), loss_and_grads(plain, idx, tgt, seed=3)
    _assert_same(got, expected, atol=1e-12)


def test_memory_full_halves_and_selective_lies_between():
    inputs = _batch()
    plain = _gpt()
    models = {"none": plain} | {name: apply_activation_checkpointing(copy.deepcopy(plain), **kw)
                                 for name, kw in MODES.items()}
    hooks = {name: saved_bytes(m, *inputs) for name, m in models.items() if name != "selective-op"}
    prof = {name: forward_bytes(m, *inputs) for name, m in models.items()}
    print(f"\nsaved bytes (hooks): {hooks}\nforward bytes (profiler): {prof}")
    assert hooks["full"] <= hooks["none"] / 2
    assert hooks["full"] < hooks["selective-block"] < hooks["none"]
    assert prof["full"] < prof["selective-op"] < prof["none"]
    # The two measures agree where both see everything; they differ by small tensors the
    # hooks do not see (one RNG state per checkpoint, the loss).
    for name in ("none", "full", "selective-block"):
        assert abs(prof[name] - hooks[name]) <= 0.02 * hooks["none"], name


# ----------------------------------------------------------------------------- behaviour
def test_which_blocks_and_reapplying():
    model = _gpt()
    blocks = list(model.layers.values())
    assert find_blocks(model) == blocks
    apply_activation_checkpointing(model, "selective", every=2)
    assert [is_checkpointed(b) for b in blocks] == [True, False, True, False]
    apply_activation_checkpointing(model, "selective", every=3)  # replaces the previous choice
    assert [is_checkpointed(b) for b in blocks] == [True, False, False, True]
    assert find_blocks(model) == blocks  # mixed checkpointed/plain blocks still count as one stack
    apply_activation_checkpointing(model, "none")  # no-op
    assert [is_checkpointed(b) for b in blocks] == [True, False, False, True]


def test_copies_keep_checkpointing_and_inference_runs_plain():
    model = apply_activation_checkpointing(_gpt(), "selective", policy="op")
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert all(is_checkpointed(b) for b in copied.layers.values())
        assert type(copied.layers["0"]) is type(model.layers["0"])
    idx, _ = _batch()
    with torch.no_grad():
        torch.testing.assert_close(model(idx), copied(idx), rtol=0, atol=0)


def test_bad_input():
    model = _gpt()
    with pytest.raises(ValueError, match="mode='partial'"):
        apply_activation_checkpointing(model, "partial")
    with pytest.raises(ValueError, match="policy='layer'"):
        apply_activation_checkpointing(model, "selective", policy="layer")
    with pytest.raises(ValueError, match="every=0"):
        apply_activation_checkpointing(model, "selective", every=0)
    with pytest.raises(ValueError, match="no repeated blocks"):
        apply_activation_checkpointing(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), "full")
    assert not any(is_checkpointed(b) for b in model.layers.values())


# ----------------------------------------------------------------------------- Hugging Face
def _tiny_llama():
    pytest.importorskip("transformers")
    return hf_llama(n_layer=3).train()  # 3 blocks: selective-block checkpoints 1 and 3


class _HFLoss(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, _targets=None):  # next-token loss on the ids themselves
        return self.model(input_ids=ids, labels=ids).loss


def _hf_is_checkpointing(model) -> bool:
    with warnings.catch_warnings():  # 5.x renamed it and deprecates the old name
        warnings.simplefilter("ignore", FutureWarning)
        return getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing


@pytest.mark.parametrize("name", list(MODES))
def test_hf_llama(name):
    plain = _HFLoss(_tiny_llama())
    model = _HFLoss(apply_activation_checkpointing(copy.deepcopy(plain.model), **MODES[name]))
    assert _hf_is_checkpointing(model.model)
    expected = [True, False, True] if name == "selective-block" else [True] * 3
    assert [is_checkpointed(b) for b in find_blocks(model.model)] == expected
    ids, _ = _batch(seq=16)
    # Same kernels replayed, fp64: as for the meshfit GPT.
    _assert_same(loss_and_grads(model, ids, None), loss_and_grads(plain, ids, None), atol=1e-12)
    if name == "full":  # HF's checkpointing really drops the saved activations
        assert saved_bytes(model, ids) <= saved_bytes(plain, ids) / 2


# ----------------------------------------------------------------------------- DDP
def _ddp_worker(rank, world_size):
    idx, tgt = _batch(batch=4, seq=32)
    shard = slice(rank * 4 // world_size, (rank + 1) * 4 // world_size)
    grads = {}
    for name in ("full", "selective-op"):
        model = apply_activation_checkpointing(_gpt(torch.float32), **MODES[name])  # before DDP
        ddp = DistributedDataParallel(model)
        ddp(idx[shard], tgt[shard]).backward()
        grads[name] = {n: p.grad for n, p in model.named_parameters()}
    return grads


def test_ddp_two_ranks_match_one_process():
    idx, tgt = _batch(batch=4, seq=32)
    plain = _gpt(torch.float32)
    _, expected = loss_and_grads(plain, idx, tgt)
    for rank_grads in run_distributed(_ddp_worker, 2):
        for name, grads in rank_grads.items():
            for n, g in grads.items():
                # fp32: each rank's mean over half the batch, averaged by all-reduce, sums in a
                # different order than one process's mean over the whole batch (~1e-7 relative).
                torch.testing.assert_close(g, expected[n], rtol=1e-5, atol=1e-6, msg=f"{name} {n}")
