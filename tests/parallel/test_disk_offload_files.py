"""The files of ``offload="disk"`` (`meshfit.parallel.offload_files`) are trusted only as far
as they are checked.

- Read back checked: a state file overwritten with same-size zeros between two steps (the
  case that trained on, silently) is refused at the next step's read, and by `state_dict`
  (a checkpoint would save it), one line naming the file and the rank; nothing of it
  reaches the parameters.
- Held by its run: a second run given the same folder is refused (by `check_writable`
  before launch, and by `DiskOffload` itself), naming the folder and the process holding
  it, and the first run's files are untouched; a folder whose run was killed (SIGKILL: no
  cleanup ran, the OS dropped the lock) is reclaimed.
- I/O errors are one line naming the file and the rank: a missing file, a truncated one, a
  write over the process's file size limit (``ulimit -f``); with several processes the
  launcher's summary blames the rank whose file failed, not the rank that lost it as a
  peer.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import resource
import signal
from types import SimpleNamespace

import pytest
import torch



def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # p00000 (64 x 64 weight): 16 KiB per moment; p00001 (bias): 256 B
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))


def _step(model, opt, x):
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.fixture
def job(tmp_path, monkeypatch):
    """`job(name)`: a model and its AdamW state on disk in `name` after a step, as rank 1 of
    a job."""
    from meshfit.parallel.disk import DiskOffload

    monkeypatch.setenv("RANK", "1")
    made = []

    def make(name: str = "off") -> SimpleNamespace:
        model = _model()
        opt = DiskOffload(torch.optim.AdamW(model.parameters(), lr=1e-2), tmp_path / name)
        made.append(opt)
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
        _step(model, opt, x)
        opt.flush()
        return SimpleNamespace(model=model, opt=opt, x=x, folder=tmp_path / name)

    yield make
    for opt in made:
        with contextlib.suppress(OSError):
            opt.close()


def test_a_state_file_changed_on_the_disk_is_refused_where_it_is_read(job):
    run = job()
    path = run.folder / "p00000.exp_avg.bin"
    size = path.stat().st_size
    path.write_bytes(bytes(size))  # same size, zeros: what a stray process could do
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    wanted = (rf"^offload='disk' \(rank 1\): {path}: its {size} bytes differ from those this "
              r"run wrote \(overwritten or corrupted on the disk\); nothing of it was used")
    with pytest.raises(ValueError, match=wanted):
        run.opt.state_dict()  # (a checkpoint would have saved the zeros)
    for _ in range(2):  # (and again: a refused file is never taken for the truth)
        with pytest.raises(ValueError, match=wanted):
            _step(run.model, run.opt, run.x)
    after = run.model.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items())  # no update used it


def test_the_offload_folder_is_held_by_its_run(job, tmp_path):
    from meshfit.parallel.disk import DiskOffload, check_writable

    run = job()
    files = sorted(p.name for p in run.folder.iterdir())
    opt = torch.optim.AdamW(run.model.parameters())
    held = rf"offload_dir='{run.folder}' is in use by another run \(process {os.getpid()} holds"
    with pytest.raises(ValueError, match=held + r" it\); give each run its own offload_dir"):
        DiskOffload(opt, run.folder)
    # before launch: the run's folder holding rank-N folders (as the Accelerator names them)
    (tmp_path / "job").mkdir()
    os.symlink(run.folder, tmp_path / "job" / "rank-0")
    with pytest.raises(ValueError, match=rf"parallel.offload_dir='{tmp_path / 'job'}' is in use "
                                         rf"by another run \(process {os.getpid()} holds its "
                                         r"rank-0/\)"):
        check_writable(tmp_path / "job", "parallel.offload_dir")
    assert sorted(p.name for p in run.folder.iterdir()) == files  # nothing of it touched
    _step(run.model, run.opt, run.x)  # and the first run goes on


def test_a_killed_runs_folder_is_reclaimed(tmp_path):
    from meshfit.parallel import offload_files
    from meshfit.parallel.disk import DiskOffload

    folder = tmp_path / "off"
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a run that holds the folder, writes a file, and is killed
        try:
            offload_files.hold(folder)
            (folder / "p00000.exp_avg.bin").write_bytes(b"x" * 64)
            os.write(ready_w, b"1")
            signal.pause()
        finally:
            os._exit(1)
    assert os.read(ready_r, 1) == b"1"
    assert offload_files.holder(folder) == pid
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    os.close(ready_r)
    os.close(ready_w)
    assert offload_files.holder(folder) is None  # the OS dropped the lock
    # (a process it forked that outlived it would hold the lock on: named as such)
    fd = os.open(folder / offload_files.MARKER, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(ValueError, match=rf"offload_dir='{folder}' is in use: process {pid}, "
                                             r"which has ended, took it, and a process it "
                                             r"started still holds it"):
            offload_files.hold(folder)
    finally:
        os.close(fd)
    opt = DiskOffload(torch.optim.SGD(_model().parameters(), lr=0.1, momentum=0.9), folder)
    assert sorted(p.name for p in folder.iterdir()) == [offload_files.MARKER]
    opt.close()
    assert not folder.exists()


def test_io_errors_are_one_line_naming_the_file_and_the_rank(job):
    run = job("missing")
    missing = run.folder / "p00001.exp_avg_sq.bin"
    missing.unlink()
    with pytest.raises(ValueError, match=rf"^offload='disk' \(rank 1\): {missing} is missing "
                                         r"\(removed while the run used it\)"):
        _step(run.model, run.opt, run.x)
    run = job("short")
    short = run.folder / "p00000.exp_avg.bin"
    short.write_bytes(short.read_bytes()[:-4])
    with pytest.raises(ValueError, match=rf"^offload='disk' \(rank 1\): {short} holds 16380 "
                                         r"bytes, 16384 expected \(truncated\)"):
        _step(run.model, run.opt, run.x)
    # over `ulimit -f` (Python ignores SIGXFSZ: the write fails), with the limit in the line;
    # the weight's 16 KiB per moment go over 8 KiB
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (8192, hard))
    try:
        with pytest.raises(ValueError, match=r"^offload='disk' \(rank 1\): cannot write "
                                             r".*/p00000\.exp_avg\.bin \(File too large: this "
                                             r"process may write files of 8192 bytes at most, "
                                             r"ulimit -f\); raise the limit"):
            job("limited")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_the_launchers_summary_blames_the_rank_whose_file_failed(monkeypatch):
    """Rank 1's offload file is missing; rank 0, waiting for it in a collective, fails in the
    same second with gloo's lost-peer error and a lower rank: rank 1 is named."""
    from meshfit.launch import torchrun

    def failure(pid, code, message):
        return SimpleNamespace(pid=pid, exitcode=code, timestamp=100, error_file="x",
                               message={"message": message}, error_file_data={},
                               signal_name=lambda: "")

    gloo = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
            "closed by peer [127.0.0.1]:10458. This is typically caused by a remote worker "
            "crashing.")
    mine = "offload='disk' (rank 1): /x/rank-1/p00000.exp_avg.bin is missing"
    said = torchrun.failure_summary({0: failure(7, 1, gloo), 1: failure(8, 2, mine)}, {7, 8})
    assert said == f"2 worker(s) failed; first: rank 1 exit code 2: {mine}"
    # rank 1 still exiting when rank 0 failed (stopped by the agent, -15): still rank 1
    said = torchrun.failure_summary({0: failure(7, 1, gloo), 1: failure(8, -15, mine)}, {7})
    assert said.startswith("2 worker(s) failed; first: rank 1 exit code -15 (")
    assert said.endswith(mine)
    # only lost peers (a rank killed without a word): the first of them, as before
    said = torchrun.failure_summary({0: failure(7, 1, gloo), 1: failure(8, 1, gloo)}, {7, 8})
    assert said.startswith("2 worker(s) failed; first: rank 0 exit code 1: ")


# ------------------------------------------------------------------ files a run reads in place
@pytest.fixture
def one_rank(tmp_path, monkeypatch):
    """A process group of this process alone (ZeroRedundancyOptimizer and FSDP2 need one)."""
    import torch.distributed as dist

    monkeypatch.setenv("RANK", "0")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


_ZEROS = r"its \d+ bytes differ from those this run wrote \(overwritten or corrupted on the disk\)"


def test_zero1_state_loaded_into_its_files_is_checked_from_the_next_read(one_rank, tmp_path):
    """ZeRO-1's checkpoint load writes the moments into their files' maps in place; the next
    step's read checks them against what the load wrote (it used to take them unchecked)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from meshfit.checkpoint.state import optimizer_load_plan, optimizer_state
    from meshfit.parallel.disk import DiskOffload

    model = _model()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    zero.optim = offload = DiskOffload(zero.optim, tmp_path / "off")
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    try:
        _step(model, zero, x)
        saved = {n: {k: v.clone() for k, v in s.items()}
                 for n, s in optimizer_state([model], zero)["state"].items()}

        def load() -> None:
            template, finish = optimizer_load_plan([model], zero)
            for name, entries in template["state"].items():  # (what DCP does: in place)
                for key, value in entries.items():
                    if isinstance(value, torch.Tensor) and value.dim():
                        value.copy_(saved[name][key] * 2)
            finish()

        load()
        _step(model, zero, x)  # the loaded state: read and used without a false alarm
        load()
        path = tmp_path / "off" / "p00000.exp_avg.bin"  # changed before its first read
        path.write_bytes(bytes(path.stat().st_size))
        with pytest.raises(ValueError, match=rf"\(rank 0\): {path}: " + _ZEROS):
            _step(model, zero, x)
    finally:
        offload.close()


def test_parameter_files_changed_on_the_disk_are_refused_before_use(one_rank, tmp_path):
    """offload_params: the fp32 shards live in memory-mapped files, read in place by FSDP2's
    all-gather and updated in place by the optimizer; a file changed through the disk is
    refused at the next forward (before the all-gather) or step, never trained on."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from meshfit.parallel.disk import ParameterFiles

    model = _model()
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)),
                offload_policy=CPUOffloadPolicy(pin_memory=False))
    files = ParameterFiles(model, tmp_path / "params")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    try:
        for _ in range(2):  # the run's own writes: sealed after each step, no false alarm
            files.check()
            _step(model, opt, x)
            files.after_step()
        path = tmp_path / "params" / "w00000.bin"
        path.write_bytes(bytes(path.stat().st_size))
        with pytest.raises(ValueError, match=rf"\(rank 0\): {path}: " + _ZEROS):
            model(x)
        files.seal()  # (say the change were the run's own) ... then changed after a forward:
        model(x).square().mean().backward()
        path.write_bytes(bytes(path.stat().st_size - 4) + b"\x00\x00\x80\x3f")
        with pytest.raises(ValueError, match=_ZEROS):
            files.check()  # what the Accelerator runs before each optimizer step
        path.write_bytes(b"")  # shortened: refused by its size, not a SIGBUS on the map
        with pytest.raises(ValueError, match=r"holds 0 bytes, 16384 expected \(truncated\)"):
            files.check()
    finally:
        files.close()
