"""Run Hugging Face Accelerate's own test scripts (``accelerate/test_utils/scripts/``, from the
installed accelerate) in this process, one after another (one launch for all of them), under
Accelerate as written or under meshfit with only their imports changed, and record each
test function's outcome.

    python runner.py --framework meshfit --out DIR
    python -m torch.distributed.run --nproc-per-node 2 runner.py --framework accelerate --out DIR

The change (`as_meshfit`): ``accelerate`` becomes ``meshfit`` in every import statement, but
``accelerate.test_utils`` (the scripts' fixtures: a regression dataset and model, and two
helpers reading the framework's state) becomes `fixtures`, this folder's, which takes the
dataset and model from Accelerate (plain torch) and the two helpers on meshfit's state. One
more change, made under both frameworks: `test_sync`'s gradient-accumulation matrix (the
``split_batches`` x ``dispatch_batches`` x ``sync_each_batch`` cases) runs on CPUs too
(`enable_cpu_matrix`; Accelerate runs it on accelerators only).

A test function is a function of the script called by its ``main`` (each call counts once:
``training_check`` runs twice, the matrix 8 + 7 times); each call is wrapped so that a failure
is recorded and the script goes on. Writes ``DIR/<framework>-<processes>-rank<r>.jsonl``, one
line per call, as it goes (a hang keeps what ran): ``{"script", "function", "ok", "error"}``.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib.util
import json
import os
import re
import sys
import time
import traceback
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = ["test_ops", "test_sync", "test_script", "test_distributed_data_loop"]
# Scripts of this folder, in the same form, for what Accelerate's scripts leave untested
# (its examples' LocalSGD), run in the same launches.
OURS = ["local_sgd_script"]
# Calls that cannot end under a framework on CPU processes, recorded as failed, not run.
NOT_RUN = {("accelerate", "test_can_join_uneven_inputs"):
           "not run: Accelerate's join_uneven_inputs does nothing on CPU processes (MULTI_CPU), "
           "so rank 0's second backward waits for rank 1's forever"}


def script_path(name: str) -> Path:
    """The installed accelerate's script (found without importing accelerate), or this
    folder's (`OURS`)."""
    if name in OURS:
        return HERE / f"{name}.py"
    spec = importlib.util.find_spec("accelerate")
    return Path(spec.origin).parent / "test_utils" / "scripts" / f"{name}.py"


def as_meshfit(source: str) -> str:
    """`source` with ``accelerate`` replaced in its import statements (module docstring)."""
    source = re.sub(r"^(\s*from\s+)accelerate\.test_utils(\.testing)?\b", r"\1fixtures",
                    source, flags=re.MULTILINE)
    return re.sub(r"^(\s*)(from|import)(\s+)accelerate\b", r"\1\2\3meshfit", source,
                  flags=re.MULTILINE)


def enable_cpu_matrix(source: str) -> str:
    """test_sync's accumulation matrix on CPU processes too: MULTI_CPU joins the device types
    its two matrix conditions list (the first condition lists it already: harmless)."""
    return source.replace("DistributedType.MULTI_HPU,",
                          "DistributedType.MULTI_HPU,\n        DistributedType.MULTI_CPU,")


def called_by_main(tree: ast.Module) -> set[str]:
    """Names of the script's own functions that its ``main`` calls."""
    functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)} - {"main"}
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    return {c.func.id for c in ast.walk(main) if isinstance(c, ast.Call)
            and isinstance(c.func, ast.Name) and c.func.id in functions}


def load(name: str, framework: str) -> tuple[types.ModuleType, set[str]]:
    path = script_path(name)
    source = path.read_text()
    if name == "test_sync":
        source = enable_cpu_matrix(source)
    if framework == "meshfit":
        source = as_meshfit(source)
    module = types.ModuleType(f"accelerate_suite_{name}")
    module.__file__ = str(path)
    exec(compile(source, str(path), "exec"), module.__dict__)  # noqa: S102 - accelerate's own
    return module, called_by_main(ast.parse(source))


def recorded(function, name: str, script: str, write, not_run: str | None = None):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        if not_run is not None:
            write({"script": script, "function": name, "ok": False, "error": not_run})
            return None
        try:
            out = function(*args, **kwargs)
        except BaseException as err:  # noqa: BLE001 - recorded (pytest's too); the script goes on
            if isinstance(err, (KeyboardInterrupt, SystemExit)):
                raise
            lines = traceback.format_exception(err)
            write({"script": script, "function": name, "ok": False,
                   "error": "".join(lines[-6:])[-1500:]})
            return None
        write({"script": script, "function": name, "ok": True, "error": ""})
        return out
    return wrapper


def reset(framework: str, index: int) -> None:
    """Both frameworks keep their state in process-wide singletons, and each script ends by
    releasing the process group: start each script afresh, as a launch of its own would,
    the process group joined again (on the launcher's store, under a prefix of its own: a
    second rendezvous through ``env://`` waits for ranks that already went through it)."""
    import torch.distributed as dist

    package = "accelerate" if framework == "accelerate" else "meshfit"
    state = importlib.import_module(f"{package}.state")
    state.AcceleratorState._reset_state(reset_partial_state=True)
    state.GradientState._reset_state()
    if "WORLD_SIZE" not in os.environ:
        return
    if dist.is_initialized():  # the script did not release it
        dist.destroy_process_group()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.PrefixStore(f"accelerate_suite/{index}", dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    # gloo's init returns on a rank once its own end of each connection is made, not its
    # peer's: the connecting side of a pair is done when its sequence number is written, while
    # the accepting side may not have read it yet. A script that makes no collective call
    # (Accelerate's test_ops builds `PartialState()` without `cpu=True`: non-distributed on
    # CPU processes) then releases the group at once, and a peer still inside the init (a
    # loaded machine) fails with "Gloo connectFullMesh failed ... Connection closed by peer".
    # Torch's own barrier after init (TORCH_DIST_INIT_BARRIER) is off by default: a barrier on
    # the store (no gloo traffic), every rank leaving only once every rank's init returned.
    store.set(f"joined/{rank}", "1")
    store.wait([f"joined/{r}" for r in range(world)])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--framework", choices=["accelerate", "meshfit"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--scripts", default=",".join(OURS + SCRIPTS))
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    import torch

    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    out = Path(args.out) / f"{args.framework}-{world}-rank{rank}.jsonl"
    work = Path(args.out) / f"{args.framework}-{world}-cwd"
    work.mkdir(parents=True, exist_ok=True)
    os.chdir(work)  # test_script writes a file in the working directory
    with open(out, "w") as sink:
        def write(record: dict) -> None:
            sink.write(json.dumps(record) + "\n")
            sink.flush()

        for index, name in enumerate(args.scripts.split(",")):
            began = time.perf_counter()
            module, tests = load(name, args.framework)
            for test in tests:
                not_run = NOT_RUN.get((args.framework, test)) if world > 1 else None
                module.__dict__[test] = recorded(module.__dict__[test], test, name, write,
                                                 not_run)
            try:
                module.main()
            except Exception as err:  # noqa: BLE001 - main's own lines failed
                write({"script": name, "function": "main", "ok": False,
                       "error": "".join(traceback.format_exception(err)[-6:])[-1500:]})
            write({"script": name, "function": "(seconds)", "ok": True,
                   "error": f"{time.perf_counter() - began:.1f}"})
            reset(args.framework, index)


if __name__ == "__main__":
    main()
