"""``meshfit launch`` (a training script on N processes per node) and ``meshfit train`` (a model
trained from a TOML config + ``--section.key=value`` overrides, in this process or on workers, each
running this command with ``--worker``: `_run_worker`, one rank, whose errors reach the launcher's
one-line failure summary), both through `meshfit.launch`, and the launch flags they share
(`add_launch_flags`). Everything is checked before any process starts or any file is written.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

from meshfit import launch
from meshfit.cli import OneLineParser, collect_overrides


def add_launch_flags(parser: argparse.ArgumentParser) -> None:
    """meshfit's own launch flags (`meshfit launch` and `meshfit train`). Their defaults are
    None so that a flag that was given can be told from one that was not: SLURM and
    accelerate's flags fill in only what was not given (`meshfit.launch.resolve`)."""
    parser.add_argument("--nproc", type=int, default=None,
                        help="worker processes on this node (default: 1, or from SLURM)")
    parser.add_argument("--nnodes", type=int, default=None,
                        help="number of nodes (default: 1, or from SLURM)")
    parser.add_argument("--node-rank", type=int, default=None,
                        help="this node's rank (default: 0, or SLURM_NODEID)")
    parser.add_argument("--master-addr", default=None,
                        help="address of node 0 (default: 127.0.0.1, or the first SLURM host)")
    parser.add_argument("--master-port", type=int, default=None,
                        help="rendezvous port (default: a free port, single node)")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="restart the whole group this often after a worker fails "
                             "(single node: by meshfit, on a fresh port each time)")
    parser.add_argument("--gpus", default=None, help="CUDA devices in order, e.g. 0,2")
    parser.add_argument("--no-slurm", action="store_true",
                        help="ignore SLURM_* variables (default: inside a SLURM job, take the "
                             "nodes, this node's rank, processes per node and rendezvous "
                             "from them)")


def add_accelerate_flags(parser: argparse.ArgumentParser) -> None:
    """`accelerate launch`'s common flags, same meaning as in Accelerate 1.15
    (``accelerate/commands/launch.py``), spelt with ``_`` or ``-`` as Accelerate accepts."""
    g = parser.add_argument_group(
        "accelerate launch's flags",
        "the same meaning as in `accelerate launch`; each may be spelt with _ or -")

    def flag(name: str, **kwargs) -> None:
        g.add_argument(f"--{name}", f"--{name.replace('_', '-')}", dest=name, **kwargs)

    flag("num_processes", type=int, default=None, metavar="N",
         help="processes in total over all machines (per node: N / --num_machines)")
    flag("num_machines", type=int, default=None, metavar="N", help="machines; = --nnodes")
    flag("machine_rank", type=int, default=None, metavar="R",
         help="this machine's rank; = --node-rank")
    flag("main_process_ip", default=None, metavar="ADDR",
         help="address of machine 0; = --master-addr")
    flag("main_process_port", type=int, default=None, metavar="PORT",
         help="its port (0: a free port, one machine only); = --master-port")
    flag("mixed_precision", default=None, metavar="{no,fp16,bf16}",
         help="the Accelerator's precision when the script leaves it unset "
              "(ACCELERATE_MIXED_PRECISION)")
    flag("gpu_ids", default=None, metavar="IDS", help="GPUs to use, e.g. 0,2, or all; = --gpus")
    flag("multi_gpu", action="store_true",
         help="accepted (meshfit always starts one process per --num_processes); "
              "checks that there are GPUs and at least 2 processes")
    g.add_argument("--cpu", action="store_true", help="CPU and gloo even where GPUs exist "
                   "(ACCELERATE_USE_CPU=True, MESHFIT_CPU=1)")


def _launch_parser() -> argparse.ArgumentParser:
    p = OneLineParser("meshfit launch", "Start a training script on N processes per node "
                      "(torch.distributed.run). accelerate launch's common flags work too; "
                      "inside a SLURM job the nodes, this node's rank, processes per node and "
                      "the rendezvous come from SLURM_* for whatever the flags leave open.")
    add_launch_flags(p)
    add_accelerate_flags(p)
    p.add_argument("-m", "--module", action="store_true",
                   help="run the target as a Python module (python -m)")
    p.add_argument("script", help="the training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own arguments")
    return p


def cmd_launch(argv: list[str]) -> int:
    ns = _launch_parser().parse_args(argv)
    check_environment()
    cfg, env, notes = launch.config_from_args(ns)
    if not ns.module and not Path(ns.script).is_file():
        raise ValueError(f"script={ns.script!r} is not a file; give the path of a Python "
                         "script (or use -m for a module)")
    launch.master_port_in_use(cfg)
    say("launch", notes)
    return launch.run(cfg, [ns.script, *ns.script_args], module=ns.module, env=env)


def say(command: str, notes: list[str]) -> None:
    """What the launcher took from SLURM, said once every argument is checked."""
    for note in notes:
        print(f"meshfit {command}: {note}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ meshfit train
RESUME_OVERRIDES = ("parallel", "checkpoint", "train.steps")
"""What --resume may change: the layout, the checkpoints, and how far to train."""
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
"""torchrun's variables that make a process one rank of a job: `meshfit train` starts its
own ranks, so finding them set (left over from a job, or `meshfit train` itself started under
torchrun) is refused rather than joining a job that does not exist."""


def _train_parser() -> argparse.ArgumentParser:
    p = OneLineParser("meshfit train", "Train the reference GPT (default: the tiny preset on "
                      "the Python standard library's source). Options --section.key=value "
                      "override the config; --print-config lists every key with its value "
                      "and meaning.")
    add_launch_flags(p)
    p.add_argument("--config", default=None, help="a TOML run configuration")
    p.add_argument("--out", default=None, help="run folder (default: runs/train-<time>)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its newest complete checkpoint, with "
                        "its saved config, on as many processes as it was saved by "
                        "([parallel], [checkpoint] and --nproc may change; another number of "
                        "processes is said)")
    p.add_argument("--overwrite", action="store_true",
                   help="start over in an --out that holds a run: its outputs (metrics, "
                        "config, checkpoints, model) are removed once the folder is locked")
    p.add_argument("--no-memory-check", action="store_true",
                   help="start even where the memory estimate says the run cannot fit")
    p.add_argument("--print-config", action="store_true",
                   help="print the config this command would run (--config, the overrides; "
                        "with --resume the run's own) as TOML, every key with its value and "
                        "one line of meaning, and exit; alone: every default")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p


def cmd_train(argv: list[str]) -> int:
    ns, rest = _train_parser().parse_known_args(argv)
    overrides = _collect_overrides(rest)
    if ns.print_config:  # nothing started, nothing written
        from meshfit.train.configdoc import describe

        print(describe(_config(ns, overrides)), end="")
        return 0
    # The code a run calls (a model factory, built before launch too) cannot end this process
    # as if the run had finished: meshfit decides its exit code.
    # (torch-free, but not on TORCH_FREE's list in tests/test_architecture.py)
    from meshfit.launch.finished import no_silent_exit

    with no_silent_exit("meshfit train"):
        return _train_command(ns, overrides)


def _train_command(ns, overrides: list[str]) -> int:
    saved_world = None
    if not ns.worker:  # the launcher's arguments first: their refusals need no torch
        check_environment()
        _refuse_inherited_ranks()
        saved_world = _saved_world(ns)  # --resume: on the run's own processes by default
        launch_cfg, env, notes = launch.config_from_args(ns)
        launch.master_port_in_use(launch_cfg)
    cfg = _config(ns, overrides)
    out = Path(ns.out or f"runs/train-{time.strftime('%Y%m%d-%H%M%S')}")
    if ns.worker:  # started by the launcher below: one rank of the job
        return _run_worker(cfg, out, resume=ns.resume)
    if not _check_before_starting(cfg, out, ns, launch_cfg, saved_world):
        return 0  # a finished run, said so
    say("train", notes)
    if launch_cfg.nproc == 1 and launch_cfg.nnodes == 1 and not env:
        return _train_here(cfg, out, ns)
    return _start_workers(cfg, out, ns, launch_cfg, env)


def _saved_world(ns) -> int | None:
    """With --resume: the number of processes the run's newest checkpoint was saved by (None:
    none to read; --resume's own checks say why later). A resume runs on as many unless told
    otherwise: where neither --nproc nor --nnodes is given (nor a SLURM job's shape, which
    the resume follows), --nproc becomes that number (with --nnodes N alone, that number / N
    per node). Another number of processes is said before starting
    (`_check_before_starting`)."""
    if not ns.resume or ns.out is None:
        return None
    from meshfit.launch.slurm import slurm_facts
    from meshfit.train.run import saved_world

    world = saved_world(Path(ns.out))
    nnodes = ns.nnodes or 1
    if world is not None and ns.nproc is None and (ns.no_slurm or slurm_facts() is None) \
            and world % nnodes == 0:
        ns.nproc = world // nnodes
    return world


def _collect_overrides(rest: list[str]) -> list[str]:
    """``--a.b=v`` and ``--a.b v`` forms; anything else is an error naming it."""
    return collect_overrides(rest, "--nproc, --config, --out, --resume, --overwrite, "
                             "--print-config",
                             "--train.steps=100")


def check_environment(environ=os.environ) -> None:
    """Variables of the environment that the launcher or the libraries below it read, checked
    before anything starts (torchrun reads LOGLEVEL; OpenMP reads OMP_NUM_THREADS and only
    complains on stderr): one line naming the variable, its value and the fix."""
    level = environ.get("LOGLEVEL")
    if level is not None and level.upper() not in ("CRITICAL", "FATAL", "ERROR", "WARN",
                                                    "WARNING", "INFO", "DEBUG", "NOTSET") \
            and not level.isdigit():
        raise ValueError(f"LOGLEVEL={level!r} in the environment (torchrun's log level) is not "
                         "a logging level; use DEBUG, INFO, WARNING or ERROR, or unset it")
    threads = environ.get("OMP_NUM_THREADS")
    if threads is not None and not all(p.strip().isdigit() and int(p) > 0
                                       for p in threads.split(",")):
        raise ValueError(f"OMP_NUM_THREADS={threads!r} in the environment is not a number of "
                         "threads; use e.g. OMP_NUM_THREADS=4, or unset it")


def _refuse_inherited_ranks() -> None:
    found = [f"{n}={os.environ[n]}" for n in RANK_VARIABLES if n in os.environ]
    if found:
        raise ValueError(f"{', '.join(found)} set in the environment: meshfit train starts its "
                         "own processes (--nproc) and gives each its rank; unset "
                         f"{' '.join(n.split('=')[0] for n in found)} (or run your own script "
                         "under meshfit launch / torchrun)")


def _config(ns, overrides: list[str]):
    """--config with the overrides; to resume, the saved config of the run in --out, with
    [parallel] / [checkpoint] / train.steps overrides (a worker gets the resolved config as
    --config)."""
    from meshfit.train.configfile import load_config

    if not ns.resume or ns.worker:
        return load_config(ns.config, overrides)
    if ns.out is None:
        raise ValueError("--resume needs --out, the folder of the run to continue")
    if ns.config is not None:
        raise ValueError("--resume continues with the run's own config (OUT/config.toml); drop "
                         "--config")
    saved = Path(ns.out) / "config.toml"
    if not saved.is_file():
        raise ValueError(f"--resume: {saved} does not exist; give the --out folder of a "
                         "meshfit train run")
    return load_config(saved, overrides, allowed=RESUME_OVERRIDES)


def _check_before_starting(cfg, out: Path, ns, launch_cfg, saved_world: int | None) -> bool:
    """The launching process's checks, in order: the layout on the job's world size, the run
    folder, the checkpoint to resume (and a resume on another number of processes than it was
    saved by, said), this machine (`meshfit.train.preflight`, printing its warnings). False: a
    resumed run that is already finished (said, nothing to start)."""
    world_size = launch_cfg.nproc * launch_cfg.nnodes
    cfg.validate_for(world_size, launch_cfg.nproc)  # before any process starts
    from meshfit.train.configfile import to_toml
    from meshfit.train.runfolder import check_run_folder

    to_toml(cfg)  # the config.toml the run will write reads back as this config

    # Node 0 claims the run folder (lock, existing run, --overwrite); the other nodes of a
    # multi-node job join its run and only check that they can write there.
    check_run_folder(out, resume=ns.resume, overwrite=ns.overwrite,
                     claim=launch_cfg.node_rank == 0)
    if ns.resume:
        from meshfit.train.run import resume_point

        step, message = resume_point(out, cfg.train.steps)
        print(f"meshfit train: {message}")
        if step >= cfg.train.steps:
            return False
        if saved_world is not None and saved_world != world_size:
            print(f"meshfit train: warning: resuming on {world_size} process(es), the run was "
                  f"saved by {saved_world}: its steps now split and accumulate the batch "
                  "otherwise and draw from fresh random generators, so its losses will not be "
                  f"the uninterrupted run's (--nproc {saved_world} continues it as it was)",
                  file=sys.stderr)
    from meshfit.train.preflight import preflight

    for warning in preflight(cfg, world_size, launch_cfg.nproc,
                             memory_check=not ns.no_memory_check):
        print(f"meshfit train: warning: {warning}", file=sys.stderr)
    return True


def _train_here(cfg, out: Path, ns) -> int:
    """One process on one node: the run in this process, holding the run folder's lock."""
    from meshfit.train.run import Preempted
    from meshfit.train.runfolder import RunLock
    from meshfit.train.trainer import train

    try:
        with RunLock(out, overwrite=ns.overwrite):
            try:
                train(cfg, out, resume=ns.resume)
            finally:
                _remove_unfinished_saves(out)
    except Preempted as stopped:
        return _stopped(stopped)
    return 0


def _remove_unfinished_saves(out: Path) -> None:
    """Once the job's processes are gone (the lock still held): the temporary folders of a
    checkpoint whose save never committed (a second signal, a rank killed, a full disk) are
    removed and named; the committed checkpoints are left as they are."""
    from meshfit.checkpoint.store import is_complete

    root = out / "checkpoints"
    if not root.is_dir():
        return
    for path in sorted(root.glob("step-*.tmp-*")):
        shutil.rmtree(path, ignore_errors=True)
        print(f"meshfit train: removed {path.name}, a checkpoint save that did not finish",
              file=sys.stderr, flush=True)
    for path in sorted(root.glob("step-*.old-*")):  # a step saved again, stopped mid-commit
        target = root / path.name.split(".old-")[0]
        if is_complete(target):
            shutil.rmtree(path, ignore_errors=True)
        elif not target.exists():
            os.replace(path, target)  # the new one never arrived: the old one is kept


def _start_workers(cfg, out: Path, ns, launch_cfg, env: dict[str, str]) -> int:
    """The job's workers on this node, each running ``meshfit train --worker`` on the
    resolved config. Node 0's launcher holds the run folder's lock for the whole job;
    workers take none. Another node writes its workers' config into a folder of its own
    (node 0 may be clearing the run folder for --overwrite at the same moment)."""
    from meshfit.train.configfile import to_toml
    from meshfit.train.runfolder import RunLock, atomic_write_text

    with contextlib.ExitStack() as stack:
        if launch_cfg.node_rank == 0:
            stack.enter_context(RunLock(out, overwrite=ns.overwrite))
            resolved = out / "config.toml"
        else:
            resolved = Path(stack.enter_context(tempfile.TemporaryDirectory(
                prefix="meshfit-config-"))) / "config.toml"
        atomic_write_text(resolved, to_toml(cfg))
        try:
            return launch.run(launch_cfg, ["meshfit", "train", "--worker", "--config",
                                           str(resolved), "--out", str(out),
                                           *(["--resume"] if ns.resume else [])], module=True,
                              env=env, prog="meshfit train", say_stopped=False,
                              finished_marks=True)
        finally:
            if launch_cfg.node_rank == 0:
                _remove_unfinished_saves(out)


# ------------------------------------------------------------------------------ a worker
def _run_worker(cfg, out: Path, *, resume: bool) -> int:
    """One rank of the job: train; an error is recorded for the launcher's summary (its one
    line, or the end of its traceback) and, where only some ranks know it, said here."""
    from meshfit.launch.finished import ProcessEndRefused, mark_finished
    from meshfit.train.run import Diverged, Preempted, Stalled
    from meshfit.train.trainer import train

    try:
        train(cfg, out, resume=resume)
    except Preempted as stopped:
        return _stopped(stopped)
    except Diverged as err:  # every rank knows; the main one says it
        _record_error(err)
        return _stopped(err, code=1)
    except Stalled as err:  # only the ranks that waited know: each says it
        _record_error(err)
        print(f"meshfit train: error: {err}", file=sys.stderr, flush=True)
        return 1
    except (ValueError, TimeoutError, ProcessEndRefused) as err:  # one line, in the
        _record_error(err)  # launcher's summary too
        raise
    except Exception as err:  # a traceback: its last lines in the launcher's summary
        from meshfit.distributed.env import peer_lost

        reason = peer_lost(err)
        if reason is not None:  # another rank died: its failure is the one to report
            return _lost_peer(err, reason)
        _record_error(err, traceback.format_exc().strip().splitlines()[-3:])
        raise
    mark_finished()  # the launcher takes exit code 0 for success only with this mark
    return _leave_worker()


def _lost_peer(err: BaseException, reason: str) -> int:
    """A rank whose collective failed because another rank died (killed, out of memory,
    failed) leaves without a traceback: one line per node (its local rank 0, unless that is
    the one that died); the launcher's summary names the rank that failed first. No
    teardown of the broken process group (it can hang or abort)."""
    from meshfit.launch.finished import exit_now

    _record_error(err)
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"meshfit train: rank {os.environ.get('RANK', '0')} stopped: another rank of the "
              f"job is gone ({reason})", file=sys.stderr, flush=True)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    exit_now(1)


def _leave_worker() -> int:
    """A finished worker's way out. torch 2.13's gloo can abort a process that tears down after
    DeviceMesh subgroups ("terminate called without an active exception"), turning a finished run
    into a failed worker: 8 of 10 two-rank runs of a DeviceMesh script under plain torchrun, 1 of 16
    after a barrier, 0 of 16 leaving through os._exit. So every rank is done with every group before
    any tears down (settle_all: no gloo thread needs the GIL afterwards), and a worker whose run is
    complete (files written, trackers finished) leaves without the interpreter's teardown."""
    import torch.distributed as dist
    from meshfit.distributed import is_initialized

    from meshfit.distributed import init
    from meshfit.launch.finished import exit_now

    if not (init().is_distributed and is_initialized()):
        return 0
    from meshfit.distributed.settle import settle_all

    settle_all()
    dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    exit_now(0)


def _record_error(err: BaseException, lines: list[str] | None = None) -> None:
    """A worker's error in torch's error file (TORCHELASTIC_ERROR_FILE), where the launcher's
    failure summary reads it: its one line, or the given last lines of its traceback."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    text = "\n".join(lines) if lines else (str(err).splitlines() or [type(err).__name__])[0]
    with contextlib.suppress(OSError):  # the summary then gives the exit code alone
        Path(path).write_text(json.dumps({"message": text, "timestamp": int(time.time())}))


def _stopped(stopped, code: int | None = None) -> int:
    """One line from the main process; exit code `code`, else 128 + the signal, as if killed."""
    import torch.distributed as dist
    from meshfit.distributed import is_initialized

    if not is_initialized() or dist.get_rank() == 0:
        error = "" if code is None else "error: "
        print(f"meshfit train: {error}{stopped}", file=sys.stderr, flush=True)
    if is_initialized():
        dist.destroy_process_group()
    return 128 + stopped.signum if code is None else code
