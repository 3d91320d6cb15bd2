"""SLURM: what a job's ``SLURM_*`` variables say about this launcher's place in it
(`slurm_facts`), for the settings the flags leave open (`meshfit.launch.resolve`)."""

from __future__ import annotations

import os
import zlib
from collections.abc import Mapping
from dataclasses import dataclass


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
    in_step: bool  # Started by ``srun`` (SLURM_STEP_ID set), not by the batch script itself
    nnodes: int
    node_rank: int
    hosts: tuple[str, ...]
    nodelist_var: str
    gpus_on_node: int | None  # SLURM_GPUS_ON_NODE: one process per GPU
    tasks_per_node: int | None  # SLURM_NTASKS_PER_NODE: the tasks per node the job asked for
    tasks_here: int | None  # Tasks srun started on this node (each one is a launcher)
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
    """The launch settings a SLURM job implies, or None outside SLURM (no SLURM_JOB_ID). Inside an
    ``srun`` step the step's variables count (SLURM_STEP_NUM_NODES, SLURM_STEP_NODELIST,
    SLURM_NODEID: this node's index in the step's list); in the batch script itself, the job's
    (SLURM_JOB_NUM_NODES or SLURM_NNODES, SLURM_JOB_NODELIST, node 0). Rendezvous (used with several
    nodes): MASTER_ADDR or the node list's first host, and MASTER_PORT or 10000 + job id mod 20000
    (the same on every node, below Linux's ephemeral ports)."""
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
        raise ValueError(f"{nodelist_var}={environ[nodelist_var]!r} names {len(hosts)} host(s) but "
                         f"{nnodes_var}={nnodes}; pass --nnodes and --master-addr (or --no-slurm)")
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
                      gpus_on_node=gpus_on_node, tasks_per_node=tasks_per_node,
                      tasks_here=tasks_here, master_addr=addr,
                      master_addr_from=addr_from, master_port=port, master_port_from=port_from)
