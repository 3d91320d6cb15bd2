"""``offload="disk"`` (`meshfit.parallel.disk.DiskOffload`): the optimizer state in files,
streamed through each step in chunks.

- Exact: the same run without offload, bit for bit (fp32, same layout: the same operations
  on the same values), with AdamW and SGD with momentum, on one process (chunks of a few
  parameters, so that the streaming's read-ahead and write-behind are exercised; the
  reference GPT and a transformers Llama with its gradient clipped) and on 2 ranks under
  DDP, ZeRO-1 (ZeroRedundancyOptimizer's local optimizer on disk), ZeRO-2 and ZeRO-3
  (FSDP2: each rank's local shards on disk), and ZeRO-3 with the parameter shards in
  memory-mapped files too (``offload_params``: the files hold the trained values).
- Checkpoints: saved with the state on disk and resumed into a fresh job with it on disk
  again, or without offload: bit for bit the uninterrupted run; and on one process with
  the state on disk (the checkpoint resharded).
- Safe: the folder is created private (0700, files 0600) and removed at the end unless
  kept; an existing folder with files in it is refused; a write that fails is one line
  naming the file; a disk with too little free space is refused before anything is written.
"""

from __future__ import annotations

import errno
import os
import stat

import pytest
import torch

from conftest import case_result, run_cases
from reference import tiny_gpt, token_batches

from meshfit.parallel.disk import DiskOffload

STEPS, SAVE_AT = 4, 2


def _train(model, optimizer, steps, x, y, start: int = 0):
    losses = []
    for i in range(start, start + steps):
        loss = model(x[2 * i:2 * i + 2], y[2 * i:2 * i + 2])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_a_transformers_llama_equals_the_state_in_memory(tmp_path):
    """The same on a Hugging Face Llama (AdamW; its loss from the logits), with the gradient
    clipped before each step."""
    from reference import hf_llama

    from meshfit.parallel.disk import DiskOffload

    x, y = token_batches(2 * STEPS, 16)
    runs = []
    for offload in (False, True):
        model = hf_llama(dtype=torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if offload:
            opt = DiskOffload(opt, tmp_path / "off", chunk_bytes=50_000)
        losses = []
        for i in range(STEPS):
            out = model(input_ids=x[2 * i:2 * i + 2]).logits
            loss = torch.nn.functional.cross_entropy(out.flatten(0, 1),
                                                     y[2 * i:2 * i + 2].flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs.append((losses, {k: v.clone() for k, v in model.state_dict().items()}))
        if offload:
            opt.close()
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(v, runs[1][1][k]) for k, v in runs[0][1].items())


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_one_process_equals_the_state_in_memory(tmp_path, kind):
    from meshfit.parallel import disk
    from meshfit.parallel.disk import DiskOffload

    x, y = token_batches(2 * STEPS, 16)

    def build():
        model = tiny_gpt(dtype=torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1) \
            if kind == "adamw" else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return model, opt

    ref_model, ref_opt = build()
    want = _train(ref_model, ref_opt, STEPS, x, y)
    model, opt = build()
    offload = DiskOffload(opt, tmp_path / "off", chunk_bytes=20_000)
    assert len(offload._chunks) > 5  # several chunks: read-ahead and write-behind at work
    assert _train(model, offload, STEPS, x, y) == want
    offload.flush()  # (the last step's writes end while the next forward would run)
    took = offload.seconds
    assert min(took.values()) >= 0 and took["reading"] > 0 and took["writing"] > 0
    for (name, a), b in zip(ref_model.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name
    # on disk, private; in memory only the small state
    folder = tmp_path / "off"
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    files = sorted(f for f in folder.iterdir() if not f.name.startswith("."))
    per_param = 2 if kind == "adamw" else 1
    assert len(files) == per_param * len(list(model.parameters()))
    assert all(stat.S_IMODE(os.stat(f).st_mode) == 0o600 for f in files)
    assert all(not any(isinstance(v, torch.Tensor) and v.numel() > 1 for v in s.values())
               for s in opt.state.values())
    assert offload.bytes_written == sum(f.stat().st_size for f in files) * STEPS
    assert (folder / disk.MARKER).is_file()
    # the state dict: the same tensors as the optimizer that kept them in memory
    ref_state, state = ref_opt.state_dict()["state"], offload.state_dict()["state"]
    assert ref_state.keys() == state.keys()
    for i, entries in ref_state.items():
        for key, value in entries.items():
            assert torch.equal(value, state[i][key]), (i, key)
    offload.close()
    assert not folder.exists()


def test_bad_folders_optimizers_and_disks(tmp_path, monkeypatch):
    from meshfit.parallel import disk, offload_files
    from meshfit.parallel.disk import DiskOffload, check_free_space

    model = tiny_gpt(dtype=torch.float32)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "other.txt").write_text("x")
    with pytest.raises(ValueError, match=r"offload_dir='.*busy' exists and is not an empty "
                                         r"folder; give a new path"):
        DiskOffload(torch.optim.AdamW(model.parameters()), busy)
    with pytest.raises(ValueError, match="offload='disk' streams Adam, AdamW and SGD state; "
                                         "Adagrad is not supported yet"):
        DiskOffload(torch.optim.Adagrad(model.parameters()), tmp_path / "a")
    assert not (tmp_path / "a").exists()  # nothing created for a refused optimizer
    # too little free space: refused with the bytes needed and free, before any file
    need = 8 * sum(p.numel() for p in model.parameters())
    monkeypatch.setattr(offload_files.shutil, "disk_usage",
                        lambda path: type("U", (), {"free": need - 1}))
    with pytest.raises(ValueError, match=r"the optimizer state needs 0\.\d+ GiB \(1 rank\(s\) "
                                         r"x 0\.\d+\) and 0\.\d+ GiB is free there"):
        check_free_space(torch.optim.AdamW(model.parameters()), tmp_path / "b")
    monkeypatch.undo()
    # a folder that cannot be written: one line before anything is created
    from meshfit.parallel.disk import check_writable

    (tmp_path / "afile").write_text("mine")
    with pytest.raises(ValueError, match=r"offload_dir='.*afile/x/y': '.*afile' is a file, "
                                         r"not a folder"):
        check_writable(tmp_path / "afile" / "x" / "y")
    monkeypatch.setattr(disk.os, "access", lambda path, mode: False)  # (root may write anyway)
    with pytest.raises(ValueError, match=r"offload_dir='.*/new/run' \(its nearest existing "
                                         r"folder '.*'\) is not writable by this user"):
        check_writable(tmp_path / "new" / "run")
    monkeypatch.undo()
    check_writable(tmp_path / "new" / "run")
    assert not (tmp_path / "new").exists()
    # a write that fails (a full disk): one line naming the file, when the step ends
    x, y = token_batches(4, 16)
    opt = DiskOffload(torch.optim.AdamW(model.parameters()), tmp_path / "c")
    real = os.replace

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk.os, "replace", full)
    loss = model(x[:2], y[:2])
    loss.backward()
    opt.step()
    with pytest.raises(OSError, match=r"offload='disk': cannot write .*p00000\.exp_avg\.bin "
                                      r"\(No space left on device\); free space"):
        opt.step()
    monkeypatch.setattr(disk.os, "replace", real)
    opt.close()
    keep = DiskOffload(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                       tmp_path / "kept", keep=True)
    keep.close()
    assert (tmp_path / "kept").is_dir()
    # a kept (or killed) run's folder carries the marker: the next run replaces it
    again = DiskOffload(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                        tmp_path / "kept")
    again.close()
    assert not (tmp_path / "kept").exists()


# ------------------------------------------------------------------ layouts, checkpoints
LAYOUTS = {"ddp": ({}, {}), "zero1": ({"dp_shard": 2, "dp_replicate": 1}, {"zero_stage": 1}),
           "zero2": ({"dp_shard": 2, "dp_replicate": 1}, {"zero_stage": 2}),
           "zero3": ({"dp_shard": 2, "dp_replicate": 1}, {"zero_stage": 3}),
           # + the parameter shards (the fp32 master weights) in memory-mapped files
           "zero3-params": ({"dp_shard": 2, "dp_replicate": 1},
                            {"zero_stage": 3, "offload_params": True})}


def _job(name: str, root, *, disk: bool, tag: str, load: str | None = None,
         save: str | None = None, steps: int = STEPS, start: int = 0) -> dict:
    from meshfit import Accelerator, ParallelDims

    dims, options = LAYOUTS.get(name, ({}, {}))  # (another name: one process)
    extra = {"offload": "disk", "offload_dir": str(root / f"{name}-{tag}")} if disk else {}
    if not disk:  # (the reference: everything in memory)
        options = {k: v for k, v in options.items() if k != "offload_params"}
    acc = Accelerator(parallel=ParallelDims(**dims), mixed_precision="no", **options, **extra)
    model = acc.prepare(tiny_gpt(dtype=torch.float32))
    opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    if load:
        acc.load_state(load)
    x, y = token_batches(4 * STEPS, 16)
    r, dp = acc.process_index, acc.num_processes
    losses = []
    for i in range(start, start + steps):
        rows = slice(4 * i + r * 4 // dp, 4 * i + (r + 1) * 4 // dp)
        loss = model(x[rows], y[rows])
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(acc.reduce(loss.detach(), "mean").item())
        if save and i + 1 == SAVE_AT:
            acc.save_state(save)
    state = {k: v.clone() for k, v in acc.get_state_dict(model).items()}
    inner = opt.optimizer  # (ZeRO-1: the local optimizer inside ZeroRedundancyOptimizer)
    offload = getattr(inner, "optim", inner)
    written = offload.bytes_written if isinstance(offload, DiskOffload) else None
    mapped = _parameters_in_files(acc, model) if acc.offload_params else None
    acc.free_memory()  # (the end of a job: its offload folder removed)
    return {"losses": losses, "state": state, "written": written, "mapped": mapped}


def _parameters_in_files(acc, model) -> tuple[int, bool]:
    """(bytes of parameter shards in files, whether every file holds its shard's current
    values (the updates reached the files), the model's parameters)."""
    import numpy as np

    from meshfit._compat import fsdp as fsdp_internals

    files = acc.runtime.parameter_files[0]
    same = True
    for i, fsdp_param in enumerate(fsdp_internals.fsdp_params(model)):
        path = files.folder / f"w{i:05d}.bin"
        data = fsdp_internals.padded_shard(fsdp_param)
        if data.numel():
            on_disk = torch.from_numpy(np.fromfile(path, dtype=np.float32))
            same = same and torch.equal(on_disk, data)
    return files.bytes, same, sum(p.numel() for p in model.parameters())


def _layout_case(rank, world_size, name, root):
    full = _job(name, root, disk=False, tag="none")
    disk = _job(name, root, disk=True, tag="disk", save=str(root / f"{name}-ckpt"))
    resumed = _job(name, root, disk=True, tag="again", load=str(root / f"{name}-ckpt"),
                   steps=STEPS - SAVE_AT, start=SAVE_AT)
    plain = _job(name, root, disk=False, tag="plain", load=str(root / f"{name}-ckpt"),
                 steps=STEPS - SAVE_AT, start=SAVE_AT)
    left = sorted(p.name for p in root.iterdir() if p.name.startswith(name) and
                  "ckpt" not in p.name and any(p.iterdir()))
    return {"full": full, "disk": disk, "resumed": resumed, "plain": plain, "left": left,
            "ckpt": str(root / f"{name}-ckpt")}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    root = tmp_path_factory.mktemp("disk")
    return run_cases({name: (_layout_case, name, root) for name in LAYOUTS}, 2, timeout=300)


def _same(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"]
    assert a["state"].keys() == b["state"].keys()
    for key, value in a["state"].items():
        assert torch.equal(value, b["state"][key]), key


@pytest.mark.parametrize("name", LAYOUTS)
def test_layouts_are_bitwise_the_run_without_offload_and_resume(layouts, name):
    got = case_result(layouts, name)[0]
    _same(got["full"], got["disk"])
    assert got["full"]["written"] is None and got["plain"]["written"] is None
    assert got["disk"]["written"] > 0 and got["resumed"]["written"] > 0  # (on disk indeed)
    if LAYOUTS[name][1].get("offload_params"):  # half of the model's fp32 weights per rank
        for run in ("disk", "resumed"):  # (+ padding: at most a row per parameter)
            size, same, n = got[run]["mapped"]
            assert n * 4 / 2 <= size <= n * 4 / 2 + 4096 and same
    tail = {"losses": got["full"]["losses"][SAVE_AT:], "state": got["full"]["state"]}
    _same(tail, got["resumed"])  # a checkpoint of the state on disk, back on disk
    _same(tail, got["plain"])  # ... and into a job that keeps it in memory
    assert got["left"] == []  # every rank's offload folder removed (the objects are gone)


RESUME_RTOL = 1e-5
"""One process resuming a 2-rank checkpoint: the same values, but each step's loss is
summed over the 4 rows in another order than the 2 ranks' (2 + 2, then averaged), so fp32
losses differ by rounding: a few ulps (1e-7 relative) per step over 2 steps, with a
hundred-fold margin. (The weights are compared with the same resume without offload, bit
for bit: Adam's update amplifies rounding in near-zero gradients beyond any fixed bound.)"""


@pytest.mark.parametrize("name", ["zero1", "zero3", "zero3-params"])
def test_a_checkpoint_on_disk_resumes_on_one_process_with_the_state_on_disk(layouts, name,
                                                                            tmp_path):
    got = case_result(layouts, name)[0]
    one = _job("one", tmp_path, disk=True, tag="one", load=got["ckpt"],
               steps=STEPS - SAVE_AT, start=SAVE_AT)
    plain = _job("one", tmp_path, disk=False, tag="plain", load=got["ckpt"],
                 steps=STEPS - SAVE_AT, start=SAVE_AT)
    assert one["written"] > 0
    _same(plain, one)  # the resharded state on disk: the same run as in memory
    assert one["losses"] == pytest.approx(got["full"]["losses"][SAVE_AT:], rel=RESUME_RTOL)
    assert not any((tmp_path / "one-one").iterdir())  # (the offload folder removed)
