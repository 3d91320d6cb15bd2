"""The package's shape, read from its source: layers that import downwards only, no import
cycles between modules or between packages, no private name used across packages, and a
top-level package that imports nothing until asked.

Every `import` and `from ... import` statement counts, also the ones inside functions (a
deferred import is still a dependency). Layers, bottom to top:

    0  meshfit._quiet, meshfit._files,         processes, devices, mesh axes, collectives,
       meshfit._lazy, meshfit._torchao,        the spawner; files written atomically; names
       meshfit._compat, meshfit.distributed    imported on first use; the torchao of a torch;
                                               private torch/transformers names, one door each
    1  meshfit.models, meshfit.data            models with their plans as data; token data
    2  meshfit.parallel, optim, memory, peft,  the techniques; distributed checkpoints;
       meshfit.checkpoint, meshfit.plan,       memory estimates and the layout planner;
       meshfit.tracking, optim_names           experiment trackers; optimizer names
    3  meshfit.accelerator, meshfit.utils,     the facade for users' loops; Accelerate's names
       meshfit.parallelism_config
    4  meshfit.train, meshfit.launch,          the commands: meshfit train (config, preflight,
       meshfit.cli, meshfit.__main__,          loop), the launcher, every subcommand's CLI;
       meshfit.verify, generate, charts,       the rooms above the trainer (verify, sampling,
       meshfit.plan_validate,                  charts, plan --validate); transformers'
       meshfit.transformers                    Trainer on the Accelerator

Packages of one layer may import each other, but never both ways round, and no module
imports a private name (``_x``) from another package.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
LAYERS = [("meshfit._quiet", 0), ("meshfit._files", 0), ("meshfit._lazy", 0),
          ("meshfit._torchao", 0), ("meshfit._compat", 0),
          ("meshfit.distributed", 0), ("meshfit.models", 1),
          ("meshfit.data", 1), ("meshfit.parallel", 2), ("meshfit.optim", 2),
          ("meshfit.optim_names", 2), ("meshfit.memory", 2), ("meshfit.peft", 2),
          ("meshfit.checkpoint", 2),
          ("meshfit.plan", 2), ("meshfit.tracking", 2),
          ("meshfit.accelerator", 3), ("meshfit.state", 3), ("meshfit.data_loader", 3),
          ("meshfit.local_sgd", 3), ("meshfit.logging", 3), ("meshfit.utils", 3),
          ("meshfit.parallelism_config", 3),
          ("meshfit.train", 4), ("meshfit.verify", 4), ("meshfit.generate", 4),
          ("meshfit.charts", 4), ("meshfit.plan_validate", 4), ("meshfit.launch", 4),
          ("meshfit.cli", 4), ("meshfit.__main__", 4), ("meshfit.transformers", 4)]


def _modules() -> dict[str, Path]:
    out = {}
    for path in (SRC / "meshfit").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The meshfit modules `name` imports (a `from package import module` names the module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.c` names a.b.c's module
                target = target.rpartition(".")[0]
            if target.startswith("meshfit") and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, name, modules) for name, path in modules.items()}


def _package(name: str) -> str:
    """The package a module belongs to: meshfit.parallel.tp.styles -> meshfit.parallel."""
    return ".".join(name.split(".")[:2])


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for dep in graph.get(node, ()):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return cycles


def _layer(name: str) -> int | None:
    for prefix, layer in LAYERS:
        if name == prefix or name.startswith(prefix + "."):
            return layer
    return None


def test_every_module_has_a_layer():
    assert [m for m in _graph() if m != "meshfit" and _layer(m) is None] == []


def test_layers_import_downwards_only():
    upward = [f"{a} -> {b}" for a, deps in _graph().items() if a != "meshfit"
              for b in deps if b != "meshfit" and (_layer(b) or 0) > (_layer(a) or 0)]
    assert upward == []


def test_models_name_no_parallel_code():
    # Plans are data: models import nothing from the techniques, the facade or the trainer.
    bad = [f"{a} -> {b}" for a, deps in _graph().items() if a.startswith("meshfit.models")
           for b in deps if not b.startswith(("meshfit.models", "meshfit.distributed",
                                              "meshfit._lazy", "meshfit._compat"))]
    assert bad == []


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_no_cycle_between_packages():
    """Packages of one layer may import each other, but not both ways round (a cycle that
    no module-level check sees: parallel -> checkpoint in one module, checkpoint -> parallel
    in another)."""
    packages: dict[str, set[str]] = {}
    for a, deps in _graph().items():
        packages.setdefault(_package(a), set()).update(
            _package(b) for b in deps if _package(b) != _package(a) and b != "meshfit")
    assert _cycles(packages) == []


def test_the_package_cycle_check_finds_one():
    # The negative control: a two-package loop through different modules is reported.
    graph = {"meshfit.a.x": {"meshfit.b.y"}, "meshfit.b.z": {"meshfit.a.w"}}
    packages: dict[str, set[str]] = {}
    for a, deps in graph.items():
        packages.setdefault(_package(a), set()).update(_package(b) for b in deps)
    assert _cycles(packages) == [["meshfit.a", "meshfit.b"]]


def _private_imports() -> list[str]:
    """`from meshfit.<package>... import _name` in a module of another package."""
    modules = _modules()
    found = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            if not base.startswith("meshfit") or _package(base) == _package(name):
                continue
            found += [f"{name} <- {base}.{a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_no_private_name_is_imported_from_another_package():
    assert _private_imports() == []


def test_top_level_package_imports_nothing_eagerly():
    """`import meshfit.models` runs meshfit/__init__.py first; it must not pull in the rest
    (only `meshfit._lazy`, the standard-library helper that defers the others)."""
    tree = ast.parse((SRC / "meshfit" / "__init__.py").read_text())
    eager = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
             and any("meshfit" in (getattr(n, "module", None) or a.name) for a in n.names)
             and getattr(n, "module", None) != "meshfit._lazy"]
    assert eager == []


def test_the_graph_sees_deferred_imports():
    # A function-level import is an edge too: the facade defers its pipeline import.
    assert "meshfit.parallel.pp" in _graph()["meshfit.accelerator.accelerator"]


# What the `meshfit` command imports when it loads, up to reading a config and checking it for a
# world size: arguments and configs are refused before torch loads (tests/cli/test_fast_start.py
# runs the refusals; this names the module that broke it).
TORCH_FREE = ["meshfit", "meshfit.__main__", "meshfit.cli", "meshfit.cli.main",
              "meshfit.cli.launch", "meshfit.cli.generate", "meshfit.cli.plan",
              "meshfit.cli.calibrate", "meshfit.launch", "meshfit.launch.resolve",
              "meshfit.launch.slurm", "meshfit.launch.torchrun", "meshfit.train",
              "meshfit.train.config", "meshfit.train.configfile", "meshfit.train.tokens",
              "meshfit.train.preflight", "meshfit.distributed",
              "meshfit.distributed.dims", "meshfit.distributed.spawn", "meshfit.models",
              "meshfit.models.config", "meshfit.models.factory", "meshfit.optim_names",
              "meshfit.parallel", "meshfit.parallel.options", "meshfit.parallel.layout",
              "meshfit.parallel.rules", "meshfit.parallel.costs", "meshfit.parallel.mesh",
              "meshfit.parallel.request", "meshfit.parallel.spec", "meshfit.parallel.pp",
              "meshfit.parallel.pp.bubble",
              "meshfit._lazy", "meshfit.data", "meshfit.data.corpus", "meshfit.data.formats",
              "meshfit.cli.verify", "meshfit.verify", "meshfit.verify.layouts", "meshfit._quiet",
              "meshfit.launch.finished",
              "meshfit._compat", "meshfit._compat.distributed", "meshfit._compat._probe",
              "meshfit._compat.dynamo"]


def test_config_modules_import_no_torch_at_load():
    modules = _modules()
    eager = []
    for name in TORCH_FREE:
        for node in ast.parse(modules[name].read_text()).body:  # module level: not functions,
            if isinstance(node, ast.Import):                      # not TYPE_CHECKING blocks
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert not node.level, f"{name}: relative import"
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules
                           else node.module for a in node.names]
            else:
                continue
            eager += [f"{name} -> {t}" for t in targets if t == "torch" or t.startswith(
                "torch.") or (t.startswith("meshfit") and t not in TORCH_FREE)]
    assert eager == []


# ---------------------------------------------------------------------------- deferred imports
# An import inside a function hides a dependency and a cost from the reader. One is kept only
# for an optional dependency, in a torch-free module (TORCH_FREE: the commands refuse bad
# input before torch loads), in a compat door (a private name that moved is reported by its
# `missing()`, not raised when meshfit is imported), or for a part of torch few runs use and
# whose import costs start-up time -- listed here with what it costs (seconds after
# `import torch`, torch 2.13 CPU build, 2 cores) and when it is needed.
REQUIRED = {"torch", "meshfit", "numpy", "rich", "safetensors", "xxhash", "tomli", "tomli_w"}
DOORS = ("meshfit._compat", "meshfit._torchao")
SLOW_IMPORTS = {
    "torch.distributed.checkpoint": "DCP, 0.6 s: a save or a load",
    "meshfit.checkpoint._reader": "subclasses DCP's reader (DCP's 0.6 s): a load",
    "meshfit.checkpoint._writer": "subclasses DCP's writer (DCP's 0.6 s): a save",
    "torch.distributed.tensor": "DTensor, 0.45 s: a sharded layout",
    "torch.distributed.fsdp": "FSDP2, 0.5 s: ZeRO",
    "meshfit.parallel.fsdp": "imports FSDP2 (0.5 s): ZeRO",
    "torch.distributed.optim": "ZeroRedundancyOptimizer, 0.7 s: ZeRO-1",
    "meshfit.parallel.pp": "imports torch.distributed.pipelining (1.0 s): pipeline parallel",
    "meshfit.parallel.tp": "imports DTensor's tensor parallel (0.5 s): tensor parallel",
    "meshfit.peft": "imports peft, an optional dependency: LoRA",
    "meshfit.transformers.trl": "imports trl, an optional dependency: TRL's trainers",
    "torch.utils.tensorboard": "imports tensorboard, an optional dependency",
}


def _deferred(name: str, source: str, modules) -> list[tuple[str, int]]:
    """(target, line) of each import inside a function of module `name`."""
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Import):
                found += [(a.name, node.lineno) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                found += [(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base,
                           node.lineno) for a in node.names]
    return found


def _unexplained_deferrals(sources: dict[str, str], modules) -> tuple[list[str], set[str]]:
    """Deferred imports no rule above explains, and the SLOW_IMPORTS entries that explain one."""
    bad, used = [], set()
    for name, source in sorted(sources.items()):
        if name in TORCH_FREE or name.startswith(DOORS):
            continue
        for target, line in _deferred(name, source, modules):
            top = target.split(".")[0]
            if top not in REQUIRED and top not in sys.stdlib_module_names:
                continue  # an optional dependency
            slow = [k for k in SLOW_IMPORTS if target == k or target.startswith(k + ".")]
            used.update(slow)
            if not slow:
                bad.append(f"{name}:{line} imports {target} inside a function")
    return bad, used


def test_imports_wait_only_for_a_reason():
    modules = _modules()
    bad, used = _unexplained_deferrals(
        {name: path.read_text() for name, path in modules.items()}, modules)
    assert bad == [], "move these to the top of the module (or give the reason in SLOW_IMPORTS)"
    assert set(SLOW_IMPORTS) - used == set(), "no longer deferred anywhere: drop from SLOW_IMPORTS"


def test_the_deferral_check_finds_one():
    modules = _modules()
    source = "def f():\n    import json\n    from torch.distributed.tensor import DTensor\n" \
             "    import wandb\n"
    bad, used = _unexplained_deferrals({"meshfit.somewhere": source}, modules)
    assert bad == ["meshfit.somewhere:2 imports json inside a function"]
    assert used == {"torch.distributed.tensor"}


# ---------------------------------------------------------------------------- sizes
# A room per concern: a file past FILE_LINES or a function past FUNCTION_LINES is split by
# concern before anything is added to it. A function longer than that for a reason that
# splitting would not serve is listed here, with the reason (a table, a generated schema).
FILE_LINES, FUNCTION_LINES = 600, 60
LONG_FILES: dict[str, str] = {}
LONG_FUNCTIONS: dict[str, str] = {}


def _sizes() -> tuple[dict[str, int], dict[str, int]]:
    """({file: lines}, {file:function: lines}) of the package; a function's lines run from
    its `def` (decorators aside) to its last line, docstring included."""
    files, functions = {}, {}
    for path in sorted((SRC / "meshfit").rglob("*.py")):
        rel = str(path.relative_to(SRC))
        text = path.read_text()
        files[rel] = len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                key = f"{rel}:{node.name}"
                functions[key] = max(functions.get(key, 0), node.end_lineno - node.lineno + 1)
    return files, functions


def test_no_file_or_function_past_its_limit():
    files, functions = _sizes()
    long_files = sorted(f"{f} ({n} lines)" for f, n in files.items()
                        if n > FILE_LINES and f not in LONG_FILES)
    long_functions = sorted(f"{f} ({n} lines)" for f, n in functions.items()
                            if n > FUNCTION_LINES and f not in LONG_FUNCTIONS)
    assert long_files == [] and long_functions == []


def test_every_exception_is_still_needed_and_says_why():
    """An entry whose file or function has shrunk below the limit (or is gone) leaves the
    list, and every entry carries its reason."""
    files, functions = _sizes()
    stale = [f for f in LONG_FILES if files.get(f, 0) <= FILE_LINES]
    stale += [f for f in LONG_FUNCTIONS if functions.get(f, 0) <= FUNCTION_LINES]
    assert stale == []
    assert all(isinstance(why, str) and len(why) > 20
               for why in (*LONG_FILES.values(), *LONG_FUNCTIONS.values()))


def test_the_size_check_finds_a_long_function(tmp_path):
    # The negative control: a 61-line function is counted as 61 lines.
    body = "\n".join(f"    x{i} = {i}" for i in range(59))
    tree = ast.parse(f"def f():\n    '''doc'''\n{body}\n")
    (node,) = tree.body
    assert node.end_lineno - node.lineno + 1 == FUNCTION_LINES + 1
