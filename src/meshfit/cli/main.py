"""``meshfit COMMAND [ARGS...]`` (the console script, and ``python -m meshfit``): the table of
commands, ``meshfit --help`` and ``--version``, and the one way every command ends: a
ValueError is one line ``meshfit CMD: error: ...`` naming the option, the value and the fix,
and exit code 2; a bounded wait that ran out exit code 1; Ctrl-C before a run's own handler
exit code 130.
"""

from __future__ import annotations

import os
import sys
import warnings

from meshfit.cli.calibrate import cmd_calibrate
from meshfit.cli.env import cmd_env
from meshfit.cli.generate import cmd_eval, cmd_export, cmd_generate, cmd_pipeline_chart, cmd_plot
from meshfit.cli.launch import cmd_launch
from meshfit.cli.plan import cmd_estimate, cmd_plan
from meshfit.cli.train import cmd_train

COMMANDS = {"launch": cmd_launch, "train": cmd_train, "export": cmd_export,
            "pipeline-chart": cmd_pipeline_chart, "generate": cmd_generate, "eval": cmd_eval,
            "estimate": cmd_estimate, "plan": cmd_plan, "calibrate": cmd_calibrate,
            "plot": cmd_plot, "env": cmd_env}
SUMMARIES = {  # one line per command for ``meshfit --help`` (a test checks each has one)
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
