"""``meshfit launch``: a training script on N processes per node, through `meshfit.launch`;
and the launch flags `meshfit train` shares (`add_launch_flags`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from meshfit import launch
from meshfit.cli import OneLineParser


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
    flag("gpu_ids", default=None, metavar="IDS",
         help="GPUs to use, e.g. 0,2, or all; = --gpus")
    flag("multi_gpu", action="store_true",
         help="accepted (meshfit always starts one process per --num_processes); "
              "checks that there are GPUs and at least 2 processes")
    g.add_argument("--cpu", action="store_true",
                   help="CPU and gloo even where GPUs exist (ACCELERATE_USE_CPU=True, "
                        "MESHFIT_CPU=1)")


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
