"""The run folder: refused before anything is written, locked while a run writes to it,
overwritten only on request, and its files written whole or not at all (full disk included)."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from meshfit import _files
from meshfit.checkpoint import saved
from meshfit.train import runfolder
from meshfit.train.config import RunConfig
from meshfit.train.configfile import to_toml
from meshfit.train.run import MetricsWriter
from meshfit.train.runfolder import (
    LOCK_FILE,
    RunLock,
    WriteFailed,
    append_line,
    atomic_write_text,
    check_run_folder,
)

RUNFOLDER_PY = Path(runfolder.__file__)


def _one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text, text
    return text


def _listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def _child(code: str) -> subprocess.Popen:
    """A Python child that loads runfolder.py alone (stdlib only: no torch import) as `rf`."""
    prelude = ("import importlib.util, sys\n"
               f"spec = importlib.util.spec_from_file_location('rf', {str(RUNFOLDER_PY)!r})\n"
               "rf = importlib.util.module_from_spec(spec); spec.loader.exec_module(rf)\n")
    return subprocess.Popen([sys.executable, "-c", prelude + code], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


# ------------------------------------------------------------------ check_run_folder


def test_new_folder_and_user_files_pass_and_nothing_is_written(tmp_path):
    check_run_folder(tmp_path / "a" / "b", resume=False, overwrite=False)
    assert not (tmp_path / "a").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")  # not a run: accepted
    check_run_folder(tmp_path / "mine", resume=False, overwrite=False)
    assert _listing(tmp_path / "mine") == ["notes.txt"]


@pytest.mark.parametrize("marker", ["metrics.jsonl", "config.toml", "checkpoints"])
def test_existing_run_is_refused_unless_resume_or_overwrite(tmp_path, marker):
    out = tmp_path / "run"
    out.mkdir()
    # a run that trained: a logged step, or a checkpoint (a run stopped before its first
    # step is not refused: test_train_models)
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    if marker == "checkpoints":
        (out / "metrics.jsonl").unlink()
        (out / marker / "step-1").mkdir(parents=True)
    elif marker == "config.toml":
        (out / marker).write_text("x")
    with pytest.raises(ValueError) as err:
        check_run_folder(out, resume=False, overwrite=False)
    text = _one_line(err)
    assert f"--out={str(out)!r}" in text and marker in text
    assert "--resume" in text and "--overwrite" in text and "nothing was changed" in text
    check_run_folder(out, resume=True, overwrite=False)
    check_run_folder(out, resume=False, overwrite=True)
    with pytest.raises(ValueError, match="--resume .* --overwrite"):
        check_run_folder(out, resume=True, overwrite=True)


def test_out_that_is_a_file_or_under_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError) as err:
        check_run_folder(f, resume=False, overwrite=False)
    assert "is a file" in _one_line(err) and "--out=" in _one_line(err)
    with pytest.raises(ValueError) as err:
        check_run_folder(f / "sub" / "run", resume=False, overwrite=False)
    assert f"{f} is a file" in _one_line(err)
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="is a broken symbolic link"):
        check_run_folder(tmp_path / "link", resume=False, overwrite=False)


def test_too_long_name_and_path(tmp_path):
    name_max = os.pathconf(tmp_path, "PC_NAME_MAX")
    with pytest.raises(ValueError) as err:
        check_run_folder(tmp_path / ("n" * (name_max + 1)), resume=False, overwrite=False)
    assert f"longer than the {name_max}" in _one_line(err)
    check_run_folder(tmp_path / ("n" * name_max), resume=False, overwrite=False)  # control
    path_max = os.pathconf(tmp_path, "PC_PATH_MAX")
    deep = tmp_path.joinpath(*["d" * 200] * (path_max // 200 + 1))
    with pytest.raises(ValueError) as err:
        check_run_folder(deep, resume=False, overwrite=False)
    assert f"exceeds the {path_max}" in _one_line(err)


def test_read_only_file_system_and_no_permission(tmp_path, monkeypatch):
    # Tests run as root here (no permission check applies, no mount allowed): the two
    # system answers are simulated; the real calls are what check_run_folder asks.
    real_statvfs, asked = os.statvfs, []

    class ReadOnly:
        def __init__(self, st):
            self.f_flag = st.f_flag | os.ST_RDONLY

    monkeypatch.setattr(os, "statvfs", lambda p: asked.append(Path(p)) or
                        ReadOnly(real_statvfs(p)))
    with pytest.raises(ValueError) as err:
        check_run_folder(tmp_path / "new" / "run", resume=False, overwrite=False)
    assert "read-only file system" in _one_line(err) and asked == [tmp_path]
    monkeypatch.setattr(os, "statvfs", real_statvfs)
    monkeypatch.setattr(os, "access", lambda p, mode: False)
    with pytest.raises(ValueError) as err:
        check_run_folder(tmp_path / "new", resume=False, overwrite=False)
    assert f"{tmp_path} is not writable" in _one_line(err)


# ------------------------------------------------------------------ RunLock


def test_second_run_gets_one_line_with_the_first_ones_pid(tmp_path):
    out = tmp_path / "run"
    with RunLock(out) as lock:
        assert (out / LOCK_FILE).read_text() == f"{os.getpid()}\n"
        with pytest.raises(ValueError) as err:  # a second open file: flock conflicts
            RunLock(out).__enter__()
        assert f"PID {os.getpid()}" in _one_line(err)
        with pytest.raises(ValueError) as err:  # also with resume/overwrite
            check_run_folder(out, resume=True, overwrite=False)
        assert f"a run (PID {os.getpid()}) is writing" in _one_line(err)
        assert lock.fd is not None
    check_run_folder(out, resume=False, overwrite=False)  # released: free again
    with pytest.raises(RuntimeError):
        with RunLock(out):
            raise RuntimeError("the run failed")
    with RunLock(out):  # released on the exception too
        pass


def test_lock_of_a_killed_run_is_free_again(tmp_path):
    out = tmp_path / "run"
    child = _child(f"lock = rf.RunLock(rf.Path({str(out)!r})).__enter__()\n"
                   "print('locked', flush=True)\nsys.stdin.read()\n")
    try:
        assert child.stdout.readline().strip() == "locked", child.stderr.read()
        with pytest.raises(ValueError) as err:
            check_run_folder(out, resume=True, overwrite=False)
        assert f"PID {child.pid}" in _one_line(err)
        with pytest.raises(ValueError) as err:
            RunLock(out).__enter__()
        assert f"PID {child.pid}" in _one_line(err)
    finally:
        os.kill(child.pid, signal.SIGKILL)  # no exit handler runs: only the kernel unlocks
        child.communicate(timeout=60)  # generous: a killed process is reaped at once
    assert child.returncode == -signal.SIGKILL
    assert (out / LOCK_FILE).read_text().strip() == str(child.pid)  # left behind
    check_run_folder(out, resume=False, overwrite=False)
    with RunLock(out):
        assert (out / LOCK_FILE).read_text() == f"{os.getpid()}\n"


def test_overwrite_removes_the_runs_files_and_nothing_else(tmp_path):
    out = tmp_path / "run"
    for name in ("checkpoints/step-4/model.safetensors", "model/config.json",
                 "adapter/adapter_config.json", "tracking/metrics.csv",
                 ".model.abc123/model.safetensors", "data/corpus.txt"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("x")
    for name in ("metrics.jsonl", "config.toml", "pipeline.json", "pipeline_timings.jsonl",
                 ".metrics.jsonl.k2j3.tmp", "notes.txt", ".hidden"):
        (out / name).write_text("x")
    with RunLock(out) as other:
        everything = _listing(out)
        with pytest.raises(ValueError, match="PID"):
            RunLock(out, overwrite=True).__enter__()
        assert _listing(out) == everything  # refused: nothing removed while another holds it
        other.release()
        with RunLock(out, overwrite=True):
            assert _listing(out) == [".hidden", LOCK_FILE, "data", "data/corpus.txt",
                                     "notes.txt"]


# ------------------------------------------------------------------ atomic writes


def test_atomic_write_replaces_whole_and_keeps_the_mode(tmp_path):
    target = tmp_path / "config.toml"
    atomic_write_text(target, "a = 1\n")
    assert target.read_text() == "a = 1\n"
    assert target.stat().st_mode & 0o777 == 0o666 & ~_umask()
    target.chmod(0o640)
    atomic_write_text(target, "a = 2\n")
    assert target.read_text() == "a = 2\n" and target.stat().st_mode & 0o777 == 0o640
    assert _listing(tmp_path) == ["config.toml"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES])
def test_atomic_write_failure_keeps_the_old_file_and_removes_the_temp(tmp_path, monkeypatch,
                                                                    code):
    target = tmp_path / "config.toml"
    target.write_text("old\n")

    def failing_fsync(fd):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(WriteFailed) as err:
        atomic_write_text(target, "new\n")
    text = _one_line(err)
    assert str(target) in text and errno.errorcode[code] in text and err.value.errno == code
    assert isinstance(err.value, ValueError)  # `meshfit` prints it as its one-line error
    assert _listing(tmp_path) == ["config.toml"] and target.read_text() == "old\n"


def test_atomic_write_interrupted_removes_the_temp(tmp_path, monkeypatch):
    target = tmp_path / "config.toml"
    target.write_text("old\n")
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        atomic_write_text(target, "new\n")
    assert _listing(tmp_path) == ["config.toml"] and target.read_text() == "old\n"


def test_full_disk_in_a_process_with_a_file_size_limit(tmp_path):
    """A real write failure: RLIMIT_FSIZE makes the kernel refuse writes past the limit
    (EFBIG, SIGXFSZ ignored), as a full disk refuses them (ENOSPC), part-way through a
    write. The previous files stay whole, no half line, no temp file."""
    (tmp_path / "config.toml").write_text("old config\n")
    line = json.dumps({"step": 1, "loss": 1.0}) + "\n"
    (tmp_path / "metrics.jsonl").write_text(line)
    child = _child(
        "import resource, signal, json\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (100, resource.RLIM_INFINITY))\n"
        f"folder = rf.Path({str(tmp_path)!r})\n"
        "out = {}\n"
        "metrics = folder / 'metrics.jsonl'\n"
        "for name, call in [\n"
        "        ('config', lambda: rf.atomic_write_text(folder / 'config.toml', 'x' * 500)),\n"
        "        ('short', lambda: rf.append_line(metrics, b'y' * 20 + b'\\n')),\n"
        "        ('long', lambda: rf.append_line(metrics, b'z' * 400 + b'\\n'))]:\n"
        "    try:\n"
        "        call(); out[name] = 'ok'\n"
        "    except ValueError as err:\n"
        "        out[name] = [type(err).__name__, err.errno, str(err)]\n"
        "print(json.dumps(out))\n")
    stdout, stderr = child.communicate(timeout=60)  # generous: the child runs ~0.1 s
    assert child.returncode == 0, stderr
    out = json.loads(stdout)
    assert out["short"] == "ok"  # fits under the limit: appended
    for name, file in (("config", "config.toml"), ("long", "metrics.jsonl")):
        kind, code, text = out[name]
        assert kind == "WriteFailed" and code == errno.EFBIG, out
        assert str(tmp_path / file) in text and "EFBIG" in text and "\n" not in text
    assert (tmp_path / "config.toml").read_text() == "old config\n"
    assert (tmp_path / "metrics.jsonl").read_text() == line + "y" * 20 + "\n"
    assert _listing(tmp_path) == ["config.toml", "metrics.jsonl"]


# ------------------------------------------------------------------ MetricsWriter


def test_metrics_line_is_whole_or_absent_on_a_full_disk(tmp_path, monkeypatch):
    writer = MetricsWriter(tmp_path, RunConfig())
    writer.write({"step": 1, "loss": 2.0})
    before = (tmp_path / "metrics.jsonl").read_bytes()
    real_write, calls = os.write, []

    def disk_fills(fd, data):  # the kernel's answer on a full disk: part, then ENOSPC
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[:7]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", disk_fills)
    with pytest.raises(WriteFailed) as err:
        writer.write({"step": 2, "loss": 1.5})
    text = _one_line(err)
    assert str(tmp_path / "metrics.jsonl") in text and "ENOSPC" in text
    assert len(calls) == 2 and (tmp_path / "metrics.jsonl").read_bytes() == before
    monkeypatch.setattr(os, "write", real_write)
    writer.write({"step": 2, "loss": 1.5})  # space again: appended after the whole lines
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text()
            .splitlines()] == [1, 2]


def test_short_write_that_completes_is_one_whole_line(tmp_path, monkeypatch):
    writer = MetricsWriter(tmp_path, RunConfig())
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data[:5])))
    writer.write({"step": 1, "loss": 2.0})
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["step"] == 1


def test_config_on_a_full_disk_keeps_the_previous_one(tmp_path, monkeypatch):
    (tmp_path / "config.toml").write_text("old\n")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(
        OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))))
    with pytest.raises(WriteFailed, match="config.toml.*ENOSPC"):
        MetricsWriter(tmp_path, RunConfig(), after_step=1)
    monkeypatch.setattr(os, "fsync", real)
    assert (tmp_path / "config.toml").read_text() == "old\n"  # not a 0-byte file
    assert _listing(tmp_path) == ["config.toml", "metrics.jsonl"]
    MetricsWriter(tmp_path, RunConfig(), after_step=1)  # the resume's rewrite: steps <= 1
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert (tmp_path / "config.toml").read_text() == to_toml(RunConfig())


def test_append_refuses_a_missing_folder_in_one_line(tmp_path):
    with pytest.raises(WriteFailed) as err:
        append_line(tmp_path / "gone" / "metrics.jsonl", b"{}\n")
    assert "ENOENT" in _one_line(err)


# ------------------------------------------------------------------ model folders


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid  # ended and reaped: no process has it (until the PID is reused)


def _save(target: Path, value: float = 1.0) -> Path:
    import torch

    model = torch.nn.Linear(4, 4)
    torch.nn.init.constant_(model.weight, value)
    return saved.save_model_folder(target, model.state_dict(), model, factory="m:f")


def _weight(target: Path) -> float:
    from safetensors.torch import load_file

    return float(load_file(str(target / "model.safetensors"))["weight"][0, 0])


def test_model_save_removes_stale_temps_of_dead_saves_only(tmp_path):
    target = _save(tmp_path / "model")
    dead, host = _dead_pid(), _files._HOST
    stale = [tmp_path / f".model.tmp.{host}.{dead}.k2j3abcd",
             tmp_path / f".model.old.{host}.{dead}"]
    kept = [tmp_path / f".model.tmp.{host}.{os.getpid()}.zzzzzzzz",  # a live save's
            tmp_path / f".model.tmp.otherhost.{dead}.abcdefgh",  # another host's: unknown
            tmp_path / f".other.tmp.{host}.{dead}.abcdefgh"]  # another folder's
    for folder in stale + kept:
        folder.mkdir()
        (folder / "model.safetensors.tmp").write_bytes(b"\0" * 1000)
    assert saved.stale_temps(target) == sorted(stale)
    _save(target, 2.0)
    assert _weight(target) == 2.0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["model"] + [p.name for p in kept])


def test_model_swap_killed_between_renames_is_put_back(tmp_path):
    target = _save(tmp_path / "model", 3.0)
    aside = tmp_path / f".model.old.{_files._HOST}.{_dead_pid()}"
    os.replace(target, aside)  # where a kill between replace_dir's two renames leaves it
    assert saved.remove_stale_temps(target) == [aside]
    assert _weight(target) == 3.0 and not aside.exists()


def test_model_save_interrupted_leaves_no_temp_and_the_old_model(tmp_path, monkeypatch):
    from meshfit.checkpoint import export

    target = _save(tmp_path / "model", 1.0)
    real = export.write_safetensors

    def interrupted(state, path):
        real(state, path)
        raise KeyboardInterrupt  # Ctrl-C after the weights are written, before the rename

    monkeypatch.setattr(export, "write_safetensors", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _save(target, 2.0)
    assert [p.name for p in tmp_path.iterdir()] == ["model"] and _weight(target) == 1.0


def test_model_save_fsyncs_every_file_before_the_rename(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(
        ("fsync", os.readlink(f"/proc/self/fd/{fd}"))) or real_fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: events.append(("replace", str(a), str(b)))
                        or real_replace(a, b))
    target = _save(tmp_path / "model")
    (rename,) = [i for i, e in enumerate(events) if e[0] == "replace" and e[2] == str(target)]
    tmp = events[rename][1]
    synced = {e[1] for e in events[:rename] if e[0] == "fsync"}
    assert {f"{tmp}/config.json", f"{tmp}/model.safetensors", tmp} <= synced
    assert ("fsync", str(tmp_path)) in events[rename:]  # the rename made durable


def test_save_killed_inside_safetensors_then_next_save_cleans(tmp_path):
    """kill -9 while safetensors writes (Accelerator.save_model's write_safetensors; os._exit:
    no cleanup runs) leaves its temporary file in a folder of ours; the next save removes it
    and the previous file stays whole meanwhile."""
    import torch
    from safetensors.torch import load_file

    from meshfit.checkpoint.export import write_safetensors

    target = tmp_path / "model.safetensors"
    write_safetensors({"w": torch.ones(3)}, target)
    code = ("import os, sys, torch\n"
            "from pathlib import Path\n"
            "import safetensors.torch as st\n"
            "from meshfit.checkpoint.export import write_safetensors\n"
            "def dies(tensors, filename, metadata=None):\n"
            "    Path(filename).with_name('.tmpkilled').write_bytes(b'x' * 1000)  # half done\n"
            "    os._exit(9)\n"
            "st.save_file = dies\n"
            "write_safetensors({'w': torch.zeros(3)}, Path(sys.argv[1]))\n")
    child = subprocess.run([sys.executable, "-c", code, str(target)], capture_output=True,
                           text=True, timeout=300)  # generous: torch's import on a busy machine
    assert child.returncode == 9, child.stderr
    (left,) = [p for p in tmp_path.iterdir() if p != target]
    assert left.name.startswith(f".model.safetensors.tmp.{_files._HOST}.")
    assert [p.name for p in left.iterdir()] == [".tmpkilled"]
    assert load_file(str(target))["w"].tolist() == [1.0, 1.0, 1.0]
    write_safetensors({"w": torch.full((3,), 2.0)}, target)
    assert sorted(tmp_path.iterdir()) == [tmp_path / "meshfit-digests.json", target]
    assert load_file(str(target))["w"].tolist() == [2.0, 2.0, 2.0]


def test_csv_tracker_rows_whole_or_absent_on_a_full_disk(tmp_path, monkeypatch):
    from meshfit.tracking import CSVTracker

    tracker = CSVTracker("run", tmp_path)
    tracker.log({"loss": 2.0}, step=1)
    tracker.log({"loss": 1.5}, step=2)
    before = tracker.path.read_bytes()
    real_write, real_fsync = os.write, os.fsync
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data[:3])) if
                        len(data) > 3 else (_ for _ in ()).throw(full))
    with pytest.raises(WriteFailed, match="metrics.csv.*ENOSPC"):
        tracker.log({"loss": 1.0}, step=3)  # an appended row
    monkeypatch.setattr(os, "write", real_write)
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(full))
    with pytest.raises(WriteFailed, match="metrics.csv.*ENOSPC"):
        tracker.log({"loss": 1.0, "lr": 0.1}, step=3)  # a new column: the file rewritten
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert tracker.path.read_bytes() == before and _listing(tmp_path) == ["metrics.csv"]
    tracker.log({"loss": 1.0, "lr": 0.1}, step=3)
    assert tracker.path.read_text().splitlines() == ["step,loss,lr", "1,2.0,", "2,1.5,",
                                                     "3,1.0,0.1"]


def test_temp_file_sibling_is_found_once_its_writer_is_dead(tmp_path, monkeypatch):
    target = tmp_path / "model.safetensors"
    mine = saved.temp_sibling(target, file=True)
    assert mine.is_file() and mine.parent == tmp_path and saved.stale_temps(target) == []
    ended = _dead_pid()
    monkeypatch.setattr(os, "getpid", lambda: ended)  # as named by a process that has ended
    dead = saved.temp_sibling(target, file=True)
    monkeypatch.undo()
    assert saved.stale_temps(target) == [dead]
    assert saved.remove_stale_temps(target) == [dead] and sorted(tmp_path.iterdir()) == [mine]


def test_write_safetensors_removes_a_killed_saves_temp_and_keeps_modes(tmp_path, monkeypatch):
    """Accelerator.save_model's file: a temporary file of a dead writer goes on the next
    save; the new file and folder get the usual modes (not mkstemp's 0600 / mkdtemp's 0700)."""
    import torch

    from meshfit.checkpoint.export import write_safetensors

    target = tmp_path / "model.safetensors"
    ended = _dead_pid()
    monkeypatch.setattr(os, "getpid", lambda: ended)
    leftover = saved.temp_sibling(target)
    (leftover / ".tmpjIylrP").write_bytes(b"\0" * 4096)  # safetensors' own, of a killed save
    monkeypatch.undo()
    write_safetensors({"w": torch.ones(2)}, target)
    assert sorted(tmp_path.iterdir()) == [tmp_path / "meshfit-digests.json", target]
    assert target.stat().st_mode & 0o777 == 0o666 & ~_umask()
    folder = _save(tmp_path / "model")
    assert folder.stat().st_mode & 0o777 == 0o777 & ~_umask()
