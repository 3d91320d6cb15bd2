"""The ``meshfit`` command: ``launch`` (torchrun with safer defaults), ``train``, ``export``
(a checkpoint as safetensors, offline), ``pipeline-chart`` (a pipeline run's schedule as
a Gantt chart, with its measured bubble), ``generate`` (sample text from a trained model) and
``eval`` (its loss and perplexity on held-out text; both in `meshfit.train.generate`),
``estimate`` and ``plan`` (per-rank memory of a layout, the best layouts of a cluster;
`meshfit.train.plan_cli`), ``calibrate`` (this machine measured; `meshfit.plan.calibrate`),
``plot`` (runs' metrics drawn; `meshfit.train.plot`) and ``env`` (versions and devices for a
bug report; `meshfit.train.envinfo`). ``meshfit --help`` lists them, ``meshfit --version``.

Every argument is validated before any process is launched or any file is written; errors
are one line naming the option, the value and the fix.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

from meshfit.train import launch
from meshfit.train.args import OneLineParser


_Parser = OneLineParser


def _launch_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="meshfit launch", allow_abbrev=False,
        description="Start a training script on N processes per node (torch.distributed.run). "
                    "accelerate launch's common flags work too; inside a SLURM job the nodes, "
                    "this node's rank, processes per node and the rendezvous come from "
                    "SLURM_* for whatever the flags leave open.")
    launch.add_arguments(p)
    launch.add_accelerate_arguments(p)
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
    _say("launch", notes)
    return launch.run(cfg, [ns.script, *ns.script_args], module=ns.module, env=env)


def _say(command: str, notes: list[str]) -> None:
    """What the launcher took from its surroundings (SLURM), once everything is checked."""
    for note in notes:
        print(f"meshfit {command}: {note}", file=sys.stderr, flush=True)


def _train_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="meshfit train", allow_abbrev=False,
        description="Train the reference GPT (default: the tiny preset on the Python standard "
                    "library's source). Options --section.key=value override the config.")
    launch.add_arguments(p)
    p.add_argument("--config", default=None, help="a TOML run configuration")
    p.add_argument("--out", default=None, help="run folder (default: runs/train-<time>)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its newest complete checkpoint, with "
                        "its saved config ([parallel], [checkpoint] and --nproc may change)")
    p.add_argument("--overwrite", action="store_true",
                   help="start over in an --out that holds a run: its outputs (metrics, "
                        "config, checkpoints, model) are removed once the folder is locked")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p


def _resumed_config(ns, overrides: list[str]):
    """The saved config of the run in --out, with [parallel] / [checkpoint] overrides."""
    from meshfit.train.config import load_config

    if ns.out is None:
        raise ValueError("--resume needs --out, the folder of the run to continue")
    if ns.config is not None:
        raise ValueError("--resume continues with the run's own config (OUT/config.toml); drop "
                         "--config")
    saved = Path(ns.out) / "config.toml"
    if not saved.is_file():
        raise ValueError(f"--resume: {saved} does not exist; give the --out folder of a "
                         "meshfit train run")
    return load_config(saved, overrides, allowed=("parallel", "checkpoint"))


RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
"""torchrun's variables that make a process one rank of a job: `meshfit train` starts its
own ranks, so finding them set (left over from a job, or `meshfit train` itself started under
torchrun) is refused rather than joining a job that does not exist."""


def _refuse_inherited_ranks() -> None:
    found = [f"{n}={os.environ[n]}" for n in RANK_VARIABLES if n in os.environ]
    if found:
        raise ValueError(f"{', '.join(found)} set in the environment: meshfit train starts its "
                         "own processes (--nproc) and gives each its rank; unset "
                         f"{' '.join(n.split('=')[0] for n in found)} (or run your own script "
                         "under meshfit launch / torchrun)")


def cmd_train(argv: list[str]) -> int:
    ns, rest = _train_parser().parse_known_args(argv)
    overrides = _collect_overrides(rest)
    if not ns.worker:  # the launcher's arguments first: their refusals need no torch
        _refuse_inherited_ranks()
        launch_cfg, env, notes = launch.config_from_args(ns)
        launch.master_port_in_use(launch_cfg)
    from meshfit.train.config import load_config

    if ns.resume and not ns.worker:
        cfg = _resumed_config(ns, overrides)
    else:
        cfg = load_config(ns.config, overrides)
    out = Path(ns.out or f"runs/train-{time.strftime('%Y%m%d-%H%M%S')}")
    if ns.worker:  # started by the launcher below: one rank of the job
        from meshfit.train.run import Diverged, Preempted, Stalled
        from meshfit.train.trainer import train

        try:
            train(cfg, out, resume=ns.resume)
        except Preempted as stopped:
            return _stopped(stopped)
        except Diverged as err:  # every rank knows; the main one says it
            _record_error(err)
            return _stopped(err, code=1)
        except Stalled as err:  # only the ranks that waited know: each says it
            _record_error(err)
            print(f"meshfit train: error: {err}", file=sys.stderr, flush=True)
            return 1
        except (ValueError, TimeoutError) as err:  # one line, in the launcher's summary too
            _record_error(err)
            raise
        except Exception as err:  # a traceback: its last lines in the launcher's summary
            import traceback

            _record_error(err, traceback.format_exc().strip().splitlines()[-3:])
            raise
        from meshfit.distributed import init

        import torch.distributed as dist
        if init().is_distributed and dist.is_initialized():
            # torch 2.13's gloo can abort a process that tears down after DeviceMesh subgroups
            # ("terminate called without an active exception"), turning a finished run into
            # a failed worker: 8 of 10 two-rank runs of a DeviceMesh script under plain
            # torchrun, 1 of 16 after a barrier, 0 of 16 leaving through os._exit. So every
            # rank is done with every group before any tears down (settle_all: no gloo
            # thread needs the GIL afterwards), and a worker whose run is complete (files
            # written, trackers finished) leaves without the interpreter's teardown.
            from meshfit.distributed.settle import settle_all

            settle_all()
            dist.destroy_process_group()
            import logging

            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        return 0
    world_size = launch_cfg.nproc * launch_cfg.nnodes
    cfg.validate_for(world_size, launch_cfg.nproc)  # before any process starts
    from meshfit.train.runfolder import RunLock, atomic_write_text, check_run_folder

    # Node 0 claims the run folder (lock, existing run, --overwrite); the other nodes of a
    # multi-node job join its run and only check that they can write there.
    claim = launch_cfg.node_rank == 0
    check_run_folder(out, resume=ns.resume, overwrite=ns.overwrite, claim=claim)
    from meshfit.train.trainer import preflight

    # this machine's device, kernels and libraries; layouts the guide advises against
    for warning in preflight(cfg, world_size, launch_cfg.nproc):
        print(f"meshfit train: warning: {warning}", file=sys.stderr)
    if ns.resume:
        from meshfit.checkpoint import latest

        if latest(out / "checkpoints") is None:
            raise ValueError(f"--resume: {out / 'checkpoints'} holds no complete checkpoint; "
                             "train with --checkpoint.every=N to write some")
    _say("train", notes)
    if launch_cfg.nproc == 1 and launch_cfg.nnodes == 1 and not env:
        from meshfit.train.run import Preempted
        from meshfit.train.trainer import train

        try:
            with RunLock(out, overwrite=ns.overwrite):
                train(cfg, out, resume=ns.resume)
        except Preempted as stopped:
            return _stopped(stopped)
        return 0
    # Node 0's launcher holds the run folder's lock for the whole job; workers take none.
    # Another node writes its workers' config into a folder of its own (node 0 may be
    # clearing the run folder for --overwrite at the same moment).
    with contextlib.ExitStack() as stack:
        if claim:
            stack.enter_context(RunLock(out, overwrite=ns.overwrite))
            resolved = out / "config.toml"
        else:
            import tempfile

            resolved = Path(stack.enter_context(tempfile.TemporaryDirectory(
                prefix="meshfit-config-"))) / "config.toml"
        atomic_write_text(resolved, cfg.to_toml())
        return launch.run(launch_cfg, ["meshfit.train.cli", "train", "--worker", "--config",
                                       str(resolved), "--out", str(out),
                                       *(["--resume"] if ns.resume else [])], module=True,
                          env=env, prog="meshfit train", say_stopped=False)


def _record_error(err: BaseException, lines: list[str] | None = None) -> None:
    """A worker's error in torch's error file (TORCHELASTIC_ERROR_FILE), where the launcher's
    failure summary reads it: its one line, or the given last lines of its traceback."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    import json

    text = "\n".join(lines) if lines else (str(err).splitlines() or [type(err).__name__])[0]
    try:
        Path(path).write_text(json.dumps({"message": text, "timestamp": int(time.time())}))
    except OSError:
        pass  # the summary then gives the exit code alone


def _stopped(stopped, code: int | None = None) -> int:
    """One line from the main process; exit code 128 + the signal (as a killed process's),
    or `code`."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        error = "" if code is None else "error: "
        print(f"meshfit train: {error}{stopped}", file=sys.stderr, flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 128 + stopped.signum if code is None else code


def _collect_overrides(rest: list[str]) -> list[str]:
    """``--a.b=v`` and ``--a.b v`` forms; anything else is an error naming it."""
    out, i = [], 0
    while i < len(rest):
        item = rest[i]
        if not item.startswith("--") or "." not in item.split("=")[0]:
            raise ValueError(f"unknown argument {item!r}; options are --nproc, --config, --out, "
                             "--resume, --overwrite and config overrides such as --train.steps=100")
        if "=" not in item:
            if i + 1 >= len(rest):
                raise ValueError(f"override {item!r} needs a value, e.g. {item}=100")
            item, i = f"{item}={rest[i + 1]}", i + 1
        out.append(item)
        i += 1
    return out


def _pipeline_chart_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="meshfit pipeline-chart", allow_abbrev=False,
        description="Draw a pipeline-parallel run's schedule (one row per pp rank) and print "
                    "its measured bubble beside the theoretical one.")
    p.add_argument("run", metavar="RUN", help="the run folder of a `meshfit train` with pp > 1")
    p.add_argument("--out", metavar="PNG", default=None,
                   help="the chart's path (default: RUN/pipeline_chart.png)")
    p.add_argument("--step", metavar="N", type=int, default=None,
                   help="the step to draw (default: the last recorded)")
    return p


def cmd_pipeline_chart(argv: list[str]) -> int:
    from meshfit.train.pipeline_chart import describe, draw

    ns = _pipeline_chart_parser().parse_args(argv)
    png, summary = draw(ns.run, ns.out, step=ns.step)
    for line in describe(summary):
        print(line)
    print(f"chart of step {summary['step']}: {png}")
    return 0


def _export_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="meshfit export", allow_abbrev=False,
        description="Write a checkpoint's model as one safetensors file (or a Hugging Face "
                    "folder), offline, in one process, whatever layout and number of "
                    "processes saved it.")
    p.add_argument("source", metavar="CKPT_OR_RUN",
                   help="a checkpoint folder, or a run folder (its newest complete checkpoint)")
    p.add_argument("out", metavar="OUTDIR", help="where model.safetensors (and config.json) go")
    p.add_argument("--to", choices=("safetensors", "hf"), default="safetensors",
                   help="safetensors: model.safetensors; hf: also config.json, for "
                        "transformers' from_pretrained (transformers models only)")
    return p


def cmd_export(argv: list[str]) -> int:
    ns = _export_parser().parse_args(argv)
    from meshfit.checkpoint.export import export

    path = export(ns.source, ns.to, ns.out)
    print(f"meshfit export: wrote {path}")
    return 0


def cmd_generate(argv: list[str]) -> int:
    from meshfit.train.generate_args import check_generate_args

    check_generate_args(argv)  # refusals before torch is imported
    from meshfit.train.generate import cmd_generate as run

    return run(argv)


def cmd_estimate(argv: list[str]) -> int:
    from meshfit.train.plan_cli import cmd_estimate as run

    return run(argv)


def cmd_plan(argv: list[str]) -> int:
    from meshfit.train.plan_cli import cmd_plan as run

    return run(argv)


def cmd_calibrate(argv: list[str]) -> int:
    from meshfit.train.plan_cli import cmd_calibrate as run

    return run(argv)


def cmd_eval(argv: list[str]) -> int:
    from meshfit.train.generate_args import check_eval_args

    check_eval_args(argv)  # refusals before torch is imported
    from meshfit.train.generate import cmd_eval as run

    return run(argv)


def _plot_parser() -> argparse.ArgumentParser:
    from meshfit.train.plot import DPI, FIGSIZE

    p = _Parser(
        prog="meshfit plot", allow_abbrev=False,
        description="Draw runs of `meshfit train` from their metrics.jsonl, overlaid and "
                    "labelled with their folder names: loss and validation loss, learning "
                    "rate, throughput and peak memory against training tokens (step x global "
                    f"batch x seq_len from each run's config.toml); a {FIGSIZE[0] * DPI:.0f} x "
                    f"{FIGSIZE[1] * DPI:.0f} PNG (or .pdf/.svg). Needs matplotlib: "
                    'pip install "meshfit[chart]".')
    p.add_argument("runs", metavar="RUN", nargs="+", help="run folders (meshfit train --out)")
    p.add_argument("-o", "--out", metavar="FILE", default=None,
                   help="where the plot goes (default: RUN/metrics.png for one run, "
                        "meshfit-plot.png here for several)")
    return p


def cmd_plot(argv: list[str]) -> int:
    from meshfit.train.plot import describe, draw

    ns = _plot_parser().parse_args(argv)
    out, runs = draw(ns.runs, ns.out)
    for run in runs:
        print(describe(run))
    print(f"meshfit plot: wrote {out}")
    return 0


def cmd_env(argv: list[str]) -> int:
    _Parser(
        prog="meshfit env", allow_abbrev=False,
        description="Print the versions of meshfit, Python, torch, CUDA/cuDNN/NCCL, the "
                    "devices, the distributed backends, the libraries meshfit works with and "
                    "the environment variables it reads: paste it into a bug report."
    ).parse_args(argv)
    from meshfit.train.envinfo import report

    print(report())
    return 0


COMMANDS = {"launch": cmd_launch, "train": cmd_train, "export": cmd_export,
            "pipeline-chart": cmd_pipeline_chart, "generate": cmd_generate, "eval": cmd_eval,
            "estimate": cmd_estimate, "plan": cmd_plan, "calibrate": cmd_calibrate,
            "plot": cmd_plot, "env": cmd_env}
SUMMARIES = {
    "launch": "start a script on N processes per node (torchrun; accelerate launch's flags; "
              "SLURM)",
    "train": "train a model from a TOML config (+ --section.key=value overrides)",
    "export": "write a checkpoint's model as safetensors or a Hugging Face folder",
    "pipeline-chart": "draw a pipeline-parallel run's schedule and its measured bubble",
    "generate": "sample text from a trained model",
    "eval": "a trained model's loss and perplexity on held-out text",
    "estimate": "per-rank memory of a training step under a layout, before running it",
    "plan": "rank a cluster's layouts that fit in memory by predicted step time",
    "calibrate": "measure this machine's compute, memory and collective speeds for plan",
    "plot": "draw runs' loss, validation loss, throughput and memory against tokens",
    "env": "versions, devices and backends to paste into a bug report",
}
"""One line per command for ``meshfit --help`` (a test checks every command has one)."""


def _help() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: meshfit COMMAND [ARGS...]   (meshfit COMMAND --help for each; "
             "meshfit --version)", "", "commands:"]
    lines += [f"  {name:<{width}}  {SUMMARIES[name]}" for name in COMMANDS]
    return "\n".join(lines)


def _one_line_warnings(prefix: str) -> None:
    """meshfit's own warnings (a rebuilt token cache, a skipped file, ...) as one line
    ``<prefix>: warning: <message>`` on stderr, without Python's source-line echo; other
    libraries' warnings keep Python's format."""
    import warnings

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if not os.path.abspath(filename).startswith(package):
            return shown(message, category, filename, lineno, file, line)
        text = " ".join(str(message).split())
        print(f"{prefix}: warning: {text}", file=file or sys.stderr, flush=True)

    warnings.showwarning = show


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-V", "--version"):
        from meshfit import __version__

        print(f"meshfit {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"meshfit: unknown command {argv[0]!r}; commands: {', '.join(COMMANDS)} "
                  "(meshfit --help)", file=sys.stderr)
            return 2
        print(_help())
        return 0
    _one_line_warnings(f"meshfit {argv[0]}")
    try:
        return COMMANDS[argv[0]](argv[1:])
    except ValueError as err:
        print(f"meshfit {argv[0]}: error: {err}", file=sys.stderr)
        return 2
    except TimeoutError as err:  # a bounded wait ran out (e.g. ranks that never joined)
        print(f"meshfit {argv[0]}: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C before a run's own handler was installed
        print(f"meshfit {argv[0]}: stopped by SIGINT (Ctrl-C)", file=sys.stderr)
        return 128 + 2


if __name__ == "__main__":
    sys.exit(main())
