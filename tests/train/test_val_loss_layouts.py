"""The logged losses do not depend on the layout: `meshfit train` under one process, DDP,
ZeRO-1/2/3, tp, pp, ep, cp (context parallel), their products, and the optimizer state on
disk (offload = "disk") logs the same training losses and the same
`val_loss`, and `meshfit eval RUN` gives that `val_loss` back. The trainer runs in-process
on the ranks of one spawn per world size (what `meshfit train --nproc N` runs on each
worker), every layout of that size one after another.

The validation set is 21 windows (train.eval_windows=21), a number no layout divides and
no micro-batch of 3 or 4: every rank evaluates its share of them exactly once, the ranks with
fewer windows run batches of ignored targets (FSDP's all-gathers and a pipeline's sends are
collectives), and a pipeline sees all 21. Before, the set itself depended on the layout
(eval_batches micro-batches per rank) and padding counted: this test's DDP run logged 4.94635
against one process's 4.95135; and then on the micro-batch (eval_batches x micro_batch_size
windows): the same weights evaluated with micro-batches of 4 rather than 3 logged another
val_loss (`test_the_micro_batch_does_not_change_the_validation_set`).

Tolerance: fp32, the trainer's dtype. The layouts sum in other orders (~1e-7 relative per
operation); over 3 AdamW steps the logged losses stay within 1e-4 relative of each other,
as `test_train_parallel.py` states (measured here: every layout equal to one process in all
5 logged decimals); a window counted twice or dropped moves the mean of 21 windows by
~1/21 of a window's deviation, 1e-3 relative here.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

from conftest import case_result, run_cases

BASE = {"train": {"steps": 3, "eval_every": 0, "log_every": 1, "global_batch_size": 12,
                  "micro_batch_size": 3, "seq_len": 32, "eval_windows": 21, "warmup_steps": 1},
        "model": {"dropout": 0.0, "n_layer": 4, "d_model": 64, "d_ff": 128}}
RTOL = 1e-4  # see the module docstring
LAYOUTS = {  # name: (processes, [parallel] settings)
    "ddp": (2, {}),
    "zero1": (2, {"dp_shard": 2, "zero_stage": 1}),
    "zero2": (2, {"dp_shard": 2, "zero_stage": 2}),
    "zero3": (2, {"dp_shard": 2, "zero_stage": 3}),
    "tp2": (2, {"tp": 2}),
    "pp2": (2, {"pp": 2, "microbatches": 2}),
    "ddp2xtp2": (4, {"tp": 2}),
    "zero1xpp2": (4, {"pp": 2, "dp_shard": 2, "zero_stage": 1, "microbatches": 2}),
    "tp2xpp2": (4, {"pp": 2, "tp": 2, "microbatches": 2}),
    "cp2": (2, {"cp": 2, "dp_replicate": 1}),
    "cp2-contiguous-zero3": (2, {"cp": 2, "dp_replicate": 1, "zero_stage": 3,
                                 "cp_load_balance": False}),
    "cp2xdp2": (4, {"cp": 2, "dp_replicate": 2}),
    "cp2xtp2-sp": (4, {"cp": 2, "tp": 2, "dp_replicate": 1, "zero_stage": 1,
                       "sequence_parallel": True}),
    "cp2xpp2": (4, {"cp": 2, "pp": 2, "dp_replicate": 1, "zero_stage": 1, "microbatches": 2}),
    "ddp-disk": (2, {"offload": "disk"}),
    "zero1-disk": (2, {"dp_shard": 2, "zero_stage": 1, "offload": "disk"}),
    "zero3-disk": (2, {"dp_shard": 2, "zero_stage": 3, "offload": "disk"}),
    "zero3-disk-params": (2, {"dp_shard": 2, "zero_stage": 3, "offload": "disk",
                              "offload_params": True}),
    "moe-ep2": (2, {"dp_shard": 2, "ep": 2, "zero_stage": 1}),
    "moe-ep2xpp2": (4, {"pp": 2, "dp_shard": 2, "ep": 2, "zero_stage": 1, "microbatches": 2}),
    "moe-cp2": (2, {"cp": 2, "dp_replicate": 1}),
}


def _config(root: Path, name: str):
    from meshfit.train.configfile import build_config

    parallel = dict(LAYOUTS[name][1]) if name in LAYOUTS else {}
    if parallel.get("offload") == "disk":  # the optimizer state in files, streamed
        parallel["offload_dir"] = str(root / f"{name}-offload")
    model = {**BASE["model"], **({"preset": "moe-tiny"} if name.startswith("moe") else {})}
    train = {**BASE["train"], **({"micro_batch_size": 4} if name == "dense-micro4" else {})}
    return build_config({**BASE, "train": train, "model": model, "parallel": parallel,
                         "data": {"path": str(root / "corpus"),
                                  "cache_dir": str(root / "cache")}})


def _train(rank, world_size, root: Path, name: str):
    from meshfit.distributed import init
    from meshfit.train.trainer import train

    train(_config(root, name), root / name, init())


def _logged(root: Path, name: str) -> tuple[list[float], float]:
    lines = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
    return ([line["loss"] for line in lines if "loss" in line],
            [line["val_loss"] for line in lines if "val_loss" in line][-1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict]:
    """A corpus of 200 standard-library files; every layout trained on it, each world size
    in one spawn, and the one-process runs here."""
    from meshfit.distributed import init
    from meshfit.train.trainer import train

    root = tmp_path_factory.mktemp("val")
    corpus = root / "corpus"
    corpus.mkdir()
    for i, f in enumerate(sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:200]):
        (corpus / f"{i:03d}.txt").write_text(f.read_text(errors="ignore"))
    for name in ("dense-one", "moe-one", "dense-micro4"):
        train(_config(root, name), root / name, init())
    results = {}
    for nproc in (2, 4):
        results.update(run_cases({name: (_train, root, name) for name, (n, _) in
                                  LAYOUTS.items() if n == nproc}, nproc, timeout=400))
    return root, results


@pytest.mark.parametrize("name", LAYOUTS)
def test_every_layout_logs_the_one_process_losses(runs, name):
    root, results = runs
    case_result(results, name)
    losses, val = _logged(root, name)
    one_losses, one_val = _logged(root, "moe-one" if name.startswith("moe") else "dense-one")
    assert len(one_losses) == 3
    assert losses == pytest.approx(one_losses, rel=RTOL)
    assert val == pytest.approx(one_val, rel=RTOL)
    if LAYOUTS[name][1].get("offload") == "disk":  # the ranks' state folders: gone at the end
        assert (root / f"{name}-offload").is_dir()
        assert not list((root / f"{name}-offload").iterdir())


def test_the_micro_batch_does_not_change_the_validation_set(runs):
    """One process, micro-batches of 4 instead of 3 (the same global batch of 12): the
    validation set is the same 21 windows, so the first evaluation (step 0: the same weights,
    from the seed) gives the same val_loss, and the last one that of the same training (the
    steps differ in the order of sums only). Before, 4 x 7 = 28 windows against 21."""
    root, _ = runs
    vals = {}
    for name in ("dense-one", "dense-micro4"):
        lines = [json.loads(x) for x in (root / name / "metrics.jsonl").read_text().splitlines()]
        vals[name] = [x["val_loss"] for x in lines if "val_loss" in x]
    # (logged to 5 decimals: the sums' other order may round one way or the other)
    assert vals["dense-micro4"][0] == pytest.approx(vals["dense-one"][0], abs=1.01e-5)
    assert vals["dense-micro4"][-1] == pytest.approx(vals["dense-one"][-1], rel=RTOL)


def test_older_configs_keep_their_validation_set():
    """[train] eval_batches = N (older configs, and every config.toml written before
    eval_windows) reads as the N x micro_batch_size windows it meant; with eval_windows too it
    is refused in one line."""
    from meshfit.train.configfile import build_config, load_config

    old = load_config(None, ["--train.eval_batches=7", "--train.micro_batch_size=3",
                             "--train.global_batch_size=12"])
    assert old.eval_windows() == 21 and old.train.eval_batches == 7
    assert build_config({"train": {"eval_batches": 8}}).eval_windows() == 8 * 16
    with pytest.raises(ValueError, match=r"^train.eval_batches=2 and train.eval_windows=9 both "
                                         r"set the validation set; keep train.eval_windows"):
        load_config(None, ["--train.eval_batches=2", "--train.eval_windows=9"])


def test_eval_of_a_run_gives_its_val_loss(runs, capsys):
    """`meshfit eval RUN` evaluates the run's own validation windows by default."""
    from meshfit.cli.main import main

    root, results = runs
    case_result(results, "zero3")
    capsys.readouterr()
    assert main(["eval", str(root / "zero3")]) == 0
    out = capsys.readouterr().out
    assert float(out.split()[1]) == pytest.approx(_logged(root, "dense-one")[1], rel=RTOL)
    assert out.rstrip().endswith(f"on {21 * 32} tokens")


def test_routing_metrics_under_cp_count_every_token_of_the_micro_batch(runs):
    """Each cp rank routes its part of every sequence: the logged tokens per expert are summed
    over the cp ranks too, so they are one process's (the same micro-batch, the same weights)
    -- they were each rank's half."""
    root, results = runs
    case_result(results, "moe-cp2")
    keys = ("moe_tokens_per_expert_min", "moe_tokens_per_expert_max")

    def logged(name):
        lines = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text()
                 .splitlines()]
        return [tuple(line[k] for k in keys) for line in lines if keys[0] in line]

    one, cp = logged("moe-one"), logged("moe-cp2")
    assert len(one) == 3 and cp == one
