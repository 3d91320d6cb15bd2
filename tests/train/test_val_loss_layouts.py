"""The logged losses do not depend on the layout: `meshfit train` under one process, DDP,
ZeRO-1/2/3, tp, pp, ep and their products logs the same training losses and the same
`val_loss`, and `meshfit eval RUN` gives that `val_loss` back.

The validation set is 21 windows (train.eval_batches=7 x micro_batch_size=3), a number no
layout divides: every rank evaluates its share of them exactly once, the ranks with fewer
windows run batches of ignored targets (FSDP's all-gathers and a pipeline's sends are
collectives), and a pipeline sees all 21. Before, the set itself depended on the layout
(eval_batches micro-batches per rank) and padding counted: this test's DDP run logged 4.94635
against one process's 4.95135.

Tolerance: fp32, the trainer's dtype. The layouts sum in other orders (~1e-7 relative per
operation); over 3 AdamW steps the logged losses stay within 1e-4 relative of each other,
as `test_train_parallel.py` states (measured here: every layout equal to one process in all
5 logged decimals); a window counted twice or dropped moves the mean of 21 windows by
~1/21 of a window's deviation, 1e-3 relative here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from conftest import make_subprocess_env

MESHFIT = [sys.executable, "-m", "meshfit"]
BASE = ["--train.steps=3", "--train.eval_every=0", "--train.log_every=1",
        "--train.global_batch_size=12", "--train.micro_batch_size=3", "--train.seq_len=32",
        "--train.eval_batches=7", "--train.warmup_steps=1", "--model.dropout=0.0",
        "--model.n_layer=4", "--model.d_model=64", "--model.d_ff=128"]
RTOL = 1e-4  # see the module docstring
DENSE = {  # name: (processes, options)
    "ddp": (2, []),
    "zero1": (2, ["--parallel.dp_shard=2", "--parallel.zero_stage=1"]),
    "zero2": (2, ["--parallel.dp_shard=2", "--parallel.zero_stage=2"]),
    "zero3": (2, ["--parallel.dp_shard=2", "--parallel.zero_stage=3"]),
    "tp2": (2, ["--parallel.tp=2"]),
    "pp2": (2, ["--parallel.pp=2", "--parallel.microbatches=2"]),
    "ddp2xtp2": (4, ["--parallel.tp=2"]),
    "zero1xpp2": (4, ["--parallel.pp=2", "--parallel.dp_shard=2", "--parallel.zero_stage=1",
                      "--parallel.microbatches=2"]),
    "tp2xpp2": (4, ["--parallel.pp=2", "--parallel.tp=2", "--parallel.microbatches=2"]),
}
MOE = {
    "ep2": (2, ["--parallel.dp_shard=2", "--parallel.ep=2", "--parallel.zero_stage=1"]),
    "ep2xpp2": (4, ["--parallel.pp=2", "--parallel.dp_shard=2", "--parallel.ep=2",
                    "--parallel.zero_stage=1", "--parallel.microbatches=2"]),
}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, dict]:
    """A corpus of 200 standard-library files and the environment the runs share."""
    root = tmp_path_factory.mktemp("val")
    corpus = root / "corpus"
    corpus.mkdir()
    for i, f in enumerate(sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:200]):
        (corpus / f"{i:03d}.txt").write_text(f.read_text(errors="ignore"))
    return root, make_subprocess_env(root)


def _run(data, name: str, nproc: int, args: list[str]) -> tuple[list[float], float, Path]:
    root, env = data
    out = root / name
    proc = subprocess.run([*MESHFIT, "train", "--nproc", str(nproc), "--out", str(out), *BASE,
                           f"--data.path={root / 'corpus'}",
                           f"--data.cache_dir={root / 'cache'}", *args],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [line["loss"] for line in lines if "loss" in line]
    return losses, [line["val_loss"] for line in lines if "val_loss" in line][-1], out


def _same(got, want, name):
    losses, val, _ = got
    assert losses == pytest.approx(want[0], rel=RTOL), name
    assert val == pytest.approx(want[1], rel=RTOL), name


@pytest.mark.parametrize("family, layouts", [("dense", DENSE), ("moe", MOE)])
def test_every_layout_logs_the_one_process_losses(data, family, layouts):
    model = ["--model.preset=moe-tiny"] if family == "moe" else []
    one = _run(data, f"{family}-one", 1, model)
    assert len(one[0]) == 3
    for name, (nproc, args) in layouts.items():
        _same(_run(data, f"{family}-{name}", nproc, [*model, *args]), one, name)
    if family == "dense":
        # `meshfit eval RUN` evaluates the run's own validation windows by default
        proc = subprocess.run([*MESHFIT, "eval", str(data[0] / "dense-zero3")], env=data[1],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert float(proc.stdout.split()[1]) == pytest.approx(one[1], rel=RTOL)
        assert proc.stdout.rstrip().endswith(f"on {21 * 32} tokens")
