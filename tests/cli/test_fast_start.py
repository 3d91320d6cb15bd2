"""A bad argument is refused before torch is imported: `meshfit train` and `meshfit launch`
answer a wrong flag, override, config value or TOML file in a fraction of a second instead of
after the several seconds torch takes to load.

One fresh interpreter runs every case in a row (this test process has imported torch long
ago) and reports, after each, its exit code, its stderr line and whether `torch` is in
`sys.modules`. Starting a run is replaced by a function that fails, so an accepted input
starts nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

CASES = [  # (argv, a substring of the error line); {t}: a folder of the test's
    (["train", "--train.steps=0"], "train.steps=0"),
    (["train", "--model.n_layer=0"], "model.n_layer=0"),
    (["train", "--model.attention_backend=fastest"], "model.attention_backend='fastest'"),
    (["train", "--optim.optimizer=lion"], "optim.optimizer='lion'"),
    (["train", "--train.activation_checkpointing=all"], "train.activation_checkpointing='all'"),
    (["train", "--train.compile_scope=layer"], "train.compile_scope='layer'"),
    (["train", "--train.mixed_precision=fp8"], "train.mixed_precision='fp8'"),
    (["train", "--parallel.schedule=zigzag"], "parallel.schedule='zigzag'"),
    (["train", "--parallel.zero_stage=4"], "parallel.zero_stage=4"),
    (["train", "--nproc", "2", "--parallel.dp_shard=3"], "dp_shard"),  # needs the world size
    (["train", "--data.num_workers=-1"], "data.num_workers=-1"),
    (["train", "--log.with=nosuchtracker"], "nosuchtracker"),
    (["train", "--model.factory=no_such_module_xyz:build"], "no_such_module_xyz"),
    (["train", "--train.steps"], "--train.steps"),  # an override without a value
    (["train", "--bogus"], "--bogus"),
    (["train", "--config", "{t}/bad.toml"], "not valid TOML"),
    (["train", "--config", "{t}/unknown.toml"], "unknown config section(s) trainer"),
    (["train", "--nproc", "0"], "--nproc=0"),
    (["launch", "--nproc", "-3", "{t}/script.py"], "--nproc=-3"),
    (["launch", "--master-port", "70000", "{t}/script.py"], "--master-port=70000"),
    (["launch", "{t}/no_script.py"], "no_script.py"),
    (["generate", "{t}", "--prompt", ""], "--prompt=''"),
    (["generate", "{t}"], "--prompt"),  # argparse: a required option missing
    (["eval", "{t}", "--batch-size", "0"], "--batch-size=0"),
    (["eval", "{t}", "--batches", "x"], "'x'"),
    (["export"], "CKPT_OR_RUN"),
    (["estimate", "gpt2", "--world-size", "0"], "--world-size=0"),
    (["estimate", "gpt2", "--layout", "tp=x"], "tp='x'"),
]

_RUNNER = textwrap.dedent("""
    import contextlib, io, json, sys

    import meshfit.cli.main as cli
    from meshfit import launch
    from meshfit.train import runfolder

    def started(*args, **kwargs):
        raise AssertionError("the input was accepted: a run would have started")

    launch.run = runfolder.RunLock = started
    for argv in json.loads(sys.argv[1]):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = cli.main(argv)
        print(json.dumps({"argv": argv, "rc": rc, "err": err.getvalue(),
                          "torch": "torch" in sys.modules}), flush=True)
""")


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "bad.toml").write_text("[train\nsteps = 3\n")
    (tmp_path / "unknown.toml").write_text("[trainer]\nsteps = 3\n")
    (tmp_path / "script.py").write_text("raise SystemExit('the script ran')\n")
    return tmp_path


def test_refusals_import_no_torch(folder):
    argvs = []
    for argv, _ in CASES:
        argv = [a.format(t=folder) for a in argv]
        if argv[0] == "train":
            argv = ["train", "--out", str(folder / "run"), *argv[1:]]
        argvs.append(argv)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                        "MASTER_ADDR", "MASTER_PORT") and not k.startswith("SLURM_")}
    env["MESHFIT_CPU"] = "1"
    # A bound for a hung interpreter only: these cases take about a second in all.
    proc = subprocess.run([sys.executable, "-c", _RUNNER, json.dumps(argvs)], cwd=folder,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(results) == len(CASES)
    for (_, wanted), result in zip(CASES, results):
        lines = result["err"].strip().splitlines()
        assert result["rc"] == 2, result
        assert len(lines) == 1 and f"meshfit {result['argv'][0]}: error: " in lines[0], result
        assert wanted in lines[0], result
        assert not result["torch"], f"{result['argv']} imported torch before its refusal"
    assert sorted(p.name for p in folder.iterdir()) == ["bad.toml", "script.py",
                                                        "unknown.toml"]  # no run folder
