"""`meshfit pipeline-chart`: run files, the Gantt chart and its bubble figures.

One spawn (pp=2, gloo, CPU) records real 1F1B and interleaved-1F1B timings; the rest uses a
hand-made GPipe timing set whose idle time is known exactly.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from conftest import run_distributed
from reference import idle_share
from meshfit.charts.pipeline import draw
from meshfit.cli.main import main
from meshfit.models import GPT, GPTConfig
from meshfit.parallel import pp
from meshfit.train.pipeline_record import read_run, write_run

matplotlib_image = pytest.importorskip("matplotlib.image")

CFG = dataclasses.replace(GPTConfig.preset("tiny"), n_layer=4, d_model=32, n_head=4, d_ff=64,
                          max_seq_len=16)
P, M, STEPS = 2, 4, 2
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _record(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("pp",))
    x, y = torch.randint(0, CFG.vocab_size, (2, 8, 16), generator=torch.Generator().manual_seed(1))
    out = {}
    for schedule in ("1f1b", "interleaved_1f1b"):
        torch.manual_seed(0)  # the same full model on both ranks
        pipe = pp.build_pipeline(GPT(CFG), mesh, schedule=schedule, microbatches=M)
        for _ in range(STEPS):
            pipe.step(x, y)
        out[schedule] = (pipe.meta(), pp.gather_timings(pipe))
    return out


@pytest.fixture(scope="module")
def recorded():
    return run_distributed(_record, P)[0]


def _check_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    image = matplotlib_image.imread(path)
    assert image.shape[0] > 0 and image.shape[1] > 0


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("interleaved_1f1b", 2)])
def test_real_pipeline_chart(recorded, tmp_path, schedule, v):
    meta, timings = recorded[schedule]
    assert meta == {"schedule": schedule, "pp": P, "microbatches": M, "virtual_stages": v,
                    "num_stages": P * v, "points": [2] if v == 1 else [1, 2, 3],
                    "placement": [[0], [1]] if v == 1 else [[0, 2], [1, 3]]}
    write_run(tmp_path, meta, timings)
    assert read_run(tmp_path) == (meta, timings)  # floats survive JSON exactly (repr)
    png, summary = draw(tmp_path)
    assert png == tmp_path / "pipeline_chart.png"
    _check_png(png)
    assert summary["step"] == STEPS - 1  # the last recorded step by default
    assert summary["steps_measured"] == [1]  # step 0 also infers shapes: left out
    theory = (P - 1) / (v * M)  # Megatron-LM: (p-1)/m, (p-1)/(v m) interleaved
    assert summary["theoretical_bubble_ratio"] == pytest.approx(theory, rel=1e-12)
    assert summary["theoretical_bubble_fraction"] == pytest.approx(theory / (1 + theory))
    later = [t for t in timings if t["step"] != 0]
    assert summary["measured_bubble_fraction"] == pytest.approx(pp.bubble_fraction(later))
    assert summary["measured_bubble_fraction"] == pytest.approx(idle_share(later))
    f = summary["measured_bubble_fraction"]  # the two definitions: r = f/(1-f)
    assert summary["measured_bubble_ratio"] == pytest.approx(f / (1 - f))
    png0, summary0 = draw(tmp_path, tmp_path / "sub" / "step0.png", step=0)
    _check_png(png0)
    assert summary0["step"] == 0 and summary0["steps_measured"] == [1]


# ---------------------------------------------------------------------------- exact case
def _gpipe_meta(**kw):
    return {"schedule": "gpipe", "pp": 2, "microbatches": 2, "virtual_stages": 1,
            "num_stages": 2, "points": [2], "placement": [[0], [1]], **kw}


def _gpipe_step(step, t0):
    """GPipe on 2 ranks, 2 micro-batches, every box 1 s: each rank is busy 4 of the step's
    6 s, so idle/busy = 4/8 = (p-1)/m and the idle share = 4/12 (all exact in binary)."""
    boxes = [(0, 0, "forward", 0), (0, 1, "forward", 1), (1, 0, "forward", 1),
             (1, 1, "forward", 2), (1, 0, "backward", 3), (1, 1, "backward", 4),
             (0, 0, "backward", 4), (0, 1, "backward", 5)]
    return [dict(step=step, rank=r, stage=r, microbatch=mb, phase=ph, start=t0 + s,
                 end=t0 + s + 1.0) for r, mb, ph, s in boxes]


@pytest.fixture
def gpipe_run(tmp_path):
    # Step 0 stands for the setup step: twice as slow on rank 1, left out of the measurement.
    first = [dict(t, end=t["start"] + 2.0) if t["rank"] == 1 else t
             for t in _gpipe_step(0, 1000.0)]
    write_run(tmp_path / "run", _gpipe_meta(), first + _gpipe_step(1, 1016.0))
    return tmp_path / "run"


def test_exact_bubble(gpipe_run):
    png, s = draw(gpipe_run)
    _check_png(png)
    assert s["measured_bubble_ratio"] == 0.5 == s["theoretical_bubble_ratio"]
    assert s["measured_bubble_fraction"] == 1 / 3 == s["theoretical_bubble_fraction"]
    assert s["steps_measured"] == [1] and s["step"] == 1
    assert (s["schedule"], s["pp"], s["microbatches"], s["virtual_stages"]) == ("gpipe", 2, 2, 1)
    # One step only: it is measured, setup included.
    write_run(gpipe_run.parent / "one", _gpipe_meta(), _gpipe_step(0, 0.0))
    _, s = draw(gpipe_run.parent / "one")
    assert s["steps_measured"] == [0] and s["measured_bubble_ratio"] == 0.5


# ---------------------------------------------------------------------------- bad input
def _one_line_error(match, fn, *args, **kw):
    with pytest.raises(ValueError, match=match) as err:
        fn(*args, **kw)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_bad_input(tmp_path, gpipe_run):
    _one_line_error(r"nowhere' does not exist; pass the folder", read_run, tmp_path / "nowhere")
    plain = tmp_path / "plain"
    plain.mkdir()
    msg = _one_line_error("pipeline.json not found", read_run, plain)
    assert "not pipeline-parallel" in msg and "[parallel] pp > 1" in msg
    lines = (gpipe_run / "pipeline_timings.jsonl").read_text().splitlines()
    lines[2] = lines[2][:-5]
    (gpipe_run / "pipeline_timings.jsonl").write_text("\n".join(lines) + "\n")
    _one_line_error(r"pipeline_timings.jsonl line 3 is not valid JSON", read_run, gpipe_run)
    lines[2] = json.dumps({**json.loads(lines[3]), "phase": "sideways"})
    (gpipe_run / "pipeline_timings.jsonl").write_text("\n".join(lines) + "\n")
    _one_line_error(r"pipeline_timings.jsonl line 3: phase='sideways' is not one of",
                    read_run, gpipe_run)
    (gpipe_run / "pipeline.json").write_text("{")
    _one_line_error(r"pipeline.json is not valid JSON", read_run, gpipe_run)
    (gpipe_run / "pipeline.json").write_text(json.dumps(_gpipe_meta(num_stages=3)))
    _one_line_error(r"pipeline.json: num_stages=3 must equal pp x virtual_stages = 2",
                    read_run, gpipe_run)
    no_points = {k: v for k, v in _gpipe_meta(pipes=1).items() if k != "points"}
    _one_line_error(r"meta: missing keys \['points'\], unknown keys \['pipes'\]", write_run,
                    tmp_path / "w", no_points, [])
    _one_line_error(r"timings: rank=2 stage=0 does not match the placement", write_run,
                    tmp_path / "w", _gpipe_meta(), [dict(_gpipe_step(0, 0.0)[0], rank=2)])
    assert not (tmp_path / "w" / "pipeline.json").exists()  # validated before writing


def test_bad_step_and_missing_matplotlib(gpipe_run, monkeypatch):
    _one_line_error(r"step=7 is not in .*pipeline_timings.jsonl; recorded steps: 0, 1", draw,
                    gpipe_run, step=7)
    for name in ("matplotlib", "matplotlib.figure"):  # as if not installed
        monkeypatch.setitem(sys.modules, name, None)
    _one_line_error(r'needs matplotlib; pip install "meshfit\[chart\]"', draw, gpipe_run)


# ---------------------------------------------------------------------------- the command
def test_cli(gpipe_run, tmp_path, capsys):
    assert main(["pipeline-chart", str(gpipe_run)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("measured bubble (step 1; step 0 left out: shape inference")
    assert "idle/busy = 0.500, idle share of the step = 33.3%" in out[0]
    assert out[1].startswith("theoretical bubble of gpipe, (p-1)/m = 1/2: idle/busy = "
                             "0.500, idle share r/(1+r) = 33.3%")
    assert out[2] == f"chart of step 1: {gpipe_run / 'pipeline_chart.png'}"
    _check_png(gpipe_run / "pipeline_chart.png")
    assert main(["pipeline-chart", str(gpipe_run), "--step", "0", "--out",
                 str(tmp_path / "c.png")]) == 0
    assert capsys.readouterr().out.splitlines()[2] == f"chart of step 0: {tmp_path / 'c.png'}"
    assert main(["pipeline-chart", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshfit pipeline-chart: error: run folder") and err.count("\n") == 1
