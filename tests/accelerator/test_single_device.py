"""Single-device options through `Accelerator`: precision, tf32, checkpointing, compile,
memory hygiene — each against a plain fp32 run of the same model on the same data."""

from __future__ import annotations

import pytest
import torch

from conftest import run_distributed
from reference import tiny_preset
from meshfit import Accelerator

SEQ, BATCH = 32, 4


def _tiny(**overrides):
    return tiny_preset(max_seq_len=SEQ, **overrides)  # fp32, as trained by default


def _tokens(steps, rank=0, world=1):
    """`steps` batches of this rank's share of the global batch, from the built-in corpus."""
    from meshfit.data import load_tokens

    n = steps * world * BATCH * (SEQ + 1)
    train = torch.tensor(load_tokens().train[:n].astype("int64"))
    data = train.view(steps, world * BATCH, SEQ + 1)
    return data[:, rank * BATCH:(rank + 1) * BATCH]


def _train(acc: Accelerator, model, steps=8, rank=0, world=1):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = acc.prepare(model, opt)
    losses = []
    for batch in _tokens(steps, rank, world):
        batch = batch.to(acc.device)
        with acc.accumulate(model):
            loss = model(batch[:, :-1], batch[:, 1:])
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    return model, opt, losses


def test_bf16_training_tracks_fp32_and_keeps_fp32_master_state():
    _, _, ref = _train(Accelerator(), _tiny())
    model, opt, got = _train(Accelerator(mixed_precision="bf16"), _tiny())
    assert ref[-1] < ref[0] - 0.5  # the reference does learn
    # bf16 rounds activations to 8 mantissa bits (relative ~4e-3 per op); over 8 AdamW steps
    # of a 4-block model the losses stay within a few percent of fp32's.
    for a, b in zip(got, ref):
        assert abs(a - b) <= 0.03 * b, (got, ref)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(v.dtype == torch.float32 for s in opt.state.values() for v in s.values()
               if torch.is_tensor(v) and v.is_floating_point())


def test_tf32_switch_sets_the_backend_flags():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        Accelerator(tf32=True)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        Accelerator(tf32=False)
        assert not torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_empty_cache_steps_counts_optimizer_steps(monkeypatch):
    import meshfit.accelerator.accelerator as accelerator_module

    calls = []
    monkeypatch.setattr(accelerator_module, "empty_device_cache", lambda d: calls.append(d))
    acc = Accelerator(gradient_accumulation_steps=2, empty_cache_steps=3)
    _train(acc, _tiny(), steps=14)  # 14 micro-batches = 7 optimizer steps
    assert len(calls) == 2  # after optimizer steps 3 and 6


def test_checkpointing_and_compile_through_prepare_match_plain():
    torch._dynamo.reset()
    _, _, ref = _train(Accelerator(), _tiny(), steps=3)
    acc = Accelerator(activation_checkpointing="full", compile=True, compile_backend="aot_eager")
    model, _, got = _train(acc, _tiny(), steps=3)
    # Recomputation replays the same ops; aot_eager runs the same kernels, traced: fp32
    # rounding only.
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=1e-6)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in _tiny().named_parameters()]
    torch._dynamo.reset()


def _ddp_checkpointed(rank, world, options):
    acc = Accelerator(**options)
    _, _, losses = _train(acc, _tiny(), steps=3, rank=rank, world=world)
    return losses


def test_checkpointing_under_ddp_matches_one_process():
    ranks = run_distributed(_ddp_checkpointed, 2, {"activation_checkpointing": "selective"})
    # Reference: one process on the 2-rank global batch (each rank's mean loss averaged).
    model = _tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ref = []
    g = _tokens(3, 0, 2), _tokens(3, 1, 2)
    for step in range(3):
        full = torch.cat([g[0][step], g[1][step]])
        opt.zero_grad()
        loss = model(full[:, :-1], full[:, 1:])
        loss.backward()
        opt.step()
        ref.append(loss.item())
    got = [(a + b) / 2 for a, b in zip(*ranks)]
    # fp32: the ranks' gradient average and the big batch differ by summation order (~1e-7).
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs,match", [
    ({"activation_checkpointing": "half"}, "activation_checkpointing='half' is not one of"),
    ({"activation_checkpointing_every": 0}, "activation_checkpointing_every=0"),
    ({"compile": True, "compile_backend": "nonesuch"}, "compile_backend='nonesuch'"),
    ({"compile_scope": "layer"}, "compile_scope='layer' is not one of block, model"),
    ({"empty_cache_steps": -1}, "empty_cache_steps=-1 must be an integer >= 0"),
])
def test_bad_single_device_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Accelerator(**kwargs)


class _Meter:
    """A script's own state, registered for checkpointing."""

    def __init__(self, n: int):
        self.n = n

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


def test_free_memory_frees_what_only_the_accelerator_held():
    """A prepared model and optimizer that nobody else holds, in a reference cycle (as a model
    with hooks is), are gone once `free_memory` returns: it forgets them before it collects
    garbage (it collected first, while it still held them)."""
    import weakref

    acc = Accelerator()
    model, opt, _ = _train(acc, _tiny(), steps=1)
    model.cycle = [model]  # only a collection frees a cycle
    gone = (weakref.ref(model), weakref.ref(opt))
    del model, opt
    assert all(ref() is not None for ref in gone)
    acc.free_memory()
    assert [ref() for ref in gone] == [None, None]


def test_free_memory_forgets_what_was_prepared_and_keeps_what_was_registered(tmp_path):
    acc = Accelerator()
    acc.register_for_checkpointing(_Meter(5))
    _train(acc, _tiny(), steps=2)
    acc.free_memory()  # between two trainings: the first model and optimizer are forgotten
    model, _, _ = _train(acc, _tiny(), steps=1)
    acc.save_state(tmp_path / "ckpt")
    # A job of one model, one optimizer and the registered meter reads it back (a checkpoint
    # still holding the first training's model would be refused: 2 models, 1 prepared).
    again, meter = Accelerator(), _Meter(0)
    again.register_for_checkpointing(meter)
    fresh = _tiny()
    fresh, _ = again.prepare(fresh, torch.optim.AdamW(fresh.parameters(), lr=3e-3))
    manifest = again.load_state(tmp_path / "ckpt")
    assert len(manifest.model["shapes"]) == 1 and meter.n == 5
    torch.testing.assert_close(again.get_state_dict(fresh), acc.get_state_dict(model))
