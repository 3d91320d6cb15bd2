"""`meshfit launch`: torch.distributed.run (torchrun's elastic agent) with safer defaults.

meshfit does not re-implement the launcher: it builds torchrun's argument list and runs
``torch.distributed.run`` in this process. Differences from plain torchrun:

* a single-node job binds its rendezvous to 127.0.0.1 on a free port (torchrun's default is
  29500 on every interface, which collides between jobs);
* ``--gpus 0,2`` chooses the devices and their order, as the multi-GPU guide does by hand with
  ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER=PCI_BUS_ID``;
* every argument is checked before any process starts (a --master-port in use included);
* a single-node job with ``--max-restarts`` is restarted by meshfit, the whole group with a new
  agent on a fresh loopback port per attempt (multi-node jobs keep torchrun's restarts);
* workers die with the launcher (Linux's parent-death signal), Ctrl-C or SIGTERM end the job
  with one line, and a failure is summed up in one line naming the rank that failed first.

The workers see exactly torchrun's environment (started through `_enter_worker`, which
execs the same command), so a script written for torchrun runs
unchanged under `meshfit launch` and the other way round.

`accelerate launch`'s common flags are accepted beside meshfit's own, with Accelerate's
meaning (`add_accelerate_arguments`; ``--num_processes`` is the total over all machines);
``--mixed_precision`` and ``--cpu`` reach the script as Accelerate passes them, in
``ACCELERATE_MIXED_PRECISION`` and ``ACCELERATE_USE_CPU`` (``--cpu`` also sets meshfit's
``MESHFIT_CPU=1``). Inside a SLURM job the node count, this node's rank, the processes per
node and the rendezvous address and port come from ``SLURM_*`` variables (`slurm_facts`) for
whatever the flags leave open.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import ipaddress
import os
import socket
import sys
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

from meshfit.distributed.spawn import free_port


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """What to start where."""

    nproc: int = 1
    """Worker processes on this node (torchrun's --nproc-per-node)."""
    nnodes: int = 1
    """Number of nodes (machines) in the job."""
    node_rank: int = 0
    """This node's rank among the nodes, 0 .. nnodes-1."""
    master_addr: str = "127.0.0.1"
    """Address of node 0, which hosts the rendezvous store."""
    master_port: int | None = None
    """Port of the rendezvous store; None: a free port (single node only)."""
    max_restarts: int = 0
    """How often the agent restarts the whole group after a worker fails."""
    gpus: tuple[int, ...] | None = None
    """CUDA devices to use, in this order (None: all visible ones)."""

    def __post_init__(self) -> None:
        for name in ("nproc", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)} must be >= 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank={self.node_rank} must be in 0..{self.nnodes - 1} "
                             f"(--nnodes={self.nnodes})")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts={self.max_restarts} must be >= 0")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError(f"--master-port={self.master_port} must be in 1..65535")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("--master-port is required with --nnodes > 1: every node must "
                             "name the same port on --master-addr")


def parse_gpus(text: str, flag: str = "--gpus") -> tuple[int, ...]:
    try:
        ids = tuple(int(x) for x in text.split(",") if x.strip() != "")
    except ValueError:
        raise ValueError(f"{flag}={text!r} must be a comma-separated list of device indices, "
                         f"e.g. {flag} 0,2") from None
    if not ids or len(set(ids)) != len(ids) or min(ids) < 0:
        raise ValueError(f"{flag}={text!r} must list distinct device indices >= 0, e.g. 0,2")
    return ids


def gpu_environment(gpus: tuple[int, ...], nproc: int, available: int) -> dict[str, str]:
    """Environment that exposes `gpus`, in that order, to the workers."""
    missing = [g for g in gpus if g >= available]
    if missing:
        have = f"devices 0..{available - 1}" if available else "no CUDA devices"
        raise ValueError(f"--gpus names device(s) {','.join(map(str, missing))} but this machine "
                         f"has {have}; list only existing devices (nvidia-smi -L shows them)")
    if nproc > len(gpus):
        raise ValueError(f"--nproc={nproc} is more than the {len(gpus)} device(s) in --gpus; "
                         "start one process per device")
    # PCI bus order makes the indices match nvidia-smi's (CUDA's default is fastest first).
    return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpus)}


def visible_cuda_devices() -> int:
    """CUDA devices this machine has, counted in PCI bus order before any selection."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


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


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def loopback_stores():
    """Make every TCPStore server the launcher starts for a loopback address listen on
    that address only.

    PyTorch's TCPStore server listens on every interface whatever address it is given
    (measured with torch 2.13: ``*:PORT`` for host "127.0.0.1"), so a single-node job's
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
                    and _is_loopback(host_name)):
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


def _cores() -> int:
    """Cores this process may run on (a SLURM job's or a container's share), else all."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def master_port_in_use(cfg: LaunchConfig) -> None:
    """One-line ValueError when node 0's rendezvous port is already taken, before anything
    starts (the store's bind would otherwise fail inside the agent, or a restart would wait
    on someone else's listener). Other nodes connect to node 0 and bind nothing."""
    if cfg.master_port is None or cfg.node_rank != 0:
        return
    host = cfg.master_addr if _is_loopback(cfg.master_addr) or cfg.nnodes == 1 else ""
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
            where = f"{cfg.master_addr}:{cfg.master_port}" if host else \
                f"port {cfg.master_port}"
            raise ValueError(f"--master-port={cfg.master_port}: {where} is not free "
                             f"({err.strerror}); give another port, or leave --master-port out "
                             "for a free one (single node)") from None


LAUNCHER_PID_ENV = "MESHFIT_LAUNCHER_PID"
RESTART_ENV = "MESHFIT_RESTART_COUNT"
MAX_RESTARTS_ENV = "MESHFIT_MAX_RESTARTS"
"""The attempt of a single-node job that meshfit restarts itself (0 on the first) and the
restarts allowed: `_enter_worker` hands them to the worker as torchrun's own
TORCHELASTIC_RESTART_COUNT and TORCHELASTIC_MAX_RESTARTS (each attempt's agent counts 0)."""


def _enter_worker(argv: list[str]) -> None:
    """``python -m meshfit.train.launch ARGS``: how the agent starts each worker. Asks Linux to
    SIGKILL this process when the launcher dies (PR_SET_PDEATHSIG; kept across exec), checks
    that the launcher was not already gone before that took effect, then replaces itself with
    ``python -u ARGS``, the command torchrun would have run: same PID, same environment
    (with the restart count of the whole job where meshfit restarts it)."""
    launcher = os.environ.pop(LAUNCHER_PID_ENV, "")
    restart, most = os.environ.pop(RESTART_ENV, ""), os.environ.pop(MAX_RESTARTS_ENV, "")
    if restart.isdigit() and most.isdigit():
        os.environ["TORCHELASTIC_RESTART_COUNT"] = restart
        os.environ["TORCHELASTIC_MAX_RESTARTS"] = most
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1: PR_SET_PDEATHSIG
    if launcher.isdigit() and os.getppid() != int(launcher):
        sys.exit(f"meshfit launch: the launcher (PID {launcher}) ended before this worker "
                 "started; not running it")
    os.execv(sys.executable, [sys.executable, "-u", *argv])


@contextlib.contextmanager
def _stopping_workers():
    """How the agent stops its workers, adjusted; yields the PIDs of the workers that had
    failed when it began stopping the rest (it terminates the others, exit code -15, and
    reports them as failed too, with timestamps of one-second resolution).

    The agent passes the signal it got on to the workers: a Ctrl-C (SIGINT) would raise
    KeyboardInterrupt in every Python worker, one traceback each. They get SIGTERM instead
    (`meshfit train`'s workers treat both alike: checkpoint, one line)."""
    import signal

    from torch.distributed.elastic.multiprocessing import api

    real = api.SubprocessContext._close
    first: set[int] = set()

    def _close(self, death_sig, timeout: int = 30):
        if not getattr(self, "_meshfit_closing", False):
            self._meshfit_closing = True
            first.update(f.pid for f in self._failures.values())
        if death_sig == signal.SIGINT:
            death_sig = signal.SIGTERM
        return real(self, death_sig, timeout)

    api.SubprocessContext._close = _close
    try:
        yield first
    finally:
        api.SubprocessContext._close = real


class _AgentNoise:
    """A logging filter for torch's elastic agent: keeps its errors, drops its per-worker
    warnings and its "failed (exitcode ...)" line, which meshfit's summary replaces."""

    def filter(self, record) -> bool:
        return record.levelno >= 40 and not str(record.msg).startswith("failed (exitcode")


@contextlib.contextmanager
def _quiet_agent():
    import logging

    if os.environ.get("LOGLEVEL"):  # asked for torch's own logs: leave them
        yield
        return
    quiet = _AgentNoise()
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


def failure_summary(failures: dict, first: set[int]) -> str:
    """One line: how many workers failed, which rank failed first (not one the agent stopped
    afterwards), its exit code and the end of its error."""
    if not failures:
        return "the workers failed"
    early = {r: f for r, f in failures.items() if f.pid in first} or failures
    rank = min(early, key=lambda r: (early[r].timestamp, r))
    f = early[rank]
    code = str(f.exitcode)
    if f.exitcode < 0:
        code += f" ({f.signal_name()})"
    tail = _error_tail(f)
    return (f"{len(failures)} worker(s) failed; first: rank {rank} exit code {code}"
            + (f": {tail}" if tail else ""))


def run(cfg: LaunchConfig, script: list[str], *, module: bool = False,
        env: dict[str, str] | None = None, prog: str = "meshfit launch",
        say_stopped: bool = True) -> int:
    """Start the job through torch.distributed.run and wait; returns the exit code.
    `prog` begins the launcher's lines; `say_stopped=False` leaves the line about a signal
    to workers that print their own (`meshfit train`'s main rank).

    Each worker runs through `_enter_worker`, so it dies with this process. A single-node
    job with --max-restarts is restarted by meshfit: after a failure the whole group is
    started again by a new agent on a fresh loopback port, so no key, address or listener
    of the failed attempt is seen by the next one (torch 2.13's in-agent restart reuses the
    store, and measured 0 of 3 recoveries of a gloo script after ``kill -9`` of a worker).
    Multi-node jobs keep torchrun's own restarts (c10d rendezvous)."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    os.environ.update(env or {})
    # torchrun sets one thread per worker (with a warning) when this is unset; share the
    # node's cores among the workers instead, which is the same on small machines.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _cores() // cfg.nproc)))
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    target = [__name__, *(["-m"] if module else []), *script]
    parser = torchrun.get_args_parser()
    if cfg.nnodes > 1:  # reachable from other machines by design: say where
        args = torchrun_args(cfg, target, module=True)
        port = next(a.split("=", 1)[1] for a in args
                    if a.startswith(("--master-port=", "--rdzv-endpoint=")))
        where = port if ":" in port else f"{cfg.master_addr}:{port}"
        listens = "on loopback only" if _is_loopback(cfg.master_addr) else \
            "on every interface"
        print(f"{prog}: node {cfg.node_rank} of {cfg.nnodes}; the rendezvous store "
              f"is on {where} (node 0 listens there {listens})", file=sys.stderr)
    ours = cfg.nnodes == 1 and cfg.max_restarts > 0
    attempts = cfg.max_restarts + 1 if ours else 1
    try:
        with loopback_stores(), _quiet_agent(), _stopping_workers() as first:
            for attempt in range(attempts):
                if ours:
                    os.environ[RESTART_ENV] = str(attempt)
                    os.environ[MAX_RESTARTS_ENV] = str(cfg.max_restarts)
                    once = dataclasses.replace(
                        cfg, max_restarts=0, master_port=cfg.master_port if attempt == 0
                        else None)
                    args = torchrun_args(once, target, module=True)
                else:
                    args = torchrun_args(cfg, target, module=True)
                try:
                    torchrun.run(parser.parse_args(args))
                    return 0
                except ChildFailedError as err:
                    summary = failure_summary(err.failures, first)
                    first.clear()
                    if attempt + 1 == attempts:
                        print(f"{prog}: {summary}", file=sys.stderr, flush=True)
                        return 1
                    print(f"{prog}: {summary}; restarting the group ({attempt + 1} of "
                          f"{cfg.max_restarts}) on a fresh port", file=sys.stderr, flush=True)
    except SignalException as err:  # the agent passed the signal on to the workers
        import signal

        if say_stopped:
            name = signal.Signals(err.sigval).name
            print(f"{prog}: stopped by {name}; the workers were ended", file=sys.stderr,
                  flush=True)
        return 128 + int(err.sigval)
    finally:
        for name in (LAUNCHER_PID_ENV, RESTART_ENV, MAX_RESTARTS_ENV):
            os.environ.pop(name, None)
    return 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """meshfit's own launch flags (`meshfit launch` and `meshfit train`). Their defaults are
    None so that a flag that was given can be told from one that was not: SLURM and
    accelerate's flags fill in only what was not given (`config_from_args`)."""
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


# ---------------------------------------------------------------- accelerate launch's flags
ACCELERATE_PRECISIONS = ("no", "fp16", "bf16", "fp8")
"""``accelerate launch --mixed_precision`` choices (Accelerate 1.15); meshfit runs no fp8."""


def add_accelerate_arguments(parser: argparse.ArgumentParser) -> None:
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
    flag("gpu_ids", default=None, metavar="IDS",
         help="GPUs to use, e.g. 0,2, or all; = --gpus")
    flag("multi_gpu", action="store_true",
         help="accepted (meshfit always starts one process per --num_processes); "
              "checks that there are GPUs and at least 2 processes")
    g.add_argument("--cpu", action="store_true",
                   help="CPU and gloo even where GPUs exist (ACCELERATE_USE_CPU=True, "
                        "MESHFIT_CPU=1)")


def _accelerate_given(ns: argparse.Namespace) -> dict:
    names = ("num_processes", "num_machines", "machine_rank", "main_process_ip",
             "main_process_port", "mixed_precision", "gpu_ids")
    out = {n: getattr(ns, n, None) for n in names}
    out["multi_gpu"] = bool(getattr(ns, "multi_gpu", False))
    out["cpu"] = bool(getattr(ns, "cpu", False))
    return out


def _pick(name: str, mine, mine_flag: str, theirs, theirs_flag: str):
    """The value of one setting given as meshfit's flag and/or accelerate's; both given with
    different values is refused. Returns (value, the flag text it came from) or (None, "")."""
    if mine is not None and theirs is not None and mine != theirs:
        raise ValueError(f"{mine_flag}={mine} and {theirs_flag}={theirs} both set {name} and "
                         "disagree; give one of them")
    if mine is not None:
        return mine, f"{mine_flag}={mine}"
    if theirs is not None:
        return theirs, f"{theirs_flag}={theirs}"
    return None, ""


# ------------------------------------------------------------------------------------ SLURM
def _split_outside_brackets(text: str, what: str) -> list[str]:
    items, depth, current = [], 0, []
    for ch in text:
        if ch == "[":
            if depth:
                raise ValueError(f"{what}={text!r}: nested '[' in a host range")
            depth = 1
        elif ch == "]":
            if not depth:
                raise ValueError(f"{what}={text!r}: ']' without '['")
            depth = 0
        if ch == "," and not depth:
            items.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth:
        raise ValueError(f"{what}={text!r}: '[' without ']'")
    items.append("".join(current))
    return items


_MAX_HOSTS = 1 << 16


def _expand_host(item: str, what: str, text: str) -> list[str]:
    start = item.find("[")
    if start < 0:
        return [item]
    end = item.index("]", start)
    prefix, inner, rest = item[:start], item[start + 1:end], item[end + 1:]
    values: list[str] = []
    for part in inner.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"{what}={text!r}: {part!r} in [{inner}] is not a number or a "
                             "range of numbers like 01-03")
        if not dash:
            values.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"{what}={text!r}: range {part!r} runs backwards")
        if int(hi) - int(lo) >= _MAX_HOSTS:
            raise ValueError(f"{what}={text!r}: range {part!r} is longer than {_MAX_HOSTS}")
        # Slurm keeps the lower bound's width: node[08-10] -> node08..node10, [9-10] -> 9, 10
        values += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]
    tails = _expand_host(rest, what, text)
    return [prefix + v + t for v in values for t in tails]


def expand_nodelist(text: str, what: str = "SLURM_JOB_NODELIST") -> list[str]:
    """The host names of a SLURM node list, in order: ``node[01-03,07],gpu-a`` ->
    node01, node02, node03, node07, gpu-a (a bracket keeps its lower bound's zero padding;
    several brackets in one name expand left to right). In Python: ``scontrol show
    hostnames`` may not exist where the launcher runs. One-line ValueError naming `what`."""
    hosts: list[str] = []
    for item in _split_outside_brackets(text.strip(), what):
        item = item.strip()
        if not item:
            raise ValueError(f"{what}={text!r} has an empty host name")
        hosts += _expand_host(item, what, text)
        if len(hosts) > _MAX_HOSTS:
            raise ValueError(f"{what}={text!r} names more than {_MAX_HOSTS} hosts")
    return hosts


def expand_tasks_per_node(text: str, what: str = "SLURM_STEP_TASKS_PER_NODE") -> list[int]:
    """SLURM's compressed counts per node: ``2(x3),1`` -> [2, 2, 2, 1]."""
    out: list[int] = []
    for part in text.strip().split(","):
        count, repeat, times = part.strip().partition("(x")
        if repeat:
            times = times.removesuffix(")") if times.endswith(")") else "?"
        if not count.isdigit() or (repeat and not times.isdigit()):
            raise ValueError(f"{what}={text!r} is not SLURM's form N or N(xK), comma-separated")
        out += [int(count)] * (int(times) if times else 1)
    return out


@dataclass(frozen=True)
class SlurmFacts:
    """What a SLURM job says about this launcher's place in it."""

    job_id: str
    in_step: bool
    """Started by ``srun`` (SLURM_STEP_ID set), not by the batch script itself."""
    nnodes: int
    node_rank: int
    hosts: tuple[str, ...]
    nodelist_var: str
    gpus_on_node: int | None
    """SLURM_GPUS_ON_NODE: one process per GPU."""
    tasks_per_node: int | None
    """SLURM_NTASKS_PER_NODE: the tasks per node the job asked for (on CPU nodes, or --cpu)."""
    tasks_here: int | None
    """Tasks srun started on this node (each one is a launcher)."""
    master_addr: str | None
    master_addr_from: str
    master_port: int
    master_port_from: str


def _slurm_int(environ: Mapping[str, str], *names: str) -> tuple[int | None, str]:
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            # SLURM_GPUS_ON_NODE and SLURM_NTASKS_PER_NODE are plain counts
            if not value.isdigit():
                raise ValueError(f"{name}={value!r} is not a count; meshfit reads it as the "
                                 "SLURM job's (pass --no-slurm to ignore SLURM)")
            return int(value), name
    return None, ""


def slurm_facts(environ: Mapping[str, str] | None = None) -> SlurmFacts | None:
    """The launch settings a SLURM job implies, or None outside SLURM (no SLURM_JOB_ID).

    Inside an ``srun`` step the step's variables count (SLURM_STEP_NUM_NODES,
    SLURM_STEP_NODELIST, SLURM_NODEID: this node's index in the step's list); in the batch
    script itself, the job's (SLURM_JOB_NUM_NODES or SLURM_NNODES, SLURM_JOB_NODELIST,
    node 0). Processes per node (chosen by `config_from_args`): SLURM_GPUS_ON_NODE (one per
    GPU), else SLURM_NTASKS_PER_NODE.
    Rendezvous (used with several nodes): MASTER_ADDR or the node list's first host, and
    MASTER_PORT or 10000 + job id mod 20000 (the same on every node, below Linux's ephemeral
    ports)."""
    environ = os.environ if environ is None else environ
    job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    if not job_id:
        return None
    in_step = bool(environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID"))
    count_vars = ("SLURM_STEP_NUM_NODES",) if in_step else ()
    nnodes, nnodes_var = _slurm_int(environ, *count_vars, "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
    list_vars = (("SLURM_STEP_NODELIST",) if in_step else ()) + \
        ("SLURM_JOB_NODELIST", "SLURM_NODELIST")
    nodelist_var = next((v for v in list_vars if environ.get(v, "").strip()), "")
    hosts = expand_nodelist(environ[nodelist_var], nodelist_var) if nodelist_var else []
    if nnodes is None:
        nnodes = len(hosts) or 1
    elif hosts and len(hosts) != nnodes:
        raise ValueError(f"{nodelist_var}={environ[nodelist_var]!r} names {len(hosts)} host(s) "
                         f"but {nnodes_var}={nnodes}; pass --nnodes and --master-addr (or "
                         "--no-slurm)")
    node_rank, _ = _slurm_int(environ, "SLURM_NODEID")
    node_rank = node_rank or 0
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"SLURM_NODEID={node_rank} is not below the {nnodes} node(s) of "
                         f"{nnodes_var or nodelist_var}; pass --node-rank (or --no-slurm)")
    tasks_here = None
    if in_step and environ.get("SLURM_STEP_TASKS_PER_NODE", "").strip():
        per_node = expand_tasks_per_node(environ["SLURM_STEP_TASKS_PER_NODE"])
        if node_rank < len(per_node):
            tasks_here = per_node[node_rank]
    gpus_on_node, _ = _slurm_int(environ, "SLURM_GPUS_ON_NODE")
    tasks_per_node, _ = _slurm_int(environ, "SLURM_NTASKS_PER_NODE")
    if environ.get("MASTER_ADDR", "").strip():
        addr, addr_from = environ["MASTER_ADDR"].strip(), "MASTER_ADDR"
    else:
        addr = hosts[0] if hosts else None
        addr_from = f"the first host of {nodelist_var}"
    port_text = environ.get("MASTER_PORT", "").strip()
    if port_text:
        if not port_text.isdigit():
            raise ValueError(f"MASTER_PORT={port_text!r} is not a port number")
        port, port_from = int(port_text), "MASTER_PORT"
    else:
        number = int(job_id) if job_id.isdigit() else zlib.crc32(job_id.encode())
        port, port_from = 10000 + number % 20000, "10000 + SLURM job id mod 20000"
    return SlurmFacts(job_id=job_id, in_step=in_step, nnodes=nnodes, node_rank=node_rank,
                      hosts=tuple(hosts), nodelist_var=nodelist_var,
                      gpus_on_node=gpus_on_node, tasks_per_node=tasks_per_node, tasks_here=tasks_here, master_addr=addr,
                      master_addr_from=addr_from, master_port=port, master_port_from=port_from)


# ------------------------------------------------------------------------ one configuration
def config_from_args(ns: argparse.Namespace, environ: Mapping[str, str] | None = None
                     ) -> tuple[LaunchConfig, dict[str, str], list[str]]:
    """Validated launch settings, the extra worker environment, and lines saying what was
    taken from SLURM (print them before starting); raises a one-line ValueError.

    Each setting comes from meshfit's flag, else accelerate's (both given and different:
    refused), else SLURM (`slurm_facts`, unless --no-slurm), else the default."""
    environ = os.environ if environ is None else environ
    acc = _accelerate_given(ns)
    if acc["cpu"] and acc["multi_gpu"]:  # accelerate's own rule
        raise ValueError("--cpu and --multi_gpu exclude each other (as in accelerate launch); "
                         "give one")
    mp = acc["mixed_precision"]
    if mp is not None and mp not in ACCELERATE_PRECISIONS:
        raise ValueError(f"--mixed_precision={mp!r} must be one of "
                         f"{', '.join(ACCELERATE_PRECISIONS[:3])}")
    if mp == "fp8":
        raise ValueError("--mixed_precision=fp8: meshfit has no fp8 training; use bf16 or fp16")
    for name in ("num_processes", "num_machines"):
        if acc[name] is not None and acc[name] < 1:
            raise ValueError(f"--{name}={acc[name]} must be >= 1")
    port_zero = acc["main_process_port"] == 0  # accelerate: 0 picks a free port
    if port_zero:
        acc["main_process_port"] = None

    nnodes, nnodes_from = _pick("the number of nodes", ns.nnodes, "--nnodes",
                                acc["num_machines"], "--num_machines")
    node_rank, rank_from = _pick("this node's rank", ns.node_rank, "--node-rank",
                                 acc["machine_rank"], "--machine_rank")
    addr, _ = _pick("the address of node 0", ns.master_addr, "--master-addr",
                    acc["main_process_ip"], "--main_process_ip")
    port, _ = _pick("the rendezvous port", ns.master_port, "--master-port",
                    acc["main_process_port"], "--main_process_port")
    if port_zero and ns.master_port is not None:
        raise ValueError(f"--master-port={ns.master_port} and --main_process_port=0 (a free "
                         "port) disagree; give one of them")
    gpus = parse_gpus(ns.gpus) if ns.gpus is not None else None
    if acc["gpu_ids"] is not None:
        ids = None if acc["gpu_ids"].strip() == "all" else parse_gpus(acc["gpu_ids"], "--gpu_ids")
        if ns.gpus is not None and ids != gpus:
            raise ValueError(f"--gpus={ns.gpus} and --gpu_ids={acc['gpu_ids']} both choose the "
                             "GPUs and disagree; give one of them")
        gpus = ids
    if acc["cpu"] and gpus is not None:
        raise ValueError("--cpu runs on the CPU; drop --gpus / --gpu_ids (or --cpu)")

    slurm = None if getattr(ns, "no_slurm", False) else slurm_facts(environ)
    notes: list[str] = []
    derived: list[str] = []
    if slurm is not None and slurm.tasks_here is not None and slurm.tasks_here > 1:
        raise ValueError(f"srun started {slurm.tasks_here} tasks on this node "
                         f"(SLURM_STEP_TASKS_PER_NODE={environ['SLURM_STEP_TASKS_PER_NODE']}), "
                         "each one a launcher; meshfit starts the processes itself: run "
                         "`srun --ntasks-per-node=1 meshfit ...`")
    if nnodes is None and slurm is not None:
        nnodes = slurm.nnodes
        derived.append(f"{nnodes} node(s)" + (f" ({slurm.nodelist_var}="
                                              f"{environ[slurm.nodelist_var]})"
                                              if slurm.nodelist_var else ""))
        if nnodes > 1 and not slurm.in_step:
            raise ValueError(f"this SLURM job has {nnodes} nodes but meshfit was started once, "
                             "outside srun (no SLURM_STEP_ID): start it on every node with "
                             "`srun --ntasks-per-node=1 meshfit ...`, or pass --nnodes 1")
    nnodes = 1 if nnodes is None else nnodes
    if node_rank is None and slurm is not None and nnodes == slurm.nnodes and nnodes > 1:
        node_rank = slurm.node_rank
        derived.append(f"this is node {node_rank} (SLURM_NODEID)")
    node_rank = 0 if node_rank is None else node_rank
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"{rank_from or f'--node-rank={node_rank}'} must be in "
                         f"0..{nnodes - 1} ({nnodes_from or f'--nnodes={nnodes}'})")

    # processes on this node: --nproc, else --num_processes / machines, else SLURM, else 1
    per_node = None
    if acc["num_processes"] is not None:
        total = acc["num_processes"]
        if total % nnodes:
            raise ValueError(f"--num_processes={total} is the total over all {nnodes} machines "
                             "(accelerate's meaning) and must be a multiple of it")
        per_node = total // nnodes
        if acc["multi_gpu"] and total < 2:  # accelerate's own rule
            raise ValueError(f"--multi_gpu needs at least 2 processes; --num_processes={total}")
    if ns.nproc is not None and per_node is not None and ns.nproc != per_node:
        raise ValueError(f"--nproc={ns.nproc} (processes per node) and --num_processes="
                         f"{acc['num_processes']} ({per_node} per node over {nnodes} machine(s)) "
                         "disagree; give one of them")
    nproc = ns.nproc if ns.nproc is not None else per_node
    if nproc is None and slurm is not None:
        # one process per GPU of this node; on CPU nodes (or --cpu) the job's tasks per node
        if slurm.gpus_on_node and not acc["cpu"]:
            nproc = slurm.gpus_on_node
            derived.append(f"{nproc} process(es) per node (SLURM_GPUS_ON_NODE)")
        elif slurm.tasks_per_node:
            nproc = slurm.tasks_per_node
            derived.append(f"{nproc} process(es) per node (SLURM_NTASKS_PER_NODE)")
    nproc = 1 if nproc is None else nproc

    if nnodes > 1 and slurm is not None and nnodes == slurm.nnodes:
        if addr is None and slurm.master_addr is not None:
            addr = slurm.master_addr
            derived.append(f"rendezvous host {addr} ({slurm.master_addr_from})")
        if port is None and not port_zero:
            port = slurm.master_port
            derived.append(f"port {port} ({slurm.master_port_from})")
    if port_zero and nnodes > 1:
        raise ValueError("--main_process_port=0 (a free port) works on one machine only: every "
                         "machine must name the same port")
    if acc["multi_gpu"] and visible_cuda_devices() == 0:
        raise ValueError("--multi_gpu: this machine has no CUDA devices; drop it (meshfit "
                         "launch starts the processes either way) or use --cpu")
    cfg = LaunchConfig(nproc=nproc, nnodes=nnodes, node_rank=node_rank,
                       master_addr=addr or "127.0.0.1", master_port=port,
                       max_restarts=ns.max_restarts, gpus=gpus)
    env = gpu_environment(gpus, cfg.nproc, visible_cuda_devices()) if gpus else {}
    if mp is not None:
        env["ACCELERATE_MIXED_PRECISION"] = mp
    if acc["cpu"]:
        env.update(ACCELERATE_USE_CPU="True", MESHFIT_CPU="1")
    if slurm is not None and derived:
        step = " step" if slurm.in_step else " (batch script, no srun step)"
        notes.append(f"SLURM job {slurm.job_id}{step}: " + ", ".join(derived))
    return cfg, env, notes


if __name__ == "__main__":  # a worker's entry: see `_enter_worker`
    _enter_worker(sys.argv[1:])
