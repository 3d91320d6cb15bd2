"""`meshfit plot` (`meshfit.charts.plot`), in this process (fast: no training, synthetic run
folders)."""

from __future__ import annotations

import json
import struct

import pytest

from meshfit.cli.main import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, "not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _run(folder, *, lr, batch=8, seq_len=32, steps=20, memory=True, val_every=5):
    folder.mkdir(parents=True)
    (folder / "config.toml").write_text(
        f"[train]\nsteps = {steps}\nglobal_batch_size = {batch}\nseq_len = {seq_len}\n"
        f"[optim]\nlr = {lr}\n")
    lines = [{"step": 0, "val_loss": 5.5}]
    for step in range(1, steps + 1):
        record = {"step": step, "loss": 5.5 - step * lr * 10, "lr": lr,
                  "tokens_per_s": 1000.0 + step, "step_time_s": 0.2}
        if memory:
            record["peak_memory_bytes"] = (1 << 28) + step * 4096
            record["peak_memory_bytes_per_rank"] = [record["peak_memory_bytes"]] * 2
        lines.append(record)
        if step % val_every == 0:
            lines.append({"step": step, "val_loss": 5.6 - step * lr * 10})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return folder


matplotlib = pytest.importorskip("matplotlib")


def test_plot_two_runs_overlaid(tmp_path, capsys):
    from meshfit.charts.plot import DPI, FIGSIZE

    a = _run(tmp_path / "lr-3e-3", lr=3e-3)
    b = _run(tmp_path / "lr-1e-3", lr=1e-3, batch=16, memory=False)  # no memory field
    out = tmp_path / "plots" / "both.png"
    assert main(["plot", str(a), str(b), "-o", str(out)]) == 0
    assert _png_size(out) == (int(FIGSIZE[0] * DPI), int(FIGSIZE[1] * DPI)) == (1200, 800)
    lines = capsys.readouterr().out.splitlines()
    # tokens = step x global batch x seq_len, per run
    assert lines[0] == ("lr-3e-3: 20 logged steps to step 20 (5.12k tokens), loss 4.9000, "
                        "best val_loss 5.0000 at step 20, median 1.01k tokens/s, "
                        "peak memory 0.25 GiB")
    assert lines[1].startswith("lr-1e-3: 20 logged steps to step 20 (10.2k tokens)")
    assert "peak memory" not in lines[1]
    assert lines[2] == f"meshfit plot: wrote {out}"


def test_plot_reads_what_it_draws(tmp_path, monkeypatch):
    from meshfit.charts.plot import draw, read_run

    monkeypatch.chdir(tmp_path)  # where the default output of several runs goes

    a = _run(tmp_path / "x" / "run", lr=3e-3)
    b = _run(tmp_path / "y" / "run", lr=1e-3)
    with open(a / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 21, "lo')  # a run still writing: its partial last line is skipped
    run = read_run(a)
    assert run.tokens_per_step == 8 * 32 and run.memory_key == "peak_memory_bytes"
    assert [r["step"] for r in run.evals] == [0, 5, 10, 15, 20] and len(run.steps) == 20
    png, runs = draw([a, b])  # default output for several runs: here
    assert [r.label for r in runs] == ["x/run", "y/run"]  # same folder name: told apart
    assert png.resolve() == tmp_path / "meshfit-plot.png" and _png_size(png) == (1200, 800)
    png, _ = draw([a])
    assert png == a / "metrics.png" and _png_size(png) == (1200, 800)


@pytest.mark.parametrize("setup,match", [
    (lambda d: None, "run folder '{d}' does not exist"),
    (lambda d: d.mkdir(), "{d}/metrics.jsonl does not exist"),
    (lambda d: (d.mkdir(), (d / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')),
     "{d}/config.toml does not exist"),
    (lambda d: (_run(d, lr=1e-3), (d / "config.toml").write_text("[train]\nseq_len = 8\n")),
     "[train] global_batch_size = None"),
    (lambda d: (_run(d, lr=1e-3), (d / "metrics.jsonl").write_text('{"step": 1}\nxx\n{}\n')),
     "metrics.jsonl line 2 is not JSON"),
    (lambda d: (_run(d, lr=1e-3), (d / "metrics.jsonl").write_text("")),
     "holds no logged step or evaluation yet"),
])
def test_plot_refusals_are_one_line(setup, match, tmp_path, capsys):
    d = tmp_path / "run"
    setup(d)
    assert main(["plot", str(d), "-o", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("meshfit plot: error: "), err
    assert match.format(d=d) in err[0], err[0]
    assert not (tmp_path / "p.png").exists()


def test_plot_output_name_and_missing_matplotlib(tmp_path, capsys, monkeypatch):
    import builtins

    a = _run(tmp_path / "a", lr=1e-3)
    assert main(["plot", str(a), "-o", str(tmp_path / "p.jpeg")]) == 2
    assert "must end in .png, .pdf, .svg" in capsys.readouterr().err
    real = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert main(["plot", str(a)]) == 2
    assert capsys.readouterr().err.strip() == \
        'meshfit plot: error: meshfit plot needs matplotlib; pip install "meshfit[chart]"'
