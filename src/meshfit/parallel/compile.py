"""torch.compile for training: each transformer block, or the whole model, in place.

    apply_compile(model)                      # inductor, one compiled block reused L times
    apply_compile(model, scope="model")       # one graph for the model (more graph breaks)
    stats = compile_stats()                   # did dynamo really compile anything?

Per-block compile is torchtitan's default: all blocks share one class, so dynamo traces the
block once and reuses the graph for every layer (parameters are graph inputs), which keeps
cold-compile time independent of depth, and the model's own Python (loss, pipeline or
FSDP hooks around blocks) stays eager. `nn.Module.compile` compiles in place, so parameter
names and state_dict keys do not change (no `_orig_mod.` prefix as `torch.compile(model)`
would add).

Order: `meshfit.parallel.parallelize`'s. With FSDP2, compile blocks before sharding: a
whole-model compile of a sharded model can silently run eager (a graph break on FSDP's
dynamo-disabled hooks skips the frame, and no kernel is produced), which is why `compile_stats`
exists: check `graphs > 0` after the first step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

from torch import nn

from meshfit._compat import dynamo
from meshfit.parallel.activation import find_blocks
from meshfit.parallel.options import CompileScope, check_backend_mode, check_compile_args

__all__ = ["CompileScope", "CompileStats", "apply_compile", "check_compile_args",
           "compile_stats"]


def apply_compile(model: nn.Module, *, backend: str = "inductor", mode: str | None = None,
                  scope: CompileScope = "block", fullgraph: bool = False,
                  dynamic: bool | None = None) -> nn.Module:
    """Compile `model` in place with torch.compile; returns `model`. scope="block": each
    block `meshfit.parallel.activation.find_blocks` finds. `mode` is an inductor mode and
    needs backend="inductor". `fullgraph=True` turns graph breaks into errors;
    `dynamic=None` lets dynamo mark shapes dynamic after the first recompile."""
    _validate(backend, mode, scope)
    options = dict(backend=backend, mode=mode, fullgraph=fullgraph, dynamic=dynamic)
    modules = find_blocks(model) if scope == "block" else [model]
    for module in modules:
        module.compile(**options)
    return model


@dataclass(frozen=True)
class CompileStats:
    """Counts from dynamo's counters (`meshfit._compat.dynamo.counters`), per process.
    `torch.compiler.reset()` does not clear them: compare two snapshots."""

    frames: int
    """Python frames dynamo converted successfully."""
    graphs: int
    """FX graphs handed to the backend; 0 means everything ran eager."""
    graph_breaks: int
    """Graph breaks (each splits a frame into more graphs and falls back to Python)."""


def compile_stats() -> CompileStats:
    """What torch.compile did so far in this process. Read it before and after the first step
    of a compiled model: if `graphs` did not grow, that model ran eager (later steps reuse
    the graphs, so only the first step adds to it)."""
    counters = dynamo.counters()
    return CompileStats(frames=counters["frames"]["ok"],
                        graphs=counters["stats"]["unique_graphs"],
                        graph_breaks=sum(counters["graph_break"].values()))


def _validate(backend: object, mode: str | None, scope: str) -> None:
    if scope not in get_args(CompileScope):
        raise ValueError(f"apply_compile: scope={scope!r} is not one of "
                         f"{', '.join(get_args(CompileScope))}")
    check_backend_mode(backend, mode, "backend", "mode", where="apply_compile: ")
