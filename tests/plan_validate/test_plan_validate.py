"""`meshfit plan --validate` (`meshfit.plan_validate`): the flag's wiring, and the timed steps
run as `meshfit train` runs them. Its measured accuracy on the planner's plans is in
tests/memory/test_estimate_measured.py."""

from __future__ import annotations

import torch

from conftest import run_distributed
from meshfit import Accelerator, ParallelDims, optim, plan_validate
from meshfit.cli.main import main
from meshfit.models import GPT, GPTConfig
from meshfit.plan_validate import _timed_steps

GiB = 2**30


def test_plan_validate_prints_predicted_beside_measured(capsys, monkeypatch):
    """The flag's wiring (the measuring itself: tests/memory/test_estimate_measured.py)."""
    seen = {}

    def fake(plans, **kwargs):
        seen.update(kwargs, n=len(plans))
        return [{"layout": plans[0].layout.describe(), "predicted_bytes": 2.0 * GiB,
                 "measured_bytes": 2.5 * GiB, "predicted_step_s": 1.0, "measured_step_s": 0.8,
                 "bytes_error": -0.2, "time_error": 0.25, "skipped": None},
                {"layout": "pp 2", "skipped": "world size 4, not 2"}]

    monkeypatch.setattr(plan_validate, "validate", fake)
    assert main(["plan", "tiny", "--gpus-per-node", "2", "--gpu", "cpu", "--seq-len", "128",
                 "--global-batch-size", "8", "--dtype", "fp32", "--validate", "2"]) == 0
    out = capsys.readouterr().out
    assert seen["nproc"] == 2 and seen["n"] == 2 and seen["dtype"] == "fp32"
    assert "2.000 vs 2.500 GiB (-20%), 1 vs 0.8 s (+25%)" in out
    assert "pp 2: skipped (world size 4, not 2)" in out


def _validate_syncs_once(rank, world_size):
    """`plan --validate`'s timed steps on DDP with 4 accumulated micro-batches: the gradient
    all-reduces it runs (a DDP communication hook counts them)."""
    acc = Accelerator(parallel=ParallelDims(dp_replicate=2), gradient_accumulation_steps=4)
    torch.manual_seed(0)
    model = acc.prepare(GPT(GPTConfig(vocab_size=64, d_model=32, n_layer=1, n_head=2,
                                      d_ff=64, max_seq_len=16)))
    opt = acc.prepare(optim.build("adamw", model, lr=1e-3))
    calls = []

    def hook(state, bucket):
        calls.append(1)
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    model.register_comm_hook(None, hook)
    tokens = torch.randint(0, 64, (4, 1, 17))
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]
    _timed_steps(acc, opt, batches, lambda x, y: acc.backward(model(x, y)), 2, (model,))
    return len(calls)


def test_plan_validate_times_steps_as_meshfit_train_runs_them():
    """Gradients sync once per optimizer step (accumulate(model), as meshfit train), not on
    every micro-batch: 2 steps of 4 micro-batches, one bucket each -> 2 all-reduces."""
    assert run_distributed(_validate_syncs_once, 2, timeout=120) == [2, 2]


def test_a_validating_rank_hides_the_libraries_import_notes(monkeypatch, caplog):
    """A rank of `plan --validate` is a new interpreter, without the command's quieted
    loggers: torchao's notes on the extensions it cannot load ("Failed to load ..._C_mxfp8")
    and torch's pytree notes on torchao's enums, logged when a rank imports transformers or
    peft, once per rank, are not shown (as `meshfit`'s commands hide them). Here a rank's
    entry point runs in this process, the loggers reset as a new interpreter has them, and
    its work (stood in for) logs both notes."""
    import logging

    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]

    def run_one(rank, layout, *args):
        loggers[0].warning("Failed to load /site-packages/torchao/_C_mxfp8.so")
        loggers[1].warning("<enum 'KernelPreference'> is an Enum subclass ...")
        return {"rank": rank, "layout": layout}

    monkeypatch.setattr(plan_validate, "_run_one", run_one)
    try:
        for lg in loggers:
            lg.setLevel(logging.NOTSET)
        with caplog.at_level(logging.WARNING):
            out = plan_validate._run_plans(0, 1, [(0, "a layout")], "tiny", 32, 2, "fp32", 2,
                                           "adamw")
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
    assert out == {0: {"rank": 0, "layout": "a layout"}}
    assert [r.getMessage() for r in caplog.records if r.name.startswith("torch")] == []
