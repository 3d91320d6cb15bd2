"""What a launch starts where (`LaunchConfig`, checked as it is built), from the parsed flags and
the environment (`config_from_args`), one resolver per setting: meshfit's flag, else `accelerate
launch`'s (both given and different: refused), else SLURM (unless --no-slurm), else the default. A
resolver returns its setting (with a note where SLURM gave it) or raises its one-line ValueError;
`config_from_args` runs them in the order their refusals are checked: accelerate's own rules, the
flags that name one setting twice, the GPUs, SLURM, then nodes, this node's rank, processes per node
and the rendezvous. The namespace is `meshfit launch`'s or `meshfit train`'s (`meshfit.cli.launch`:
meshfit's launch flags are None where not given; only `meshfit launch` has accelerate's). ``--gpus
0,2`` exposes those devices, in that order, as the multi-GPU guide does by hand with
``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER=PCI_BUS_ID``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from meshfit.launch.slurm import SlurmFacts, slurm_facts


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    nproc: int = 1  # Worker processes on this node (torchrun's --nproc-per-node)
    nnodes: int = 1  # Number of nodes (machines) in the job
    node_rank: int = 0  # This node's rank among the nodes, 0 .. nnodes-1
    master_addr: str = "127.0.0.1"  # Address of node 0, which hosts the rendezvous store
    master_port: int | None = None  # The rendezvous store's; None: a free one (single node)
    max_restarts: int = 0  # How often the agent restarts the whole group after a worker fails
    gpus: tuple[int, ...] | None = None  # CUDA devices to use, in order (None: all visible)

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
    """``0,2`` -> (0, 2): distinct device indices, as `flag` gives them."""
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
    # PCI bus order: the indices are nvidia-smi's (CUDA's default is fastest first).
    return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpus)}


def visible_cuda_devices() -> int:
    """CUDA devices this machine has, counted in PCI bus order before any selection."""
    import torch  # (this module is torch-free at load: flags are refused before torch loads)

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


ACCELERATE_PRECISIONS = ("no", "fp16", "bf16", "fp8")
"""``accelerate launch --mixed_precision`` choices (Accelerate 1.15); meshfit runs no fp8."""


@dataclass(frozen=True, kw_only=True)
class AccelerateFlags:
    """`accelerate launch`'s flags as given (None or False: not given; `meshfit train` has
    none of them). ``--main_process_port=0`` (a free port, one machine only) is `free_port`,
    with main_process_port None."""

    num_processes: int | None = None
    num_machines: int | None = None
    machine_rank: int | None = None
    main_process_ip: str | None = None
    main_process_port: int | None = None
    free_port: bool = False
    mixed_precision: str | None = None
    gpu_ids: str | None = None
    multi_gpu: bool = False
    cpu: bool = False


class Given(NamedTuple):
    """One setting as the flags give it: its value (None: neither flag was given) and the
    flag and value it came from, as an error names it ("" when not given)."""

    value: Any
    flag: str


def accelerate_flags(ns: argparse.Namespace) -> AccelerateFlags:
    """Accelerate's flags, checked by Accelerate's own rules (and meshfit's: no fp8)."""
    names = ("num_processes", "num_machines", "machine_rank", "main_process_ip",
             "main_process_port", "mixed_precision", "gpu_ids")
    given = {n: getattr(ns, n, None) for n in names}  # absent from `meshfit train`'s flags
    cpu, multi_gpu = bool(getattr(ns, "cpu", False)), bool(getattr(ns, "multi_gpu", False))
    if cpu and multi_gpu:  # accelerate's own rule
        raise ValueError("--cpu and --multi_gpu exclude each other (as in accelerate launch); "
                         "give one")
    mp = given["mixed_precision"]
    if mp is not None and mp not in ACCELERATE_PRECISIONS:
        raise ValueError(f"--mixed_precision={mp!r} must be one of "
                         f"{', '.join(ACCELERATE_PRECISIONS[:3])} or fp8")
    # fp8: the script's Accelerator reads it (bf16 autocast with torchao's float8 linears;
    # it refuses in one line on a device that cannot run float8)
    for name in ("num_processes", "num_machines"):
        if given[name] is not None and given[name] < 1:
            raise ValueError(f"--{name}={given[name]} must be >= 1")
    free = given["main_process_port"] == 0  # accelerate: 0 picks a free port
    if free:
        given["main_process_port"] = None
    return AccelerateFlags(**given, free_port=free, multi_gpu=multi_gpu, cpu=cpu)


_SHARED = {  # setting: (what it is, accelerate's flag for it)
    "nnodes": ("the number of nodes", "num_machines"),
    "node_rank": ("this node's rank", "machine_rank"),
    "master_addr": ("the address of node 0", "main_process_ip"),
    "master_port": ("the rendezvous port", "main_process_port")}


def given_settings(ns: argparse.Namespace, acc: AccelerateFlags) -> dict[str, Given]:
    """The settings that both meshfit's flags and accelerate's name, as given; both given
    with different values is refused."""
    out = {}
    for name, (what, theirs) in _SHARED.items():
        mine, mine_flag = getattr(ns, name), f"--{name.replace('_', '-')}"
        other, other_flag = getattr(acc, theirs), f"--{theirs}"
        if mine is not None and other is not None and mine != other:
            raise ValueError(f"{mine_flag}={mine} and {other_flag}={other} both set {what} and "
                             "disagree; give one of them")
        if mine is not None:
            out[name] = Given(mine, f"{mine_flag}={mine}")
        else:
            out[name] = Given(other, "" if other is None else f"{other_flag}={other}")
    if acc.free_port and ns.master_port is not None:
        raise ValueError(f"--master-port={ns.master_port} and --main_process_port=0 (a free "
                         "port) disagree; give one of them")
    return out


def resolve_gpus(ns: argparse.Namespace, acc: AccelerateFlags) -> tuple[int, ...] | None:
    """The CUDA devices to use, in order (None: all visible ones)."""
    gpus = parse_gpus(ns.gpus) if ns.gpus is not None else None
    if acc.gpu_ids is not None:
        ids = None if acc.gpu_ids.strip() == "all" else parse_gpus(acc.gpu_ids, "--gpu_ids")
        if ns.gpus is not None and ids != gpus:
            raise ValueError(f"--gpus={ns.gpus} and --gpu_ids={acc.gpu_ids} both choose the "
                             "GPUs and disagree; give one of them")
        gpus = ids
    if acc.cpu and gpus is not None:
        raise ValueError("--cpu runs on the CPU; drop --gpus / --gpu_ids (or --cpu)")
    return gpus


def resolve_slurm(ns: argparse.Namespace, environ: Mapping[str, str]) -> SlurmFacts | None:
    """The SLURM job this launcher runs in (None: outside SLURM, or --no-slurm); one
    launcher per node."""
    slurm = None if ns.no_slurm else slurm_facts(environ)
    if slurm is not None and slurm.tasks_here is not None and slurm.tasks_here > 1:
        raise ValueError(f"srun started {slurm.tasks_here} tasks on this node "
                         f"(SLURM_STEP_TASKS_PER_NODE={environ['SLURM_STEP_TASKS_PER_NODE']}), "
                         "each one a launcher; meshfit starts the processes itself: run "
                         "`srun --ntasks-per-node=1 meshfit ...`")
    return slurm


def resolve_nnodes(given: Given, slurm: SlurmFacts | None,
                   environ: Mapping[str, str]) -> tuple[int, str]:
    """The number of nodes, and what SLURM said when it gave it."""
    if given.value is not None or slurm is None:
        return (1 if given.value is None else given.value), ""
    nnodes = slurm.nnodes
    note = f"{nnodes} node(s)" + (f" ({slurm.nodelist_var}={environ[slurm.nodelist_var]})"
                                  if slurm.nodelist_var else "")
    if nnodes > 1 and not slurm.in_step:
        raise ValueError(f"this SLURM job has {nnodes} nodes but meshfit was started once, "
                         "outside srun (no SLURM_STEP_ID): start it on every node with "
                         "`srun --ntasks-per-node=1 meshfit ...`, or pass --nnodes 1")
    return nnodes, note


def _slurm_job(slurm: SlurmFacts | None, nnodes: int) -> bool:
    """Whether this is SLURM's multi-node job, whose node rank and rendezvous SLURM gives."""
    return slurm is not None and nnodes == slurm.nnodes and nnodes > 1


def resolve_node_rank(given: Given, nnodes_given: Given, nnodes: int,
                      slurm: SlurmFacts | None) -> tuple[int, str]:
    """This node's rank among the `nnodes`."""
    node_rank, note = given.value, ""
    if node_rank is None and _slurm_job(slurm, nnodes):
        node_rank = slurm.node_rank
        note = f"this is node {node_rank} (SLURM_NODEID)"
    node_rank = 0 if node_rank is None else node_rank
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"{given.flag or f'--node-rank={node_rank}'} must be in "
                         f"0..{nnodes - 1} ({nnodes_given.flag or f'--nnodes={nnodes}'})")
    return node_rank, note


def resolve_nproc(ns: argparse.Namespace, acc: AccelerateFlags, nnodes: int,
                  slurm: SlurmFacts | None) -> tuple[int, str]:
    """Processes on this node: --nproc, else accelerate's --num_processes (a total over the
    machines) / machines, else SLURM (one per GPU of this node; on CPU nodes, or with --cpu,
    the job's tasks per node), else 1."""
    per_node, total = None, acc.num_processes
    if total is not None:
        if total % nnodes:
            raise ValueError(f"--num_processes={total} is the total over all {nnodes} machines "
                             "(accelerate's meaning) and must be a multiple of it")
        if acc.multi_gpu and total < 2:  # accelerate's own rule
            raise ValueError(f"--multi_gpu needs at least 2 processes; --num_processes={total}")
        per_node = total // nnodes
    if ns.nproc is not None and per_node is not None and ns.nproc != per_node:
        raise ValueError(f"--nproc={ns.nproc} (processes per node) and --num_processes="
                         f"{total} ({per_node} per node over {nnodes} machine(s)) "
                         "disagree; give one of them")
    nproc = ns.nproc if ns.nproc is not None else per_node
    if nproc is not None or slurm is None:
        return (1 if nproc is None else nproc), ""
    if slurm.gpus_on_node and not acc.cpu:
        return slurm.gpus_on_node, \
            f"{slurm.gpus_on_node} process(es) per node (SLURM_GPUS_ON_NODE)"
    if slurm.tasks_per_node:
        return slurm.tasks_per_node, \
            f"{slurm.tasks_per_node} process(es) per node (SLURM_NTASKS_PER_NODE)"
    return 1, ""


def resolve_master_addr(given: Given, nnodes: int, slurm: SlurmFacts | None) -> tuple[str, str]:
    """The address of node 0 (loopback for a single node)."""
    if given.value is None and _slurm_job(slurm, nnodes) and slurm.master_addr is not None:
        return slurm.master_addr, \
            f"rendezvous host {slurm.master_addr} ({slurm.master_addr_from})"
    return given.value or "127.0.0.1", ""


def resolve_master_port(given: Given, acc: AccelerateFlags, nnodes: int,
                        slurm: SlurmFacts | None) -> tuple[int | None, str]:
    """The rendezvous port (None: a free one, single node only)."""
    port, note = given.value, ""
    if port is None and not acc.free_port and _slurm_job(slurm, nnodes):
        port, note = slurm.master_port, f"port {slurm.master_port} ({slurm.master_port_from})"
    if acc.free_port and nnodes > 1:
        raise ValueError("--main_process_port=0 (a free port) works on one machine only: every "
                         "machine must name the same port")
    return port, note


def worker_environment(gpus: tuple[int, ...] | None, nproc: int,
                       acc: AccelerateFlags) -> dict[str, str]:
    """What the workers' environment gains: the chosen GPUs, and accelerate's
    --mixed_precision and --cpu as Accelerate passes them (--cpu also MESHFIT_CPU=1)."""
    env = gpu_environment(gpus, nproc, visible_cuda_devices()) if gpus else {}
    if acc.mixed_precision is not None:
        env["ACCELERATE_MIXED_PRECISION"] = acc.mixed_precision
    if acc.cpu:
        env.update(ACCELERATE_USE_CPU="True", MESHFIT_CPU="1")
    return env


def config_from_args(ns: argparse.Namespace, environ: Mapping[str, str] | None = None
                     ) -> tuple[LaunchConfig, dict[str, str], list[str]]:
    """Validated launch settings, the extra worker environment, and lines saying what was
    taken from SLURM (print them before starting); raises a one-line ValueError."""
    environ = os.environ if environ is None else environ
    acc = accelerate_flags(ns)
    given = given_settings(ns, acc)
    gpus = resolve_gpus(ns, acc)
    slurm = resolve_slurm(ns, environ)
    nnodes, nodes_note = resolve_nnodes(given["nnodes"], slurm, environ)
    node_rank, rank_note = resolve_node_rank(given["node_rank"], given["nnodes"], nnodes, slurm)
    nproc, nproc_note = resolve_nproc(ns, acc, nnodes, slurm)
    addr, addr_note = resolve_master_addr(given["master_addr"], nnodes, slurm)
    port, port_note = resolve_master_port(given["master_port"], acc, nnodes, slurm)
    if acc.multi_gpu and visible_cuda_devices() == 0:
        raise ValueError("--multi_gpu: this machine has no CUDA devices; drop it (meshfit "
                         "launch starts the processes either way) or use --cpu")
    cfg = LaunchConfig(nproc=nproc, nnodes=nnodes, node_rank=node_rank, master_addr=addr,
                       master_port=port, max_restarts=ns.max_restarts, gpus=gpus)
    env = worker_environment(gpus, cfg.nproc, acc)
    derived = [n for n in (nodes_note, rank_note, nproc_note, addr_note, port_note) if n]
    notes = []
    if slurm is not None and derived:
        step = " step" if slurm.in_step else " (batch script, no srun step)"
        notes.append(f"SLURM job {slurm.job_id}{step}: " + ", ".join(derived))
    return cfg, env, notes
