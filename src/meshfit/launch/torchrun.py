"""torchrun's argument list for a `LaunchConfig`, and the job run through
``torch.distributed.run`` in this process (meshfit does not re-implement the launcher): its
rendezvous stores listening on loopback only, node 0's port checked before it starts; each
worker's start (`enter_worker`: dying with the launcher), how the agent stops them
(`stopping_workers`, `quiet_agent`), and a failure summed up in one line (`failure_summary`).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import ipaddress
import logging
import os
import runpy
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

from meshfit.distributed.spawn import free_port
from meshfit.launch.resolve import LaunchConfig

# torch (its launcher and elastic agent) is imported where used: `meshfit train` and `meshfit
# launch` refuse bad flags before torch loads (this module is on TORCH_FREE's list in
# tests/test_architecture.py); so is `meshfit.launch.finished` (torch-free, but not on that
# list).

WORKER_ENTRY = "meshfit.launch"
"""The module torch's agent runs for each worker (`enter_worker`, through the package's
``__main__``), which then execs the worker's own command."""
LAUNCHER_PID_ENV = "MESHFIT_LAUNCHER_PID"
RESTART_ENV = "MESHFIT_RESTART_COUNT"
MAX_RESTARTS_ENV = "MESHFIT_MAX_RESTARTS"
"""The attempt of a single-node job that meshfit restarts itself (0 on the first) and the
restarts allowed: `enter_worker` hands them to the worker as torchrun's own
TORCHELASTIC_RESTART_COUNT and TORCHELASTIC_MAX_RESTARTS (each attempt's agent counts 0)."""


def is_loopback(host: str) -> bool:
    """Whether `host` resolves to a loopback address (False when it does not resolve)."""
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def loopback_stores():
    """Make every TCPStore server the launcher starts for a loopback address listen on that
    address only. PyTorch's TCPStore server listens on every interface whatever address it is
    given (measured with torch 2.13: ``*:PORT`` for host "127.0.0.1"), so a single-node job's
    rendezvous — which holds the job's keys and barriers — would be reachable from the
    network. torch accepts an already listening socket instead (``master_listen_fd``); the
    launcher's stores (static rendezvous, c10d rendezvous backend, the workers' shared store)
    are given one bound to the loopback address. The workers only connect to the agent's
    store (torchrun's ``TORCHELASTIC_USE_AGENT_STORE``), they start no server of their own."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, \
        static_tcp_rendezvous

    real = dist.TCPStore

    class LoopbackTCPStore(real):
        def __init__(self, host_name, port, world_size=None, is_master=False, *args, **kwargs):
            if not (is_master and kwargs.get("master_listen_fd") is None
                    and is_loopback(host_name)):
                super().__init__(host_name, port, world_size, is_master, *args, **kwargs)
                return
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((socket.gethostbyname(host_name), int(port)))
                sock.listen(1024)
                kwargs["master_listen_fd"] = sock.fileno()
                super().__init__(host_name, sock.getsockname()[1], world_size, is_master,
                                 *args, **kwargs)
            except BaseException:
                sock.close()
                raise
            sock.detach()  # the store owns the descriptor now, and closes it

    patched = [(dist, "TCPStore"), (static_tcp_rendezvous, "TCPStore"),
               (c10d_rendezvous_backend, "TCPStore")]
    for module, name in patched:
        setattr(module, name, LoopbackTCPStore)
    try:
        yield
    finally:
        for module, name in patched:
            setattr(module, name, real)


def master_port_in_use(cfg: LaunchConfig) -> None:
    """One-line ValueError when node 0's rendezvous port is already taken, before anything
    starts (the store's bind would otherwise fail inside the agent, or a restart would wait
    on someone else's listener). Other nodes connect to node 0 and bind nothing."""
    if cfg.master_port is None or cfg.node_rank != 0:
        return
    host = cfg.master_addr if is_loopback(cfg.master_addr) or cfg.nnodes == 1 else ""
    try:
        addr = socket.gethostbyname(host) if host else ""
    except OSError:
        raise ValueError(f"--master-addr={cfg.master_addr!r} does not resolve to an address; "
                         "give a host name or IP address of node 0") from None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store binds
        try:
            s.bind((addr, cfg.master_port))
        except OSError as err:
            where = f"{cfg.master_addr}:{cfg.master_port}" if host else f"port {cfg.master_port}"
            raise ValueError(f"--master-port={cfg.master_port}: {where} is not free "
                             f"({err.strerror}); give another port, or leave --master-port out "
                             "for a free one (single node)") from None


def _children() -> set[int]:
    """PIDs of this process's children, from /proc (Linux)."""
    me, found = os.getpid(), set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()  # after "pid (comm) "
        if len(fields) > 1 and int(fields[1]) == me:
            found.add(int(entry.name))
    return found


@contextlib.contextmanager
def owning_descendants(grace_s: float = 2.0):
    """Everything the job starts ends with the job. This process becomes a child subreaper
    (Linux PR_SET_CHILD_SUBREAPER), so a process a worker started and left behind (a
    ``subprocess.Popen``, an ``os.fork`` child, a double-forked ``setsid`` daemon) is
    re-parented here instead of to init; when the job is over, each such new child is sent
    SIGTERM, then SIGKILL after `grace_s`, and reaped. Children this process had before are
    left alone."""
    if not sys.platform.startswith("linux"):
        yield
        return
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    before = _children()
    prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
    try:
        yield
    finally:
        try:
            _end(lambda: _children() - before, grace_s)
        finally:
            prctl(36, 0)


def _end(left, grace_s: float) -> None:
    """SIGTERM to the children `left()` names, SIGKILL to those still there after `grace_s`;
    each reaped."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        pids = left()
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while pids and time.monotonic() < deadline:
            for pid in list(pids):
                try:
                    if os.waitpid(pid, os.WNOHANG)[0]:
                        pids.discard(pid)
                except ChildProcessError:  # not (or no longer) ours to reap
                    pids.discard(pid)
            if pids:
                time.sleep(0.02)


def enter_worker(argv: list[str]) -> None:
    """``python -m meshfit.launch ARGS``: how the agent starts each worker. Asks Linux to
    SIGKILL this process when the launcher dies (PR_SET_PDEATHSIG), checks that the launcher
    was not already gone before that took effect, then runs ARGS as ``python -u ARGS`` would,
    the command torchrun would have run (`run_as_main`): same PID, same environment (with the
    restart count of the whole job where meshfit restarts it), so a script written for
    torchrun runs unchanged under `meshfit launch` and the other way round."""
    launcher = os.environ.pop(LAUNCHER_PID_ENV, "")
    restart, most = os.environ.pop(RESTART_ENV, ""), os.environ.pop(MAX_RESTARTS_ENV, "")
    if restart.isdigit() and most.isdigit():
        os.environ["TORCHELASTIC_RESTART_COUNT"] = restart
        os.environ["TORCHELASTIC_MAX_RESTARTS"] = most
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1: PR_SET_PDEATHSIG
    if launcher.isdigit() and os.getppid() != int(launcher):
        sys.exit(f"meshfit launch: the launcher (PID {launcher}) ended before this worker "
                 "started; not running it")
    run_as_main(argv)


def run_as_main(argv: list[str]) -> None:
    """``python -u ARGS`` in this process (the agent started it with ``-u``): a script
    (``sys.argv`` and ``sys.path[0]`` as Python sets them) or ``-m module``, as ``__main__``,
    rather than exec'ing a new interpreter, so that a rank whose collective failed only
    because another rank died (`meshfit.distributed.env.peer_lost`) says so in one line
    instead of a dozen lines of gloo's traceback beside the launcher's summary, which names
    the rank that failed first. Any other error's traceback is Python's, from the script's
    own first line (this module's and runpy's frames left out)."""
    sys.excepthook = _worker_excepthook(sys.excepthook)
    if argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))
    runpy.run_path(os.path.abspath(argv[0]), run_name="__main__")  # (__file__: absolute)


def _worker_excepthook(shown):
    """A worker's uncaught error: one line when another rank's death caused it, else
    `shown` (Python's hook) without the frames of the worker's entry."""
    entry = {__file__, os.path.join(os.path.dirname(__file__), "__main__.py"), runpy.__file__,
             "<frozen runpy>"}

    def hook(kind, value, tb):
        if "torch" in sys.modules:  # (only torch's collectives report a peer lost)
            from meshfit.distributed.env import peer_lost

            reason = peer_lost(value)
            if reason is not None:
                print(f"meshfit launch: rank {os.environ.get('RANK', '?')} stopped: another "
                      f"rank of the job is gone ({reason})", file=sys.__stderr__, flush=True)
                return
        first = tb
        while first is not None and first.tb_frame.f_code.co_filename in entry:
            first = first.tb_next
        if first is not None and isinstance(value, BaseException):  # (Python prints the
            value.__traceback__ = first  # exception's own traceback)
        shown(kind, value, first or tb)

    return hook


@contextlib.contextmanager
def stopping_workers(*, sigint: bool = False):
    """How the agent stops its workers, adjusted; yields the PIDs of the workers that had
    failed when it began stopping the rest (it terminates the others, exit code -15, and
    reports them as failed too, with timestamps of one-second resolution). The agent passes
    the signal it got on to the workers (`passed_signal`)."""
    # (torch-free, but not on TORCH_FREE's list in tests/test_architecture.py)
    from meshfit._compat import elastic

    first: set[int] = set()

    def adjust(context, death_sig):
        if not getattr(context, "_meshfit_closing", False):
            context._meshfit_closing = True
            first.update(elastic.failed_pids(context))
        return passed_signal(death_sig, sigint=sigint)

    with elastic.before_close(adjust):
        yield first


def passed_signal(death_sig, *, sigint: bool):
    """The signal the workers get when the agent got `death_sig`. A Ctrl-C (SIGINT) would
    raise KeyboardInterrupt in a script's every worker, one traceback each: they get SIGTERM
    instead, unless `sigint` (workers that stop on either themselves, as `meshfit train`'s
    do: a checkpoint and one line naming the signal that came)."""
    return signal.SIGTERM if death_sig == signal.SIGINT and not sigint else death_sig


@contextlib.contextmanager
def quiet_agent():
    """torch's elastic agent keeping its errors but not its per-worker warnings nor its
    "failed (exitcode ...)" line, which meshfit's summary replaces; unless LOGLEVEL asks for
    its own logs."""
    if os.environ.get("LOGLEVEL"):
        yield
        return

    def quiet(record) -> bool:
        return record.levelno >= 40 and not str(record.msg).startswith("failed (exitcode")

    loggers = [logging.getLogger(name) for name in list(logging.Logger.manager.loggerDict)
               if name.startswith("torch.distributed.elastic")]
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)


def _error_tail(failure, lines: int = 3) -> str:
    """The last lines of a failed worker's error, from torch's error file (scripts decorated
    with torch's ``@record``, and `meshfit train`'s workers), joined into one line."""
    message = failure.message
    if isinstance(message, dict):
        text = message.get("extraInfo", {}).get("py_callstack") or message.get("message", "")
    else:
        text = str(message or "")
    if not text or text.startswith(("To enable traceback", "Signal ")):
        return ""
    kept = [line.strip() for line in text.splitlines() if line.strip()][-lines:]
    return " | ".join(kept)


def _lost_a_peer(failure) -> bool:
    """Whether a failed worker's recorded error says another rank of the job had gone."""
    # (deferred: this module is torch-free, and the backend's phrases live beside torch)
    from meshfit.distributed.env import peer_lost

    text = _error_tail(failure)
    return bool(text) and peer_lost(RuntimeError(text)) is not None


def oom_kills() -> int | None:
    """How many processes the kernel's out-of-memory killer has ended: this machine's
    ``oom_kill`` count (/proc/vmstat, Linux 4.13+) plus this process's memory cgroup's (v2
    memory.events, v1 memory.oom_control: a container's limit); None where neither is
    readable."""
    found = None
    for path, key in _oom_counters():
        try:
            for line in Path(path).read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == key and value.strip().isdigit():
                    found = (found or 0) + int(value)
        except OSError:
            continue
    return found


def _oom_counters() -> list[tuple[str, str]]:
    paths = [("/proc/vmstat", "oom_kill")]
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return paths
    for line in lines:
        _, controllers, where = line.split(":", 2)
        if controllers == "":  # v2
            paths.append((f"/sys/fs/cgroup{where.rstrip('/')}/memory.events", "oom_kill"))
        elif "memory" in controllers.split(","):  # v1: the mount shows this cgroup, or below
            paths.append(("/sys/fs/cgroup/memory/memory.oom_control", "oom_kill"))
    return list(dict.fromkeys(paths))


def _available_gib() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    return "unknown"


def failure_summary(failures: dict, first: set[int], oom_before: int | None = None) -> str:
    """One line: how many workers failed, which rank failed first (not one the agent stopped
    afterwards, nor one that failed because another rank had gone), its exit code and the
    end of its error. A worker ended by SIGKILL while the out-of-memory killer's count rose
    past `oom_before` is said to have run out of memory."""
    if not failures:
        return "the workers failed"
    early = {r: f for r, f in failures.items() if f.pid in first} or failures
    # A rank whose error is that another rank has gone (gloo's "Connection closed by peer")
    # failed because of it, often in the same second, and sometimes first: the other rank
    # may still be exiting (its threads, its files) when the agent stops it. The cause is a
    # rank that recorded an error of its own.
    early = ({r: f for r, f in early.items() if not _lost_a_peer(f)}
             or {r: f for r, f in failures.items() if _error_tail(f) and not _lost_a_peer(f)}
             or early)
    rank = min(early, key=lambda r: (early[r].timestamp, r))
    f = early[rank]
    code = f"{f.exitcode} ({f.signal_name()})" if f.exitcode < 0 else str(f.exitcode)
    tail = _error_tail(f)
    if f.exitcode == -signal.SIGKILL:
        now = oom_kills()
        if oom_before is not None and now is not None and now > oom_before:
            tail = (f"the kernel's out-of-memory killer ended it (oom_kill count {oom_before} "
                    f"-> {now}; {_available_gib()} available now): the job needs more host "
                    "memory than this machine has; use fewer processes per node, ZeRO-3, "
                    "activation checkpointing or a smaller micro-batch (`meshfit plan`)")
        elif not tail:
            tail = ("SIGKILL: the kernel's out-of-memory killer or a kill -9; `dmesg` tells "
                    "which")
    return (f"{len(failures)} worker(s) failed; first: rank {rank} exit code {code}"
            + (f": {tail}" if tail else ""))


def torchrun_args(cfg: LaunchConfig, script: list[str], *, module: bool = False) -> list[str]:
    """torchrun's argument list for `cfg` followed by the script (or module) and its args."""
    port = cfg.master_port or free_port(cfg.master_addr)
    args = [f"--nnodes={cfg.nnodes}", f"--nproc-per-node={cfg.nproc}",
            f"--max-restarts={cfg.max_restarts}"]
    if cfg.max_restarts == 0:
        # Static rendezvous: node ranks as given, the store on master_addr (loopback by
        # default, so a single-node job is not joined from outside).
        args += [f"--node-rank={cfg.node_rank}", f"--master-addr={cfg.master_addr}",
                 f"--master-port={port}"]
    else:
        # The c10d rendezvous can restart the whole group after a failure (--max-restarts);
        # it assigns node ranks itself.
        args += ["--rdzv-backend=c10d", f"--rdzv-endpoint={cfg.master_addr}:{port}"]
        if cfg.nnodes == 1:
            args.append(f"--local-addr={cfg.master_addr}")
    if module:
        args.append("-m")
    return args + script


def _cores() -> int:
    """Cores this process may run on (a SLURM job's or a container's share), else all."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _say_where(cfg: LaunchConfig, target: list[str], prog: str) -> None:
    """A multi-node job's rendezvous is reachable from other machines by design: say where."""
    args = torchrun_args(cfg, target, module=True)
    port = next(a.split("=", 1)[1] for a in args
                if a.startswith(("--master-port=", "--rdzv-endpoint=")))
    where = port if ":" in port else f"{cfg.master_addr}:{port}"
    listens = "on loopback only" if is_loopback(cfg.master_addr) else "on every interface"
    print(f"{prog}: node {cfg.node_rank} of {cfg.nnodes}; the rendezvous store "
          f"is on {where} (node 0 listens there {listens})", file=sys.stderr)


def _attempt_args(cfg: LaunchConfig, target: list[str], attempt: int, ours: bool) -> list[str]:
    """torchrun's arguments for one attempt. Where meshfit restarts the group itself
    (`ours`), each attempt is a job without restarts of its own, on the given port first
    and a fresh one afterwards, told its attempt through the worker's environment."""
    if not ours:
        return torchrun_args(cfg, target, module=True)
    os.environ[RESTART_ENV] = str(attempt)
    os.environ[MAX_RESTARTS_ENV] = str(cfg.max_restarts)
    once = dataclasses.replace(cfg, max_restarts=0,
                               master_port=cfg.master_port if attempt == 0 else None)
    return torchrun_args(once, target, module=True)


def agreed_stop(failures: dict, nproc: int) -> int | None:
    """The exit code when every worker of this node left with the same 128 + SIGTERM or
    SIGINT (as `meshfit train`'s workers do when they stop together on a signal, after a
    checkpoint): a stop, not a failure, and no reason to restart; None otherwise (a worker
    killed by a signal has a negative exit code, not these; the agent's own SIGTERM to a
    worker that was already leaving is allowed beside them)."""
    codes = {f.exitcode for f in failures.values()}
    stops = {128 + signal.SIGTERM, 128 + signal.SIGINT}
    own = codes & stops
    # (a worker still tearing down when the agent ends the others shows the agent's -SIGTERM)
    if len(failures) == nproc and len(own) == 1 and codes <= stops | {-signal.SIGTERM}:
        return own.pop()
    return None


def _attempts(cfg: LaunchConfig, target: list[str], prog: str, say_stopped: bool = True,
              marks: Path | None = None) -> int:
    """Run the job's attempts until one succeeds or none is left; the exit code. With
    `say_stopped` False, workers that stopped together on a signal (`agreed_stop`) have said
    so themselves: their exit code, no summary; they stop on SIGINT themselves too. With
    `marks`, an attempt succeeds only when every worker also marked it finished there."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from meshfit.launch import finished

    parser = torchrun.get_args_parser()
    ours = cfg.nnodes == 1 and cfg.max_restarts > 0
    attempts = cfg.max_restarts + 1 if ours else 1
    with loopback_stores(), quiet_agent(), stopping_workers(sigint=not say_stopped) as first:
        for attempt in range(attempts):
            oom_before = oom_kills()
            try:
                if marks is not None:
                    finished.clear(marks)
                torchrun.run(parser.parse_args(_attempt_args(cfg, target, attempt, ours)))
                return 0 if marks is None else _all_finished(cfg, marks, prog)
            except ChildFailedError as err:
                stopped = agreed_stop(err.failures, cfg.nproc)
                if stopped is not None and not say_stopped:  # the workers said it, once
                    return stopped
                summary = failure_summary(err.failures, first, oom_before)
                first.clear()
                if attempt + 1 == attempts:
                    print(f"{prog}: {summary}", file=sys.stderr, flush=True)
                    return 1
                print(f"{prog}: {summary}; restarting the group ({attempt + 1} of "
                      f"{cfg.max_restarts}) on a fresh port", file=sys.stderr, flush=True)
    return 1


def _all_finished(cfg: LaunchConfig, marks: Path, prog: str) -> int:
    """0 when every worker of this node marked its run finished; else one line and 1 (a
    worker ended with exit code 0 before it was done: `meshfit.launch.finished`)."""
    from meshfit.launch.finished import unfinished

    missing = unfinished(marks, cfg.nproc)
    if not missing:
        return 0
    ranks = ", ".join(map(str, missing))
    where = f" of node {cfg.node_rank}" if cfg.nnodes > 1 else ""
    print(f"{prog}: the worker(s) of local rank {ranks}{where} exited with code 0 but did not "
          "finish the run: something it ran ended the process early (os._exit, an exec, a C "
          "library's exit); the run is not complete", file=sys.stderr, flush=True)
    return 1


def run(cfg: LaunchConfig, script: list[str], *, module: bool = False,
        env: dict[str, str] | None = None, prog: str = "meshfit launch",
        say_stopped: bool = True, finished_marks: bool = False) -> int:
    """Start the job through torch.distributed.run and wait; returns the exit code. `prog` begins
    the launcher's lines; `say_stopped=False` leaves the line about a signal to workers that print
    their own (`meshfit train`'s main rank), and passes them a Ctrl-C as the SIGINT it is.
    `finished_marks`: the workers mark that they finished (`meshfit.launch.finished`); one that
    exits 0 without its mark fails the job.

    A single-node job with --max-restarts is restarted by meshfit, on a fresh loopback port per
    attempt, so no key, address or listener of the failed attempt is seen by the next one (torch
    2.13's in-agent restart reuses the store, and measured 0 of 3 recoveries of a gloo script after
    ``kill -9`` of a worker). Multi-node jobs keep torchrun's own restarts (c10d rendezvous)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    os.environ.update(env or {})
    # torchrun sets one thread per worker (with a warning) when this is unset; share the
    # node's cores among the workers instead, which is the same on small machines.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _cores() // cfg.nproc)))
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    target = [WORKER_ENTRY, *(["-m"] if module else []), *script]
    if cfg.nnodes > 1:
        _say_where(cfg, target, prog)
    from meshfit.launch.finished import FINISHED_ENV

    marks = Path(tempfile.mkdtemp(prefix="meshfit-finished-")) if finished_marks else None
    if marks is not None:
        os.environ[FINISHED_ENV] = str(marks)
    try:
        with owning_descendants():
            return _attempts(cfg, target, prog, say_stopped, marks)
    except SignalException as err:  # the agent passed the signal on to the workers
        if say_stopped:
            name = signal.Signals(err.sigval).name
            print(f"{prog}: stopped by {name}; the workers were ended", file=sys.stderr, flush=True)
        return 128 + int(err.sigval)
    finally:
        for name in (LAUNCHER_PID_ENV, RESTART_ENV, MAX_RESTARTS_ENV, FINISHED_ENV):
            os.environ.pop(name, None)
        if marks is not None:
            shutil.rmtree(marks, ignore_errors=True)
