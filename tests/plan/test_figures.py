"""The planner's figures are possible and say where they come from: MFU at most 100% and no
step below the FLOPs bound, with or without a profile (the profile in data/ is the one that
once gave "MFU 5699%": a bf16 matmul measured at 0.6 TFLOP/s on a CPU whose table peak is
0.01); the sources printed; CPU offload's host memory printed and checked against
--host-memory; the training-step fit of `meshfit calibrate` recovers known coefficients."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshfit.memory import ModelShape
from meshfit.plan import DEVICES, Cluster, search
from meshfit.plan.calibrate import load_calibration
from meshfit.plan.fit import _fit_step

DATA = Path(__file__).parent / "data"
OLD_PROFILE = DATA / "cpu_profile_without_train_steps.json"


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("profile", [None, OLD_PROFILE])
def test_mfu_is_at_most_100_percent_and_no_step_beats_the_flops_bound(dtype, profile):
    calibration = load_calibration(profile) if profile else None
    cluster = Cluster(gpus_per_node=2, device=DEVICES["cpu"], calibration=calibration)
    shape = ModelShape.of("tiny")
    result = search(shape, cluster, seq_len=256, global_batch_size=16, dtype=dtype)
    peak = cluster.peak_flops(dtype)
    if profile:  # the fastest measured matmul, not the table's (0.01 TFLOP/s for bf16)
        assert peak == max(r["flops"] for r in calibration.raw["matmul"][dtype])
    flops = shape.flops_per_token(256) * 16 * 256
    for plan in result.plans:
        assert 0 < plan.mfu <= 1.0
        assert plan.step_time_s >= flops / (2 * peak) * (1 - 1e-12)
    assert result.sources["mfu_peak"].startswith(
        "the fastest measured" if profile else "the data sheet's")


def test_sources_say_measured_or_assumed():
    table = Cluster(gpus_per_node=8).sources("bf16")
    assert table["compute"] == ("h100 data sheet 989 TFLOP/s bf16 x an assumed efficiency of "
                                "50% (not measured)")
    assert table["collectives"].endswith("(not measured), 80% hidden behind compute (assumed)")
    old = Cluster(gpus_per_node=2, calibration=load_calibration(OLD_PROFILE)).sources("fp32")
    assert old["compute"].startswith("measured matmul (cpu, profile)")
    assert "rerun meshfit calibrate" in old["compute"]


def test_offload_host_memory_is_printed_and_checked(capsys):
    from meshfit.cli.main import main

    assert main(["plan", "llama-70b", "--gpus-per-node", "8", "--seq-len", "4096",
                 "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "MFU 29% (assumed efficiency)" in out
    assert "host memory for CPU offload: 1,028 GiB per node (128.5 GiB per rank); not checked " \
           "(give --host-memory)" in out
    # too little host memory for CPU offload: the last resort, the optimizer state on disk
    assert main(["plan", "llama-70b", "--gpus-per-node", "8", "--seq-len", "4096",
                 "--host-memory", "512GiB", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "optimizer state on disk" in out and "host memory for CPU offload" not in out
    # GPUs of 40 GiB: the parameters and gradients do not fit on them, nor in 512 GiB of
    # host memory; ZeRO-3 with the parameter shards on disk too keeps only the gradient
    # shards (about 33 GiB per rank) and three state chunks on the host
    assert main(["plan", "llama-70b", "--gpus-per-node", "8", "--gpu-memory", "40GiB",
                 "--seq-len", "4096", "--host-memory", "512GiB", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "ZeRO-3, parameters and optimizer state on disk" in out
    assert "host memory for gradient shards and state chunks: " in out
    # ... and where the disk does not help either (not even the gradients fit the host),
    # the refusal names the host memory CPU offload needs
    assert main(["plan", "llama-70b", "--gpus-per-node", "8", "--gpu-memory", "40GiB",
                 "--seq-len", "4096", "--host-memory", "128GiB"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "more host memory than --host-memory=128 GiB per node" in err[0], err
    assert main(["plan", "llama-70b", "--gpus-per-node", "8", "--seq-len", "4096",
                 "--host-memory", "2TiB", "--top", "1"]) == 0
    assert "host memory for CPU offload: 1,028 GiB per node" in capsys.readouterr().out


def test_step_fit_recovers_known_coefficients_and_never_beats_the_matmul():
    """Seconds made from known coefficients of every term (`STEP_TERMS`) at the shapes
    `meshfit calibrate` times: the fit gives them back."""
    from meshfit.plan.fit import step_columns
    from meshfit.plan.probes import _STEP_SHAPES

    truth = [0.002, 0.001, 1e-7, 2e-9, 1 / 5e10]
    rows = []
    for d, layers, seq, batch in _STEP_SHAPES:
        flops = 6 * 12 * d * d * layers * batch * seq  # any positive FLOPs will do
        cols = step_columns(d_model=d, n_layer=layers, seq_len=seq, tokens=batch * seq,
                            heads=max(1, d // 32), flops=flops)
        rows.append({"d_model": d, "n_layer": layers, "seq_len": seq, "batch": batch,
                     "flops": flops, "seconds": sum(c * x for c, x in zip(truth, cols))})
    fit = _fit_step(rows, peak=1e11)
    assert [fit[k] for k in ("step_overhead", "block_overhead", "token_width",
                             "attention_scores")] == pytest.approx(truth[:4], rel=1e-6)
    assert fit["flops"] == pytest.approx(5e10, rel=1e-6)
    assert fit["max_relative_error"] < 1e-8
    capped = _fit_step(rows, peak=2e10)  # a matmul slower than the fit: the rate is capped
    assert capped["flops"] == pytest.approx(2e10)
