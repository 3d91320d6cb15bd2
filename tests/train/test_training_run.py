"""`meshfit.train.TrainingRun`, the trainer's public way to set a run up and take its optimizer
steps: its steps are the ones `meshfit train` takes (the losses and gradient norms `train`
logs for the same configuration, one process), what a step returns, and the model hook
(`meshfit verify`'s float64 without dropout). Layouts against one process through it:
tests/verify/test_verify.py."""

from __future__ import annotations

import json

import pytest
import torch

from meshfit.distributed import init
from meshfit.train import StepResult, TrainingRun
from meshfit.train.configfile import load_config
from meshfit.train.trainer import train

STEPS = 3


def _config(tmp_path):
    # 8 sequences per step in micro-batches of 4: two micro-batches a step
    return load_config(None, [f"--train.steps={STEPS}", "--train.log_every=1",
                              "--train.eval_every=0", "--train.global_batch_size=8",
                              "--train.micro_batch_size=4", "--train.seq_len=32",
                              "--train.eval_batches=1", "--model.n_layer=1",
                              f"--data.cache_dir={tmp_path / 'cache'}"])


def test_its_steps_are_the_ones_meshfit_train_logs(tmp_path):
    cfg = _config(tmp_path)
    train(cfg, tmp_path / "run", init(cpu=True))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
               .splitlines()]
    logged = [r for r in records if "loss" in r]
    assert [r["step"] for r in logged] == list(range(1, STEPS + 1))

    run = TrainingRun(cfg, init(cpu=True))
    assert run.accum == 2 and run.micro_batch_size == 4
    for record in logged:
        step = run.step(grad_norm=True)
        assert isinstance(step, StepResult) and len(step.losses) == run.accum
        # the logged loss: the window's float32 sum over the micro-batches, rounded to 5 places
        assert float(step.loss) == pytest.approx(record["loss"], abs=2e-5)
        assert step.grad_norm == pytest.approx(record["grad_norm"], abs=2e-5)
        assert float(step.loss) == pytest.approx(
            sum(float(loss) for loss in step.losses) / run.accum, rel=1e-12)
    assert run.step().grad_norm is None  # measured only when asked for
    state = run.state_dict()
    assert state.keys() == run.model.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in run.model.state_dict().items())


def test_the_model_hook_changes_the_model_before_it_is_laid_out(tmp_path):
    seen = []

    def hook(model: torch.nn.Module) -> torch.nn.Module:
        seen.append(next(model.parameters()).dtype)
        return model.to(torch.float64)

    run = TrainingRun(_config(tmp_path), init(cpu=True), model_hook=hook)
    assert seen == [torch.float32]  # built as [model] says, then changed once
    assert {p.dtype for p in run.model.parameters()} == {torch.float64}
    step = run.step()
    assert {loss.dtype for loss in step.losses} == {torch.float64}
    assert step.loss.dtype == torch.float64 and torch.isfinite(step.loss)
