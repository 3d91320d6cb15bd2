"""`meshfit train` refuses, before any process starts, a run that cannot fit this machine's
memory by the estimate (`meshfit.train.fits`), naming the estimate, what is available and the
layouts that fit; `--no-memory-check` starts it anyway. The figures are the estimate's
(`meshfit.memory.estimate`, tested against measurements in tests/memory)."""

from __future__ import annotations

import re

import pytest
import torch

from meshfit.memory import LayoutSpec, ModelShape
from meshfit.memory.estimate import estimate
from meshfit.train.configfile import load_config
from meshfit.train.fits import check_fits, host_available_bytes
from meshfit.train.preflight import _checked_model, preflight
from meshfit.train.models import check_model_source
from meshfit.train import tokens

GiB = 2**30


def _model(cfg):
    return _checked_model(cfg, tokens.vocab_size(cfg), check_model_source)


def _expected(cfg, **spec):
    model = _model(cfg)
    return estimate(ModelShape.from_module(model),
                    LayoutSpec(micro_batch_size=cfg.train.micro_batch_size, **spec),
                    seq_len=cfg.train.seq_len, dtype="fp32", optimizer="adamw_fused")


def test_a_run_that_cannot_fit_is_refused_with_the_estimate_and_the_layouts_that_fit():
    cfg = load_config(None, ["--model.preset=llama-1b", "--train.seq_len=1024"])
    est = _expected(cfg, dp_replicate=2)
    layout = cfg.layout(2, 2)
    with pytest.raises(ValueError) as err:  # 12 GiB per rank: a 24 GiB host, 2 ranks
        check_fits(cfg, _model(cfg), layout, world_size=2, local_world_size=2,
                   device=torch.device("cpu"), available=12 * GiB, host=24 * GiB)
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith("model.preset='llama-1b' does not fit with dp_replicate 2, "
                           "micro-batch 16 on 2 process(es): the estimate is "
                           f"{est.total / GiB:.1f} GiB per rank")
    assert "12.0 GiB is available per rank (2 local rank(s) share 24.0 GiB" in line
    listed = re.search(r"Layouts of 2 process\(es\) that fit \(`meshfit plan`\): (.*); or pass "
                       r"--no-memory-check to start anyway$", line)
    assert listed, line
    for described in listed.group(1).split("; "):  # each named layout fits by the estimate
        assert "offload" not in described  # on a CPU, offloading saves nothing
    # and it fits when the machine is large enough
    assert check_fits(cfg, _model(cfg), layout, world_size=2, local_world_size=2,
                      device=torch.device("cpu"), available=est.total + GiB, host=64 * GiB) \
        is None


def test_nothing_fits_says_so():
    cfg = load_config(None, ["--model.preset=llama-7b"])
    with pytest.raises(ValueError, match=r"No layout of 2 process\(es\) fits 11\.0 GiB per rank"):
        check_fits(cfg, _model(cfg), cfg.layout(2, 2), world_size=2, local_world_size=2,
                   device=torch.device("cpu"), available=11 * GiB, host=22 * GiB)


def test_offload_on_gpus_is_checked_against_the_host():
    """On CUDA the device holds est.total; the offloaded states of the local ranks share the
    host's memory (a 70B-class model on 8 GPUs needs about 1 TiB of it)."""
    cfg = load_config(None, ["--model.preset=llama-1b", "--parallel.dp_shard=8",
                             "--parallel.dp_replicate=1", "--parallel.zero_stage=3",
                             "--parallel.offload=cpu", "--train.micro_batch_size=1",
                             "--train.global_batch_size=8"])
    est = _expected(cfg, dp_shard=8, zero_stage=3, offload="cpu")
    assert est.host > 0
    with pytest.raises(ValueError, match=r"CPU offload needs [0-9.]+ GiB of host memory for the "
                                         r"8 local rank\(s\) and 1\.0 GiB is available"):
        check_fits(cfg, _model(cfg), cfg.layout(8, 8), world_size=8, local_world_size=8,
                   device=torch.device("cuda"), available=80 * GiB, host=GiB)
    assert check_fits(cfg, _model(cfg), cfg.layout(8, 8), world_size=8, local_world_size=8,
                      device=torch.device("cuda"), available=80 * GiB, host=2**40) is None


def test_preflight_checks_memory_unless_told_not_to(monkeypatch, tmp_path, capsys):
    """llama-7b on 2 processes of a 24 GiB machine cannot fit (its model states alone are
    96 GiB per rank under DDP): `meshfit train` says so in one line before any process or
    file exists; --no-memory-check (memory_check=False) leaves the run to start."""
    from meshfit.cli.main import main
    from meshfit.train import fits

    assert host_available_bytes() > 0  # this machine's MemAvailable is readable
    monkeypatch.setattr(fits, "host_available_bytes", lambda: 24 * GiB)
    cfg = load_config(None, ["--model.preset=llama-7b"])
    with pytest.raises(ValueError, match="does not fit"):
        preflight(cfg, 2, 2)
    preflight(cfg, 2, 2, memory_check=False)
    out = tmp_path / "run"
    assert main(["train", "--nproc", "2", "--out", str(out), "--model.preset=llama-7b"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not fit with dp_replicate 2" in err[0], err
    assert "12.0 GiB is available per rank" in err[0]
    assert not out.exists() or not any(out.iterdir())


def test_lora_is_estimated_with_its_adapters_alone_trained():
    """A LoRA run of llama-1b: the check reads the frozen base's shape and the adapters
    (before: "memory not checked" for any LoRA model), so a run that full training could
    not fit passes, and its estimate is the estimate with `Adapters`."""
    from meshfit.memory import Adapters
    from meshfit.train.fits import adapters_of

    args = ["--model.preset=llama-1b", "--train.seq_len=256", "--train.micro_batch_size=1",
            "--train.global_batch_size=2"]
    full = load_config(None, args)
    cfg = load_config(None, [*args, "--peft.method=lora", "--peft.r=8"])
    layout = cfg.layout(2, 2)
    model = _model(cfg)
    adapters = adapters_of(model)
    assert 0 < adapters.trainable < 0.01 * sum(p.numel() for p in model.parameters())
    assert adapters == Adapters(trainable=adapters.trainable)  # nothing in 4 bits
    shape = ModelShape.from_module(_model(full))
    spec = LayoutSpec(dp_replicate=2, micro_batch_size=1)
    lora_est = estimate(shape, spec, seq_len=256, dtype="fp32", optimizer="adamw_fused",
                        adapters=adapters)
    full_est = estimate(shape, spec, seq_len=256, dtype="fp32", optimizer="adamw_fused")
    available = int((lora_est.total + full_est.total) / 2)
    with pytest.raises(ValueError, match="does not fit"):
        check_fits(full, _model(full), layout, world_size=2, local_world_size=2,
                   device=torch.device("cpu"), available=available, host=64 * GiB)
    assert check_fits(cfg, model, layout, world_size=2, local_world_size=2,
                      device=torch.device("cpu"), available=available, host=64 * GiB) is None
    with pytest.raises(ValueError) as err:  # just below: refused with the LoRA estimate
        check_fits(cfg, model, layout, world_size=2, local_world_size=2,
                   device=torch.device("cpu"), available=int(lora_est.total) - 1, host=64 * GiB)
    assert f"the estimate is {lora_est.total / GiB:.1f} GiB per rank" in str(err.value)


@pytest.mark.parametrize("args, launched, without", [
    (["--parallel.cp=2"], dict(cp=2), {}),
    (["--parallel.cp=2", "--parallel.zero_stage=3"], dict(cp=2, zero_stage=3), {}),
    (["--parallel.offload=disk"], dict(dp_replicate=2, offload="disk"), dict(dp_replicate=2)),
    (["--parallel.dp_shard=2", "--parallel.zero_stage=3", "--parallel.offload=disk",
      "--parallel.offload_params=true"],
     dict(dp_shard=2, zero_stage=3, offload="disk", offload_params=True),
     dict(dp_shard=2, zero_stage=3)),
], ids=["cp", "cp-zero3", "disk", "disk-params"])
def test_the_check_estimates_the_layout_that_is_launched(args, launched, without, tmp_path):
    """The check's spec is the run's [parallel] request whole: context parallel (each rank
    holds half of every sequence; under ZeRO the states shard over cp) and the optimizer
    state (and parameters) on disk change the figure it decides on, so a run that fits only
    because of them is admitted, and refused just below its own estimate (before, the check
    dropped cp and turned offload='disk' into 'none' or 'cpu')."""
    if "--parallel.offload=disk" in args:
        args = [*args, f"--parallel.offload_dir={tmp_path}"]
    cfg = load_config(None, ["--model.preset=llama-1b", "--train.seq_len=1024",
                             "--parallel.dp_replicate=-1", *args])
    layout = cfg.layout(2, 2)
    est, plain = _expected(cfg, **launched), _expected(cfg, **without)
    assert est.total < plain.total  # the setting is what makes the run fit
    fit = dict(world_size=2, local_world_size=2, device=torch.device("cpu"), host=64 * GiB)
    assert check_fits(cfg, _model(cfg), layout, available=int(est.total + est.host) + 1,
                      **fit) is None
    with pytest.raises(ValueError) as err:
        check_fits(cfg, _model(cfg), layout, available=int(est.total + est.host) - 1, **fit)
    assert f"the estimate is {(est.total + est.host) / GiB:.1f} GiB per rank" in str(err.value)
