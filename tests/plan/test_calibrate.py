"""`meshfit calibrate`: the collective model, the file's loader, the fit, one real run on two
gloo ranks, and refusals of bad arguments before any process starts."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from meshfit.cli import calibrate as cal
from meshfit.cli.calibrate import cmd_calibrate, parse_sizes
from meshfit.plan.calibrate import PP_SCHEDULES, Calibration, load_calibration
from meshfit.plan.fit import KINDS, CollectiveFit, TrainStepFit, fit_latency_bandwidth
from meshfit.plan.trust import judge

_FITS = {"all_reduce": (1e9, 50e-6), "all_gather": (2e9, 40e-6), "reduce_scatter": (3e9, 30e-6),
         "all_to_all": (4e9, 20e-6), "send_recv": (5e9, 10e-6)}


def _calibration(fits=_FITS, world_size=8) -> Calibration:
    return Calibration(
        schema=1, device="cpu", backend="gloo", world_size=world_size, torch="2.13",
        time="2025-01-01T00:00:00+00:00", matmul_flops={"fp32": 1e11, "bf16": 2e11, "fp16": None},
        memory_bandwidth=1e10,
        collectives={k: CollectiveFit(bus_bandwidth=b, latency=a) for k, (b, a) in fits.items()},
        raw={})


def _file_dict() -> dict:
    return {"schema": 1, "device": "cpu", "backend": "gloo", "world_size": 2, "torch": "2.13",
            "time": "2025-01-01T00:00:00+00:00",
            "matmul_flops": {"fp32": 1e11, "bf16": 2e11, "fp16": 3e9},
            "memory_bandwidth": 1e10,
            "collectives": {k: {"bus_bandwidth": b, "latency": a} for k, (b, a) in _FITS.items()},
            "raw": {}}


def test_collective_time_applies_the_model():
    c = _calibration()
    S = 64 << 20
    for n in (2, 4, 8):
        factors = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n,
                   "reduce_scatter": (n - 1) / n, "all_to_all": (n - 1) / n, "send_recv": 1.0}
        for kind, (bw, lat) in _FITS.items():
            assert c.collective_time(kind, S, n) == pytest.approx(lat + factors[kind] * S / bw,
                                                                  rel=1e-12)
    assert all(c.collective_time(k, S, 1) == 0.0 for k in KINDS)
    with pytest.raises(ValueError, match="kind='broadcast'"):
        c.collective_time("broadcast", S, 2)
    with pytest.raises(ValueError, match="n=0"):
        c.collective_time("all_reduce", S, 0)
    # one process measured no collectives: asking for a group says how to measure them
    single = _calibration({k: (None, None) for k in KINDS}, world_size=1)
    assert single.collective_time("all_reduce", S, 1) == 0.0
    with pytest.raises(ValueError, match="--nproc 2"):
        single.collective_time("all_reduce", S, 2)


def _refusal(path, match: str) -> str:
    with pytest.raises(ValueError, match=match) as info:
        load_calibration(path)
    msg = str(info.value)
    assert "\n" not in msg and "meshfit calibrate" in msg
    return msg


def test_load_calibration_reads_and_refuses(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(_file_dict()))
    c = load_calibration(path)
    assert c.world_size == 2 and c.collectives["send_recv"] == CollectiveFit(5e9, 10e-6)
    assert c.collective_time("all_reduce", 1e9, 2) == pytest.approx(50e-6 + 1.0)

    _refusal(tmp_path / "nowhere.json", "does not exist")
    path.write_text("{not json")
    _refusal(path, "not readable JSON")
    path.write_text(json.dumps({**_file_dict(), "schema": 2}))
    _refusal(path, "schema 2, this meshfit reads schema 1")
    d = _file_dict()
    del d["memory_bandwidth"], d["collectives"]["all_gather"]["latency"], d["matmul_flops"]["bf16"]
    path.write_text(json.dumps(d))
    msg = _refusal(path, "lacks")
    for key in ("memory_bandwidth", "collectives.all_gather.latency", "matmul_flops.bf16"):
        assert key in msg
    d = _file_dict()
    d["collectives"]["all_to_all"]["bus_bandwidth"] = "fast"
    path.write_text(json.dumps(d))
    _refusal(path, "invalid collectives.all_to_all.bus_bandwidth")
    path.write_text(json.dumps({**_file_dict(), "data_parallel": {"ddp": 1.5, "zero1": None,
                                                                  "fsdp2": 2}}))
    assert load_calibration(path).data_parallel == {"ddp": 1.5, "zero1": None, "fsdp2": 2.0,
                                                    "tp": None, "tp_sp": None}
    assert load_calibration(path).data_parallel is not None
    path.write_text(json.dumps({**_file_dict(), "data_parallel": {"ddp": "x"}}))
    _refusal(path, "invalid data_parallel")
    path.write_text(json.dumps({**_file_dict(), "pipeline": {"gpipe": 0.003, "1f1b": None,
                                                             "interleaved_1f1b": 0.004,
                                                             "zero_bubble": 0.005}}))
    assert load_calibration(path).pipeline["gpipe"] == 0.003
    path.write_text(json.dumps({**_file_dict(), "pipeline": {"gpipe": -1}}))
    _refusal(path, "invalid pipeline")
    path.write_text(json.dumps({**_file_dict(), "disk": {"folder": "/x", "write": 3e8,
                                                         "read": 2e9}}))
    assert load_calibration(path).disk_bandwidth() == 3e8  # the slower of the two
    assert load_calibration(path.with_name("cal.json")).disk is not None
    path.write_text(json.dumps({**_file_dict(), "disk": {"write": 0, "read": 2e9}}))
    _refusal(path, "invalid disk")


_STEP = {"block_overhead": 1e-3, "flops": 1e10, "optimizer_per_param": 1e-9}


@pytest.mark.parametrize("change, match", [
    (lambda d: d["collectives"].pop("all_reduce"), "lacks collectives.all_reduce;"),
    (lambda d: d["collectives"].update(all_reduce=5),
     r"invalid collectives.all_reduce=5 \(an object\);"),
    (lambda d: d.update(train_step=3), r"invalid train_step=3 \(an object or null\);"),
    (lambda d: d.update(train_step={"bf16": {**_STEP, "flops": 0}}),
     r"invalid train_step.bf16.flops=0 \(a rate > 0 and <= 1e\+18 per second\);"),
    (lambda d: d.update(train_step={"fp32": {**_STEP, "token_width": None}}),
     r"invalid train_step.fp32.token_width=null \(seconds >= 0\);"),
    (lambda d: d.update(data_parallel={"ddp": -1.0}),
     r"invalid data_parallel.ddp=-1.0 \(a multiple >= 0 or null\);"),
    (lambda d: d.update(world_size=0, disk={"write": 1e9}),
     r"invalid world_size=0 \(a whole number >= 1\), disk.read=null \(a rate > 0"),
    (lambda d: d["collectives"]["all_gather"].update(latency=None),
     r"invalid collectives.all_gather \(bus_bandwidth and latency: both measured or both "
     r"null\);"),
])
def test_load_calibration_names_each_key_it_refuses(tmp_path, change, match):
    """Each refusal names the key at fault by its path, with its value and what it must be,
    every one of them in one line."""
    d = _file_dict()
    change(d)
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(d))
    _refusal(path, match)


def _full_file_dict() -> dict:
    """A file with every section, and the raw timings meshfit reads back, filled in."""
    steps = {"step_overhead": 1e-3, "block_overhead": 1e-3, "token_width": 1e-9,
             "attention_scores": 1e-10, "flops": 1e10, "optimizer_per_param": 1e-9}
    timed = {"seconds": 0.2, "predicted_without_tp": 0.1, "noise_seconds": 0.01}
    return {**_file_dict(), "train_step": {"fp32": steps, "bf16": dict(steps), "fp16": None},
            "data_parallel": {"ddp": 1.5, "zero1": 2.0, "fsdp2": 3.0, "tp": 4.0, "tp_sp": 5.0},
            "pipeline": dict.fromkeys(PP_SCHEDULES, 0.002),
            "disk": {"folder": "/x", "write": 1e9, "read": 2e9},
            "flags": {"pipeline.gpipe": "a reason"},
            "raw": {"matmul": {"fp32": [{"flops": 1e11}], "bf16": [{"flops": 2e11}]},
                    "collectives": {k: {"r2": 0.99} for k in KINDS},
                    "train_step": {"fp32": {"r2": 0.98}, "bf16": {"r2": 0.97}},
                    "data_parallel": {**{e: {"exposed_seconds": 0.05, "noise_seconds": 0.01}
                                         for e in ("ddp", "zero1", "fsdp2")},
                                      "tp": dict(timed), "tp_sp": dict(timed)},
                    "pipeline": {s: {"seconds": 0.2, "predicted_seconds": 0.1,
                                     "noise_seconds": 0.01} for s in PP_SCHEDULES},
                    "noise": {"median_spread": 0.05, "repeats": 5, "timings": 80}}}


def _numbers(obj, path=""):
    """(path, the object holding it, its key) of every number in `obj`, paths as the
    loader names them."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj)
    for key, value in items:
        name = (f"{path}.{key}" if path else key) if isinstance(obj, dict) else f"{path}[{key}]"
        if isinstance(value, (dict, list)):
            yield from _numbers(value, name)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield name, obj, key


def test_every_number_read_from_a_calibration_file_is_checked(tmp_path):
    """The class of "a figure outside its physical range is used": every number the loader
    reads (the figures, and the raw timings the planner and the flags read back) is refused,
    in one line naming its key and value, when it is not finite; every figure (not the raw
    timings, of which some are differences) when it is negative; every rate when it is 0
    (a zero bandwidth was a ZeroDivisionError). The file itself loads."""
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(_full_file_dict()))
    assert load_calibration(path).flags == {"pipeline.gpipe": "a reason"}
    rates = ("bus_bandwidth", "flops", "memory_bandwidth", "write", "read", "fp32", "bf16",
             "fp16")
    checked = 0
    for name, _, _ in _numbers(_full_file_dict()):
        if name == "schema":
            continue
        wrong = [math.nan, math.inf, "1"]
        if not name.startswith("raw."):
            wrong.append(-1e-3)
        if name.rpartition(".")[2] in rates:
            wrong.append(0)
        for value in wrong:
            d = _full_file_dict()
            _, holder, key = next(n for n in _numbers(d) if n[0] == name)
            holder[key] = value
            path.write_text(json.dumps(d))
            msg = _refusal(path, "has invalid")
            assert f"{name}={json.dumps(value)} (" in msg, (name, value, msg)
            checked += 1
    assert checked > 150
    # the figures' own types refuse them too (a Calibration or a Cluster built by hand)
    from meshfit.plan import Link

    for build, match in ((lambda: CollectiveFit(0.0, 1e-5), "bus_bandwidth=0.0 must be a rate"),
                         (lambda: CollectiveFit(1e9, None), "both measured or neither"),
                         (lambda: TrainStepFit(block_overhead=-1.0, flops=1e10,
                                               optimizer_per_param=0.0), "block_overhead=-1.0"),
                         (lambda: TrainStepFit(block_overhead=0.0, flops=math.nan,
                                               optimizer_per_param=0.0), "flops=nan"),
                         (lambda: Link(bandwidth=0, latency=0.0), "bandwidth=0")):
        with pytest.raises(ValueError, match=match):
            build()


def test_a_bad_profile_is_one_line_before_anything_is_planned(tmp_path, cli_refusal):
    """`meshfit plan --profile` with a zero all-reduce bandwidth (once a 26-line
    ZeroDivisionError) or a negative step overhead (once a plan's MFU 44% -> 85%)."""
    for change in (lambda d: d["collectives"]["all_reduce"].update(bus_bandwidth=0),
                   lambda d: d["train_step"]["fp32"].update(step_overhead=-0.01)):
        d = _full_file_dict()
        change(d)
        (tmp_path / "cal.json").write_text(json.dumps(d))
        line = cli_refusal("plan", "tiny", "--gpus-per-node", "2", "--gpu", "cpu",
                           "--profile", str(tmp_path / "cal.json"))
        assert "cal.json has invalid" in line and ("all_reduce.bus_bandwidth=0 (" in line
                                                   or "step_overhead=-0.01 (" in line), line


def test_load_calibration_reads_the_optional_sections(tmp_path):
    """Absent sections read as None, absent keys of a section as None (a training step's
    extra terms as 0), figures as floats."""
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({**_file_dict(), "train_step": {"fp32": _STEP, "bf16": None},
                                "pipeline": None}))
    c = load_calibration(path)
    assert c.train_step == {"fp32": TrainStepFit(**_STEP), "bf16": None, "fp16": None}
    assert c.train_step["fp32"].token_width == 0.0
    assert (c.pipeline, c.data_parallel, c.disk) == (None, None, None)
    assert c.matmul_flops == {"fp32": 1e11, "bf16": 2e11, "fp16": 3e9}
    assert c.collectives["all_reduce"] == CollectiveFit(1e9, 50e-6)


def test_fit_recovers_latency_and_bandwidth_exactly():
    sizes = [4096 * 4**i for i in range(8)]
    for factor in (1.0, 0.5, 1.5, 7 / 8):
        lat, bw = 37e-6, 3.3e9
        times = [lat + factor * s / bw for s in sizes]
        fit = fit_latency_bandwidth(sizes, times, factor)
        assert fit["latency"] == pytest.approx(lat, rel=1e-9)
        assert fit["bus_bandwidth"] == pytest.approx(bw, rel=1e-9)
        assert fit["r2"] == pytest.approx(1.0, abs=1e-12)
        assert fit["max_relative_error"] < 1e-9
    # times that would fit a negative latency: refitted through the origin, still positive
    fit = fit_latency_bandwidth([1000, 2000], [1e-6, 3e-6])
    assert fit["latency"] == 0.0 and 0 < fit["bus_bandwidth"] < math.inf


def test_parse_sizes():
    assert parse_sizes(["4K,64k", "1M", "1MiB", "512"]) == (512, 4096, 65536, 1 << 20)


@pytest.mark.parametrize("args, match", [
    (["--nproc", "0"], "--nproc=0 must be >= 1"),
    (["--nproc", "two"], "--nproc='two' is not an integer"),
    (["--out", "{tmp}/missing/cal.json"], "--out=.*does not exist"),
    (["--out", "{tmp}"], "--out=.*is a folder"),
    (["--sizes", "4K"], "--sizes=.*1 distinct size"),
    (["--sizes", "4K", "4096"], "--sizes=.*1 distinct size"),
    (["--sizes", "4K", "lots"], "--sizes value 'lots' is not a byte size"),
    (["--sizes", "0", "4K"], "--sizes value '0' is under 4 bytes"),
    (["--offload-dir", "{tmp}/nowhere"], "--offload-dir=.*nowhere' is not a folder"),
    (["--offload-dir", "{tmp}", "--offload-gib", "0"], r"--offload-gib=0.0 must be in \(0, 1024\]"),
    (["--repeats", "1"], r"--repeats=1 must be >= 2 \(a timing's spread needs two repeats\)"),
    (["--repeats", "many"], "--repeats='many' is not an integer"),
])
def test_bad_arguments_are_refused_before_any_process_starts(args, match, tmp_path,
                                                             monkeypatch):
    from meshfit import launch

    def started(*a, **k):
        raise AssertionError("a process or a measurement was started")

    monkeypatch.setattr(launch, "run", started)
    monkeypatch.setattr(cal, "_worker", started)
    monkeypatch.setenv("MESHFIT_CPU", "1")  # the CPU's checks even beside GPUs
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    if "--out" not in args:
        args += ["--out", str(tmp_path / "cal.json")]
    with pytest.raises(ValueError, match=match) as info:
        cmd_calibrate(["--nproc", "2", *args] if "--nproc" not in args else args)
    assert "\n" not in str(info.value)
    assert list(tmp_path.iterdir()) == []  # no --out written


def test_more_processes_than_gpus_is_refused(tmp_path, monkeypatch):
    import torch

    from meshfit import launch

    monkeypatch.delenv("MESHFIT_CPU", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(launch, "run", lambda *a, **k: pytest.fail("launched"))
    out = tmp_path / "cal.json"
    with pytest.raises(ValueError, match="--nproc=2 is more than the 1 visible CUDA.*--cpu"):
        cmd_calibrate(["--nproc", "2", "--out", str(out)])
    assert not out.exists()


def test_two_gloo_ranks_write_a_calibration(tmp_path, subprocess_env):
    """One real run, small (2 repeats, 3 sizes): the file and what it says of itself. What
    it measures depends on the machine's load; what is asserted does not: each figure is
    checked against the timings it was derived from, and each flag is the one `judge`
    finds in the file and printed. The timeout guards against a hang only (the run takes
    20-60 s on 2 loaded cores)."""
    out = tmp_path / "cal.json"
    proc = subprocess.run(
        [sys.executable, "-m", "meshfit", "calibrate", "--nproc", "2", "--cpu", "--out",
         str(out), "--sizes", "4K", "64K", "1M", "--repeats", "2", "--offload-dir",
         str(tmp_path), "--offload-gib", "0.0625"],
        env=subprocess_env, cwd=tmp_path, capture_output=True, text=True, timeout=900,
        check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "all_reduce" in proc.stdout and str(out) in proc.stdout
    c = load_calibration(out)
    assert (c.device, c.backend, c.world_size) == ("cpu", "gloo", 2)
    # --offload-dir: the folder's disk, measured (and its probe file gone)
    assert c.disk["folder"] == str(tmp_path.resolve()) and "disk (" in proc.stdout
    assert c.disk["write"] > 0 and c.disk["read"] > 0
    assert not any(p.name.startswith(".meshfit-bandwidth") for p in tmp_path.iterdir())
    _check_written(c, json.loads(out.read_text()), proc.stdout)
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def _good(x):
    return isinstance(x, float) and 0 < x < math.inf


def _check_written(c: Calibration, data: dict, stdout: str) -> None:
    """A file `meshfit calibrate` wrote on 2 ranks, by each figure's definition."""
    # each timing repeated twice, its spread kept and summed up
    noise = c.raw["noise"]
    assert noise["repeats"] == 2 and noise["timings"] > 50
    assert 0 <= noise["median_spread"] <= noise["max_spread"]
    assert all(row["spread"] >= 0 for rows in c.raw["matmul"].values() if isinstance(rows, list)
               for row in rows)
    assert f"each repeated 2 times; the repeats' range: a median" in stdout
    # the flags: those `judge` finds in the file, written and printed
    assert data["flags"] == judge(data) == c.flags
    for figure, why in c.flags.items():
        assert f"    {figure}: {why}" in stdout
    assert all(_good(c.matmul_flops[d]) for d in ("fp32", "bf16", "fp16"))
    assert _good(c.memory_bandwidth)
    for kind in KINDS:
        fit = c.collectives[kind]
        assert _good(fit.bus_bandwidth) and fit.latency >= 0 and math.isfinite(fit.latency)
        raw = c.raw["collectives"][kind]
        assert len(raw["nbytes"]) == len(raw["seconds"]) == len(raw["spread"]) == 3
        assert _good(c.collective_time(kind, 1 << 20, 2))
        assert (f"collectives.{kind}" in c.flags) == (raw["r2"] <= 0.9 or fit.latency == 0)
    assert c.train_step["fp16"] is None  # (timed on CUDA only)
    for d in ("fp32", "bf16"):  # the training steps: each term possible
        step = c.train_step[d]
        assert _good(step.flops) and step.flops <= c.peak_flops(d) * (1 + 1e-12)
        assert min(step.step_overhead, step.block_overhead, step.token_width,
                   step.attention_scores) >= 0
        assert _good(step.optimizer_per_param)
        assert len(c.raw["train_step"][d]["rows"]) == 8 and c.raw["train_step"][d]["r2"] <= 1
    _check_differences(c)


def _check_differences(c: Calibration) -> None:
    """Each multiple and overhead from its timings; one at most its noise is flagged (and
    one below zero, written as 0, is never silently so)."""
    raw = c.raw["data_parallel"]
    assert set(c.data_parallel) == {"ddp", "zero1", "fsdp2", "tp", "tp_sp"}
    before, after = raw["alone_seconds"]
    for engine in ("ddp", "zero1", "fsdp2"):
        timed = raw[engine]
        saved = raw["alone_optimizer_seconds"] - timed["optimizer_seconds"]  # (ddp: none)
        assert timed["exposed_seconds"] == pytest.approx(
            timed["seconds"] - (before + after) / 2 + saved)
        assert c.data_parallel[engine] == pytest.approx(
            max(0.0, timed["exposed_seconds"]) / timed["modelled_seconds"])
        if timed["exposed_seconds"] <= timed["noise_seconds"]:
            assert f"data_parallel.{engine}" in c.flags
    for engine in ("tp", "tp_sp"):  # tensor parallel: beyond the prediction of all else
        timed = raw[engine]
        beyond = timed["seconds"] - timed["predicted_without_tp"]
        assert c.data_parallel[engine] == pytest.approx(max(0.0, beyond) / timed[
            "modelled_tp_seconds"])
        if beyond <= timed["noise_seconds"]:
            assert f"data_parallel.{engine}" in c.flags
    # each pipeline schedule: seconds per micro-batch beyond the prediction
    assert set(c.pipeline) == {"gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"}
    m = c.raw["pipeline"]["shape"]["microbatches"]
    for schedule, per_micro in c.pipeline.items():
        timed = c.raw["pipeline"][schedule]
        beyond = timed["seconds"] - timed["predicted_seconds"]
        assert per_micro == pytest.approx(max(0.0, beyond) / m) and per_micro >= 0
        if beyond <= timed["noise_seconds"]:
            assert f"pipeline.{schedule}" in c.flags


def test_data_parallel_seconds_counts_each_unit_and_bucket():
    """The engines' collectives by hand: DDP one all-reduce per 25 MiB bucket (+ ZeRO-1's
    all-gather); FSDP2 per unit `gathers` all-gathers and a reduce-scatter, and an all-reduce
    across replicas."""
    from meshfit.plan.fit import data_parallel_seconds

    c = _calibration()
    calls = []

    def coll(kind, nbytes, n, span):
        calls.append((kind, nbytes, n))
        return c.collective_time(kind, nbytes, n)

    params = 20 * 2**20  # 80 MiB of fp32 gradients: 4 buckets
    ddp = data_parallel_seconds("ddp", coll, params=params, units=5, shard=1, replicate=4,
                                spans=(4, 1), gathers=2, gathered_bytes=4)
    assert calls == [("all_reduce", 20 * 2**20, 4)] * 1 and ddp == pytest.approx(
        4 * (50e-6 + 1.5 * 20 * 2**20 / 1e9))
    calls.clear()
    data_parallel_seconds("zero1", coll, params=params, units=5, shard=4, replicate=1,
                          spans=(4, 4), gathers=2, gathered_bytes=4)
    assert calls == [("all_reduce", 20 * 2**20, 4), ("all_gather", 80 * 2**20, 4)]
    calls.clear()
    fsdp = data_parallel_seconds("fsdp2", coll, params=params, units=5, shard=4, replicate=2,
                                 spans=(8, 4), gathers=3, gathered_bytes=2)
    assert calls == [("all_gather", params * 2 / 5, 4), ("reduce_scatter", params * 4 / 5, 4),
                     ("all_reduce", params * 4 / 4 / 5, 2)]
    assert fsdp == pytest.approx(
        3 * 5 * (40e-6 + 0.75 * params * 2 / 5 / 2e9) + 5 * (30e-6 + 0.75 * params * 4 / 5 / 3e9)
        + 5 * (50e-6 + 1.0 * params / 5 / 1e9))
    with pytest.raises(ValueError, match="engine='tp'"):
        data_parallel_seconds("tp", coll, params=1, units=1, shard=2, replicate=1,
                              spans=(2, 2), gathers=1, gathered_bytes=4)


def test_a_measured_exposed_share_replaces_the_assumed_overlap():
    """With a profile that timed the engines, the step is charged the modelled collectives
    x the measured share (none hidden behind compute by assumption), and the sources say so;
    without it the assumed 80% overlap stays."""
    import dataclasses

    from meshfit.memory.estimate import LayoutSpec
    from meshfit.memory.shape import ModelShape
    from meshfit.plan import DEVICES, Cluster, predict

    shape = ModelShape.of("tiny")
    spec = LayoutSpec(dp_shard=2, dp_replicate=1, zero_stage=3, micro_batch_size=4)
    plain = Cluster(gpus_per_node=2, device=DEVICES["cpu"], calibration=_calibration())
    measured = Cluster(gpus_per_node=2, device=DEVICES["cpu"], calibration=dataclasses.replace(
        _calibration(), data_parallel={"ddp": 1.5, "zero1": 2.0, "fsdp2": 3.0}))
    step0, terms0 = predict(shape, spec, plain, seq_len=64, global_batch_size=16, dtype="fp32")
    step1, terms1 = predict(shape, spec, measured, seq_len=64, global_batch_size=16,
                            dtype="fp32")
    assert terms0["dp"] == terms1["dp"] > 0
    assert terms1["dp_exposed"] == pytest.approx(3.0 * terms1["dp"])
    assert step1 - step0 == pytest.approx(3.0 * terms1["dp"] - terms0["dp_exposed"]
                                          - 0.1 * (terms0["dp"] - terms0["dp_exposed"]))
    assert "fsdp2 x3.00" in measured.sources("fp32")["collectives"]
    # a pipeline: each micro-batch charged the schedule's measured overhead; tensor parallel:
    # its all-reduces x the measured multiple
    pp = LayoutSpec(pp=2, dp_shard=1, dp_replicate=1, schedule="1f1b", microbatches=4,
                    micro_batch_size=2)
    timed = Cluster(gpus_per_node=2, device=DEVICES["cpu"], calibration=dataclasses.replace(
        _calibration(), pipeline={"gpipe": None, "1f1b": 0.01, "interleaved_1f1b": None,
                                  "zero_bubble": None}, data_parallel={"tp": 5.0}))
    _, t0 = predict(shape, pp, plain, seq_len=64, global_batch_size=16, dtype="fp32")
    _, t1 = predict(shape, pp, timed, seq_len=64, global_batch_size=16, dtype="fp32")
    assert t1["pp"] - t0["pp"] == pytest.approx(8 * 0.01)  # 16 / 2 = 8 micro-batches
    tp = LayoutSpec(tp=2, dp_shard=1, dp_replicate=1, micro_batch_size=4)
    _, t0 = predict(shape, tp, plain, seq_len=64, global_batch_size=16, dtype="fp32")
    _, t1 = predict(shape, tp, timed, seq_len=64, global_batch_size=16, dtype="fp32")
    assert t1["tp"] == pytest.approx(5.0 * t0["tp"]) and t0["tp"] > 0
    assert plain.sources("fp32")["collectives"].endswith("80% hidden behind compute (assumed)")


# ---------------------------------------------------------------------------- what is trusted
def test_each_timing_is_repeated_and_its_spread_kept(monkeypatch):
    """`_Ranks.time` on a clock the timed call advances: `repeats` repeats of as many calls
    as fill the target, their median per call, (max - min) / median as the spread, half
    that range as the noise; every timing's spread kept for the file's ``raw.noise``. A
    call that alone fills the target is not made once more than the repeats need."""
    import types

    import torch

    from meshfit.plan import probes

    clock = [0.0]
    monkeypatch.setattr(probes.time, "perf_counter", lambda: clock[0])
    env = types.SimpleNamespace(device=torch.device("cpu"), is_distributed=False)
    r = probes._Ranks(env, repeats=4)
    # a warm-up call, one call to size the loop (0.25 s: 4 calls fill 1 s), then 4 x 4
    per_call = iter([0.25, 0.25] + [0.25] * 4 + [0.25] * 4 + [0.375] * 4 + [0.125] * 4)

    def op():
        clock[0] += next(per_call)

    timed = r.time(op, target=1.0)
    assert timed.iters == 4 and timed.seconds == 0.25
    assert timed.spread == (0.375 - 0.125) / 0.25
    assert timed.noise == 0.125 and r.spreads == [timed.spread]
    assert next(per_call, None) is None  # every call made, none more
    # A call longer than the target: after the warm-up, the sizing call is the first of the
    # 4 repeats (one call each), so 5 calls in all, not 6.
    per_call = iter([2.0, 1.5] + [1.0, 2.0, 3.0])
    timed = r.time(op, target=1.0)
    assert timed.iters == 1 and timed.seconds == 1.75  # the median of 1.5, 1, 2, 3
    assert next(per_call, None) is None


def _judged(change=lambda d: None) -> dict:
    d = _full_file_dict()
    del d["flags"]
    change(d)
    return judge(d)


def test_what_cannot_be_told_from_noise_is_flagged():
    """The class "a figure that explains nothing is used": a fit with R² at most 0.9 or a
    latency refitted to 0, a difference (an engine's exposed seconds, tensor parallel's or a
    schedule's seconds beyond the prediction) at most the noise of its timings -- below 0
    or clamped to 0 in an older file included --, each flagged with its reason, and the
    figures measured against a flagged one with it; a machine whose repeats spread by more
    than 25% flags everything ("machine"). A figure not measured (null) is not flagged."""
    assert _judged() == {}
    flags = _judged(lambda d: d["raw"]["collectives"]["all_gather"].update(r2=0.9))
    assert flags == {"collectives.all_gather": "its fit explains little of the times (R² 0.90 "
                                               "<= 0.9)",
                     "data_parallel.zero1": "measured against collectives.all_gather, which "
                                            "is not used",
                     "data_parallel.fsdp2": "measured against collectives.all_gather, which "
                                            "is not used"}
    flags = _judged(lambda d: d["collectives"]["send_recv"].update(latency=0.0))
    assert flags["collectives.send_recv"].startswith("its latency came out negative and was "
                                                     "set to 0")
    assert set(flags) == {"collectives.send_recv"} | {f"pipeline.{s}" for s in PP_SCHEDULES}
    flags = _judged(lambda d: d["raw"]["train_step"]["fp32"].update(r2=-343.0))
    assert flags["train_step.fp32"] == ("its fit explains little of the step times (R² "
                                        "-343.00 <= 0.9)")
    assert set(flags) == {"train_step.fp32", "data_parallel.tp", "data_parallel.tp_sp",
                          *(f"pipeline.{s}" for s in PP_SCHEDULES)}
    for exposed, words in ((0.01, "+10.00 ms, within the timings' spread (±10.00 ms)"),
                           (-0.003, "-3.00 ms, none (the figure is 0, clamped)")):
        flags = _judged(lambda d: d["raw"]["data_parallel"]["ddp"].update(
            exposed_seconds=exposed))
        assert set(flags) == {"data_parallel.ddp"} and words in flags["data_parallel.ddp"]
    # a file written before the noise was recorded: DDP "x0.00", its exposed time clamped
    flags = _judged(lambda d: d["raw"]["data_parallel"].update(
        ddp={"exposed_seconds": 0.0}) or d["data_parallel"].update(ddp=0.0))
    assert set(flags) == {"data_parallel.ddp"}
    flags = _judged(lambda d: d["raw"]["pipeline"]["1f1b"].update(seconds=0.105))
    assert set(flags) == {"pipeline.1f1b"} and "+5.00 ms, within" in flags["pipeline.1f1b"]
    flags = _judged(lambda d: d["raw"]["data_parallel"]["tp"].update(seconds=0.05))
    assert set(flags) == {"data_parallel.tp"}
    assert set(_judged(lambda d: d["raw"]["noise"].update(median_spread=0.26))) == {"machine"}
    # not measured (null): nothing to flag, whatever its raw rows say
    assert _judged(lambda d: d["data_parallel"].update(ddp=None) or d["raw"][
        "data_parallel"]["ddp"].update(exposed_seconds=-1.0)) == {}


def test_flagged_figures_are_not_used_and_the_plan_says_which(tmp_path, capsys):
    """With flags, the planner predicts as without those figures (the link table's
    collective, the assumed overlap, no schedule overhead, the matmul without the step fit),
    names them and why ("not used from --profile"), and uses the rest; "machine": the whole
    profile is not used, as if none was given."""
    from meshfit.cli.main import main
    from meshfit.memory.estimate import LayoutSpec
    from meshfit.memory.shape import ModelShape
    from meshfit.plan import DEVICES, INTERCONNECTS, Cluster, predict

    d = _full_file_dict()
    d["flags"] = {"collectives.all_reduce": "R² 0.41", "train_step.fp32": "R² 0.1",
                  "data_parallel.ddp": "noise"}
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(d))
    c = load_calibration(path)
    cluster = Cluster(gpus_per_node=2, device=DEVICES["cpu"], calibration=c)
    link = INTERCONNECTS["loopback"]
    assert cluster.collective("all_reduce", 1e6, 2, 2) == link.latency + 1e6 / link.bandwidth
    assert cluster.collective("all_gather", 1e6, 2, 2) == c.collective_time("all_gather", 1e6, 2)
    assert cluster.step_fit("fp32") is None and cluster.step_fit("bf16") is not None
    assert cluster.dp_exposed("ddp") is None and cluster.dp_exposed("fsdp2") == 3.0
    assert cluster.flops("fp32") == 1e11  # the measured matmul instead of the step fit
    s = cluster.sources("fp32")
    assert s["not_used"] == ("collectives.all_reduce: R² 0.41; train_step.fp32: R² 0.1; "
                             "data_parallel.ddp: noise")
    assert s["compute"].startswith("measured matmul") and "fit is flagged" in s["compute"]
    assert s["collectives"].startswith("measured all_gather, reduce_scatter, all_to_all, "
                                       "send_recv (profile), the others from the link table")
    assert "ddp x" not in s["collectives"] and "fsdp2 x3.00" in s["collectives"]
    # the whole profile flagged: predictions as with no profile
    d["flags"] = {"machine": "too noisy to measure: ..."}
    path.write_text(json.dumps(d))
    noisy = Cluster(gpus_per_node=2, device=DEVICES["cpu"], calibration=load_calibration(path))
    table = Cluster(gpus_per_node=2, device=DEVICES["cpu"])
    shape = ModelShape.of("tiny")
    for spec in (LayoutSpec(dp_replicate=2), LayoutSpec(pp=2, microbatches=4),
                 LayoutSpec(dp_shard=2, zero_stage=3)):
        assert predict(shape, spec, noisy, seq_len=64, global_batch_size=8, dtype="fp32") == \
            predict(shape, spec, table, seq_len=64, global_batch_size=8, dtype="fp32")
    assert noisy.sources("fp32")["not_used"].startswith("the whole profile: this machine was "
                                                        "too noisy")
    assert main(["plan", "tiny", "--gpus-per-node", "2", "--gpu", "cpu", "--dtype", "fp32",
                 "--seq-len", "64", "--profile", str(path), "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert f"not used from --profile {path} (calibrate flagged them; the assumed figures " \
           "instead): the whole profile: this machine was too noisy" in out
    assert "(assumed efficiency)" in out and "profile" not in out.split("not used")[0]
