"""``meshfit COMMAND [ARGS...]`` (the console script, and ``python -m meshfit``): the table of
commands, ``meshfit --help`` and ``--version``, and the one way every command ends: a
ValueError is one line ``meshfit CMD: error: ...`` naming the option, the value and the fix,
and exit code 2; a bounded wait that ran out, or code the command called that tried to end
its process as if it had finished (`meshfit.launch.finished`), exit code 1; Ctrl-C before a
run's own handler exit code 130. And ``meshfit env``, what to paste into a bug report: the environment
variables shown are those that change how meshfit launches and places work (a fixed list and
prefixes: no other variable is read, so nothing secret is printed).
"""

from __future__ import annotations

import logging
import os
import platform
import sys
import warnings
from importlib import metadata

import meshfit
from meshfit.cli import OneLineParser
from meshfit.cli.calibrate import cmd_calibrate
from meshfit.cli.generate import cmd_eval, cmd_export, cmd_generate, cmd_pipeline_chart, cmd_plot
from meshfit.cli.launch import cmd_launch, cmd_train
from meshfit.cli.plan import cmd_estimate, cmd_plan
from meshfit.cli.verify import cmd_verify

PACKAGES = ("numpy", "safetensors", "transformers", "accelerate", "peft", "datasets",
            "tokenizers", "torchao", "bitsandbytes", "matplotlib", "tensorboard", "wandb",
            "mlflow")
"""Optional (or indirect) dependencies whose version matters in a report."""
ENV_NAMES = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "OMP_NUM_THREADS", "MASTER_ADDR",
             "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "SLURM_JOB_ID",
             "SLURM_JOB_NUM_NODES", "SLURM_JOB_NODELIST", "SLURM_GPUS_ON_NODE",
             "SLURM_NTASKS_PER_NODE", "PYTORCH_CUDA_ALLOC_CONF")
ENV_PREFIXES = ("MESHFIT_", "ACCELERATE_", "NCCL_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_")


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _cores() -> str:
    total = os.cpu_count() or 0
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return f"{total} cores"
    return f"{usable} of {total} cores usable by this process"


def _torch_facts() -> list[tuple[str, str]]:
    import torch
    import torch.distributed as dist

    out = [("torch", f"{torch.__version__} ({os.path.dirname(torch.__file__)})")]
    cuda = torch.version.cuda
    out.append(("torch CUDA build", cuda or "none (a CPU build)"))
    hip = getattr(torch.version, "hip", None)
    if hip:
        out.append(("torch ROCm build", hip))
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    out.append(("cuDNN", str(cudnn) if cudnn else "none"))
    try:
        nccl = torch.cuda.nccl.version()
        nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    except (AttributeError, RuntimeError, TypeError):
        nccl = "none"
    out.append(("NCCL", nccl))
    devices = [f"cpu ({_cores()})"]
    available = torch.cuda.is_available()
    count = torch.cuda.device_count() if available else 0
    for i in range(count):
        p = torch.cuda.get_device_properties(i)
        devices.append(f"cuda:{i} {p.name}, {p.total_memory / 1024 ** 3:.1f} GiB, "
                       f"capability {p.major}.{p.minor}")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        devices.append("mps")
    out.append(("CUDA available", f"yes, {count} device(s)" if available else "no"))
    out.append(("devices", "; ".join(devices)))
    if available:
        out.append(("bf16 on cuda:0", "yes" if torch.cuda.is_bf16_supported() else "no"))
    if dist.is_available():
        backends = []
        for name in ("gloo", "nccl", "mpi", "ucc", "xccl"):
            check = getattr(dist, f"is_{name}_available", None)
            if check is not None:
                backends.append(f"{name} {'yes' if check() else 'no'}")
        out.append(("distributed backends", ", ".join(backends)))
    else:
        out.append(("distributed backends", "torch.distributed is not available in this build"))
    return out


def collect() -> list[tuple[str, str]]:
    """(name, value) pairs, in the order `report` prints them."""
    out = [("meshfit", f"{meshfit.__version__} ({os.path.dirname(meshfit.__file__)})"),
           ("python", f"{platform.python_version()} ({platform.python_implementation()}, "
                      f"{sys.executable})"),
           ("platform", platform.platform())]
    out += _torch_facts()
    out += [(name, _version(name)) for name in PACKAGES]
    shown = sorted(k for k in os.environ if k in ENV_NAMES or k.startswith(ENV_PREFIXES))
    out.append(("environment", ", ".join(f"{k}={os.environ[k][:200]}" for k in shown)
                or "(none of the variables meshfit reads are set)"))
    return out


def report() -> str:
    """`collect` as aligned ``name: value`` lines."""
    facts = collect()
    width = max(len(name) for name, _ in facts)
    return "\n".join(f"{name + ':':<{width + 1}} {value}" for name, value in facts)


def cmd_env(argv: list[str]) -> int:
    OneLineParser("meshfit env", "Print the versions of meshfit, Python, torch, CUDA/cuDNN/NCCL, "
                  "the devices, the distributed backends, the libraries meshfit works with "
                  "and the environment variables it reads: paste it into a bug report."
                  ).parse_args(argv)
    print(report())
    return 0


COMMANDS = {"launch": cmd_launch, "train": cmd_train, "export": cmd_export,
            "pipeline-chart": cmd_pipeline_chart, "generate": cmd_generate, "eval": cmd_eval,
            "estimate": cmd_estimate, "plan": cmd_plan, "calibrate": cmd_calibrate,
            "plot": cmd_plot, "env": cmd_env, "verify": cmd_verify}
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
    "verify": "check layouts against one process: the same steps, losses and weights compared",
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


QUIET_WARNINGS = (
    # peft's PeftModel reads the model's `is_gradient_checkpointing`, which transformers 5
    # deprecates: one FutureWarning per process (each rank, the launcher) wrapping a model
    # with LoRA, about code neither the user nor meshfit wrote.
    (FutureWarning, r"`is_gradient_checkpointing` is deprecated"),
)
"""(category, message) of other libraries' warnings that a command does not show."""


def _quiet_libraries() -> None:
    """A command's output is meshfit's: the notes torchao logs on import where its compiled
    extensions do not match this torch ("Failed to load ..._C_mxfp8...so") and torch's
    pytree deprecation notes about torchao's enums are not shown (errors still are), nor the
    warnings of `QUIET_WARNINGS`. Library users of meshfit keep their own logging and
    warnings configuration: this runs for commands only."""
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    for category, message in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)


SUPERVISED = ("train", "verify", "eval", "generate", "export", "estimate", "plan")
"""The commands that may run code a model folder or a config names: run from the command line,
each runs in a child process the ``meshfit`` process waits on, so that one that exits with
code 0 without having finished (a C library's ``exit(0)`` in that code) fails in one line
(`meshfit.launch.finished.supervise`). A launcher's workers (``--worker``) are not: the
launcher watches them."""


def main(argv: list[str] | None = None, *, supervised: bool | None = None) -> int:
    """The ``meshfit`` command on `argv` (default: this process's arguments); its exit code.
    `supervised` (default: whether `argv` is this process's, as for the console script and
    ``python -m meshfit``) runs a `SUPERVISED` command in a child process that this one waits
    on; called with arguments from Python, the command runs in the calling process."""
    if supervised is None:
        supervised = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-V", "--version"):
        print(f"meshfit {meshfit.__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"meshfit: unknown command {argv[0]!r}; commands: {', '.join(COMMANDS)} "
                  "(meshfit --help)", file=sys.stderr)
            return 2
        print(_help())
        return 0
    _one_line_warnings(f"meshfit {argv[0]}")
    _quiet_libraries()
    # (torch-free, but not on TORCH_FREE's list in tests/test_architecture.py)
    from meshfit.launch.finished import report_end, supervise

    if supervised and argv[0] in SUPERVISED and "--worker" not in argv:
        code = supervise(f"meshfit {argv[0]}")
        if code is not None:  # this process waited; the command ran in its child
            return code
    try:
        return _run(argv)
    finally:
        report_end()  # (in a supervised child: it ended through Python, whatever its code)


def _run(argv: list[str]) -> int:
    from meshfit.launch.finished import ProcessEndRefused

    try:
        return COMMANDS[argv[0]](argv[1:])
    except ValueError as err:
        print(f"meshfit {argv[0]}: error: {err}", file=sys.stderr)
        return 2
    except (TimeoutError, ProcessEndRefused) as err:  # a bounded wait ran out (e.g. ranks
        print(f"meshfit {argv[0]}: error: {err}", file=sys.stderr)  # that never joined); code
        return 1  # the command called tried to end it as if finished
    except KeyboardInterrupt:  # Ctrl-C before a run's own handler was installed
        print(f"meshfit {argv[0]}: stopped by SIGINT (Ctrl-C)", file=sys.stderr)
        return 128 + 2
