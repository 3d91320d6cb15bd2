"""transformers' Trainer on meshfit, by difference: the guide's TrainingArguments snippets
(``scripts/snippets.py``, written for transformers) run under transformers as written and
under meshfit with only ``from transformers import Trainer, TrainingArguments`` changed to
``from meshfit.transformers import ...`` (by `driver.as_meshfit`), on 1 process (plain
``python``) and on 2 (transformers: ``torch.distributed.run``; meshfit: ``meshfit launch
--nproc 2``, which so runs a Trainer script), and give the same results: every logged loss,
gradient norm, learning rate and evaluation loss, and the final parameters (fp32, CPU, gloo:
rel <= 1e-6; they come out bitwise equal).

TRL's ``SFTTrainer`` the same way (``scripts/sft.py``, written for TRL: completion-only and
assistant-only loss, packing, padding-free), its import changed to ``from meshfit.transformers
import SFTConfig, SFTTrainer``.

The same meshfit launch runs ``scripts/layouts.py``: meshfit's layouts by
``TrainingArguments(parallel=...)`` and transformers' ``fsdp=``/``deepspeed=`` read as ZeRO
stages. Each trains on the batches transformers' DDP run on 2 processes trains on (tp and cp:
one data-parallel rank, the batches of its run on 1 process), and must reach its results.

The ``resume_<layout>`` cases there stop a run at step 2 and resume it from its checkpoint
(the optimizer state too) under ZeRO-3, tp + SP and disk offload: bit for bit the
uninterrupted run of the same layout.

Four launches in all, at once (most of their time is importing torch and transformers).
"""

from __future__ import annotations

import math
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from conftest import kill_tree, make_subprocess_env
from reference import differences

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers' Trainer itself needs it

SCRIPTS = Path(__file__).resolve().parent / "scripts"
DRIVER = SCRIPTS / "driver.py"
RTOL, ATOL = 1e-6, 1e-7
# Snippets on 1 process (all of them) and on 2 (those whose behaviour is distributed).
SFT = ["sft_completion_only", "sft_assistant_only", "sft_packing", "sft_padding_free"]
ONE = ["fp32", "batch_size", "accumulation", "checkpointing", "bf16", "fp16",
       "adamw_torch_fused", "adafactor", "adamw_bnb_8bit", "custom_optimizer", "compile",
       "evaluation", "resume", *SFT]
TWO = ["fp32", "accumulation", "checkpointing", "evaluation", "resume", "sft_completion_only"]
COMPARED = [c for c in ONE if c not in ("fp16", "adamw_bnb_8bit")]
# Each layout (2 processes) and the run of transformers' (TRL's) trainer on the same batches:
# (processes, case). tp and cp: their 2 processes are one data-parallel rank.
LAYOUTS = {"zero1": (2, "fp32"), "zero2": (2, "fp32"), "zero3": (2, "fp32"),
           "cpu_offload": (2, "fp32"), "disk_offload": (2, "fp32"), "tp_sp": (1, "fp32"),
           "cp": (1, "fp32"), "auto": (2, "fp32"), "fsdp": (2, "fp32"),
           "deepspeed": (2, "fp32"), "sft_zero3": (2, "sft_completion_only"),
           "sft_tp": (1, "sft_completion_only")}
# checkpoints with save_only_model, and save_model at the end (ZeRO-2: FSDP2 keeps the
# parameters sharded between steps too)
SAVED = ("zero2", "zero3", "tp_sp")
# Stopped at step 2 and resumed (checkpoints with the optimizer state), each against the
# uninterrupted run of the same layout (layouts.py).
RESUMED = {f"resume_{case}": case for case in ("zero3", "tp_sp", "disk_offload")}
BEST = "best_zero3"  # load_best_model_at_end under ZeRO-3 (layouts.py)


def _launch(framework: str, world: int, out: Path, env: dict) -> None:
    cases = ",".join(ONE if world == 1 else TWO)
    args = [str(DRIVER), "--framework", framework, "--out", str(out), "--script",
            "snippets,sft", "--cases", cases]
    if world == 1:
        cmd = [sys.executable, *args]
    elif framework == "meshfit":
        cmd = [sys.executable, "-m", "meshfit", "launch", "--nproc", "2", *args[:-4],
               "--script", "snippets,sft,layouts",
               "--cases", f"{cases},{','.join([*LAYOUTS, *RESUMED, BEST])}"]
    else:
        from meshfit.distributed.spawn import free_port

        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}", *args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)  # the launcher and its workers (in sessions of their own), ours only
        output, _ = proc.communicate(timeout=60)
        raise AssertionError(f"{framework} on {world} process(es) timed out:\n{output[-3000:]}")
    assert proc.returncode == 0, f"{framework} on {world} process(es):\n{output[-3000:]}"


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """{(framework, processes): [each rank's {case: result}]}."""
    out = tmp_path_factory.mktemp("trainer")
    env = {k: v for k, v in make_subprocess_env(out).items() if not k.startswith("ACCELERATE_")}
    launches = [(f, w) for w in (2, 1) for f in ("transformers", "meshfit")]
    with ThreadPoolExecutor(len(launches)) as pool:
        list(pool.map(lambda fw: _launch(*fw, out, env), launches))
    return {(f, w): [torch.load(out / f"{f}-{w}-rank{r}.pt", weights_only=False)
                     for r in range(w)]
            for f in ("transformers", "meshfit") for w in (1, 2)}


def _differences(a, b, path: str = "") -> list[str]:
    return differences(a, b, rtol=RTOL, atol=ATOL, path=path)


def _get(results, framework: str, world: int, case: str) -> list:
    per_rank = [r[case] for r in results[(framework, world)]]
    for rank, res in enumerate(per_rank):
        if "traceback" in res:
            pytest.fail(f"{framework}, {world} process(es), rank {rank}:\n{res['traceback']}",
                        pytrace=False)
    return per_rank


def _losses(result: dict) -> list[float]:
    return [row["loss"] for row in result["log"] if "loss" in row]


def _trained(result: dict) -> None:
    """What every run must show whatever the framework (equal results cannot be equally
    empty): a loss logged for each step (4, 3 for TRL's; every 2nd under evaluation), and a
    finite one."""
    losses = _losses(result)
    assert len(losses) in (2, 3, 4) and all(math.isfinite(x) and x > 0 for x in losses), losses


@pytest.mark.parametrize("case,world", [(c, 1) for c in COMPARED] + [(c, 2) for c in TWO])
def test_snippet_gives_transformers_results(results, case, world):
    theirs = _get(results, "transformers", world, case)
    ours = _get(results, "meshfit", world, case)
    for rank, (a, b) in enumerate(zip(theirs, ours)):
        for run in (a, b) if case != "resume" else (a["whole"], b["whole"]):
            _trained(run)
        problems = _differences(a, b)
        assert not problems, f"{case}, {world} process(es), rank {rank}: {problems[:5]}"


@pytest.mark.parametrize("world", [1, 2])
def test_resume_from_checkpoint_is_bit_exact(results, world):
    """A Trainer resumed from the checkpoint of step 2 ends where the whole run ends, to the
    bit, under meshfit (its log: steps 1-2 from the checkpoint, 3-4 trained again)."""
    for res in _get(results, "meshfit", world, "resume"):
        whole, resumed = res["whole"], res["resumed"]
        assert _losses(resumed) == _losses(whole) and len(_losses(whole)) == 4
        for name, tensor in whole["params"].items():
            assert torch.equal(resumed["params"][name], tensor), name


def test_fp16_on_cpu(results):
    """On the CPU transformers' fp16=True trains in fp32 (Accelerate turns neither autocast
    nor loss scaling on there): its run equals its fp32 run. meshfit runs fp16 autocast with
    dynamic loss scaling: close to fp32, not equal."""
    theirs = _get(results, "transformers", 1, "fp16")[0]
    assert not _differences(theirs, _get(results, "transformers", 1, "fp32")[0])
    ours, fp32 = _get(results, "meshfit", 1, "fp16")[0], _get(results, "meshfit", 1, "fp32")[0]
    _trained(ours)
    assert _losses(ours) != _losses(fp32)
    for a, b in zip(_losses(ours), _losses(fp32)):
        assert abs(a - b) / b < 1e-2


def test_bitsandbytes_optimizer_without_bitsandbytes(results):
    """optim='adamw_bnb_8bit' where bitsandbytes is not installed: transformers' own one-line
    error, the same under meshfit."""
    try:
        import bitsandbytes  # noqa: F401
        pytest.skip("bitsandbytes is installed: the case is compared with the others")
    except ImportError:
        pass
    theirs = results[("transformers", 1)][0]["adamw_bnb_8bit"]["error"]
    ours = results[("meshfit", 1)][0]["adamw_bnb_8bit"]["error"]
    assert theirs == ours and "bitsandbytes" in ours and "\n" not in ours


@pytest.mark.parametrize("case", LAYOUTS)
def test_layout_by_one_argument(results, case):
    """Each layout trains on 2 processes to transformers' (TRL's) results on the same
    batches: its DDP run on 2 processes, or (tp, cp: one data-parallel rank) its run on 1."""
    reference = _get(results, "transformers", *LAYOUTS[case])[0]
    for rank, res in enumerate(_get(results, "meshfit", 2, case)):
        _trained(res)
        assert res["layout"] == EXPECTED_LAYOUT[case], res["layout"]
        assert (res.get("saved") is not None) == (case in SAVED and rank == 0)
        problems = _differences({k: res[k] for k in ("log", "params")}, reference)
        assert not problems, f"{case}, rank {rank}: {problems[:5]}"
        if res.get("saved") is not None:  # save_model on a sharded layout: the whole weights
            assert not _differences(res["saved"], res["params"])


@pytest.mark.parametrize("case", RESUMED)
def test_resume_on_a_sharded_layout_is_bit_exact(results, case):
    """transformers' default checkpoints (the optimizer state too) on a layout that shards
    that state: a run stopped after step 2 (its checkpoint there) and resumed by a new
    Trainer with ``resume_from_checkpoint=True`` ends bit for bit where the uninterrupted run
    of the same layout ends (every logged row, every parameter); with ``save_total_limit=1``
    its checkpoint of step 4 replaced that of step 2, and holds transformers' files and
    meshfit's sharded optimizer state."""
    whole = _get(results, "meshfit", 2, RESUMED[case])
    for rank, (res, ref) in enumerate(zip(_get(results, "meshfit", 2, case), whole)):
        assert res["layout"] == ref["layout"] == EXPECTED_LAYOUT[RESUMED[case]]
        assert len(_losses(res)) == 4 and res["log"] == ref["log"], (rank, res["log"])
        for name, tensor in ref["params"].items():
            assert torch.equal(res["params"][name], tensor), (rank, name)
        if rank == 0:
            assert res["kept"] == ["checkpoint-4"], res["kept"]
            assert {"optimizer_meshfit", "model.safetensors", "scheduler.pt", "trainer_state.json",
                    "rng_state_0.pth", "rng_state_1.pth"} <= set(res["files"]), res["files"]
            assert "optimizer.pt" not in res["files"]


def test_load_best_model_at_end_on_a_sharded_layout(results):
    """``load_best_model_at_end`` under ZeRO-3: training ends with the best checkpoint's
    weights (step 2's, by the evaluation loss; not the last step's, which the same run
    without evaluation ends with) in the shards of every process."""
    last = _get(results, "meshfit", 2, "zero3")
    runs = _get(results, "meshfit", 2, BEST)
    name, best = runs[0]["best"]
    assert name == "checkpoint-2"
    for rank, res in enumerate(runs):
        _trained(res)
        assert set(res["params"]) == set(best)
        for key, tensor in best.items():
            assert torch.equal(res["params"][key], tensor), (rank, key)
        assert any(not torch.equal(res["params"][k], v) for k, v in last[rank]["params"].items())


EXPECTED_LAYOUT = {"zero1": "dp_shard 2, ZeRO-1", "zero2": "dp_shard 2, ZeRO-2",
                   "zero3": "dp_shard 2, ZeRO-3",
                   "cpu_offload": "dp_shard 2, ZeRO-3 + CPU offload",
                   "disk_offload": "dp_shard 2, ZeRO-3, optimizer state on disk",
                   "tp_sp": "tp 2, SP", "cp": "cp 2", "auto": "dp_replicate 2",
                   "fsdp": "dp_shard 2, ZeRO-2", "deepspeed": "dp_shard 2, ZeRO-3",
                   "sft_zero3": "dp_shard 2, ZeRO-3", "sft_tp": "tp 2"}
