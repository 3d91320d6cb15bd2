"""What each process of `meshfit verify` runs (`meshfit.verify.layouts` decides what to run
and compares): `run_config`, a `meshfit train` configuration's first optimizer steps through
the trainer's own `meshfit.train.TrainingRun`, and `run_loop`, a user's step function on
`Accelerator`. Both return the per-step losses (the mean over the data-parallel ranks, on
every rank) and, on global rank 0, the whole model's state dict at the end (and, for the
reference, at the start), gathered from the layout's shards under the model's own names
(`Accelerator.get_state_dict`: FSDP and tensor-parallel shards gathered, pipeline stages
joined, regrouped projections put back).
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from typing import Any, Callable

import torch

from meshfit._quiet import quiet_logs
from meshfit.accelerator import Accelerator
from meshfit.distributed import DistEnv, cpu_requested, init
from meshfit.parallel.request import LayoutRequest
from meshfit.train.config import RunConfig
from meshfit.train.trainer import TrainingRun

DTYPES = {"float64": torch.float64, "float32": torch.float32}


def no_dropout(model: torch.nn.Module) -> int:
    """Dropout off everywhere in `model`: `nn.Dropout` modules, float attributes named
    ``*dropout*`` / ``*pdrop*`` (the reference GPT's attention, transformers' attention
    modules) and those of a transformers config; returns how many were above 0."""
    found = 0

    def zero(obj) -> int:
        n = 0
        for name, value in list(vars(obj).items()):
            if ("dropout" in name or "pdrop" in name) and isinstance(value, float) and value > 0:
                setattr(obj, name, 0.0)
                n += 1
        return n

    for module in model.modules():
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            module.p = 0.0
            found += 1
        found += zero(module)
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "__dict__"):
            found += zero(config)
    return found


def _watch_gradients(optimizer: torch.optim.Optimizer,
                     model: torch.nn.Module) -> dict[str, Any]:
    """The optimizer's eps (Adam's; None for other optimizers) and, filled in before each of
    its steps, the largest gradient element it is given (the tolerance's G) and the names of
    `model`'s trainable parameters that have had no gradient at any step (``unused``: not
    used in the loss, which DDP refuses)."""
    eps = optimizer.param_groups[0].get("eps") if optimizer.param_groups else None
    seen = {"max_grad": 0.0, "eps": float(eps) if isinstance(eps, float) and eps > 0 else None,
            "unused": []}
    names = {id(p): n for n, p in model.named_parameters()}  # (in the model's order)
    order = {i: k for k, i in enumerate(names)}
    never: list[set[int] | None] = [None]

    def before_step(opt, args, kwargs) -> None:
        none = set()
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.grad.numel():
                    seen["max_grad"] = max(seen["max_grad"], float(p.grad.detach().abs().max()))
                elif p.grad is None and p.requires_grad:
                    none.add(id(p))
        never[0] = none if never[0] is None else never[0] & none
        seen["unused"] = [names.get(i, "?") for i in
                          sorted(never[0], key=lambda i: order.get(i, len(order)))]

    optimizer.register_step_pre_hook(before_step)
    return seen


def _copied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` detached from the live tensors (on one process `Accelerator.get_state_dict`
    hands out the parameters themselves)."""
    return {k: v.detach().clone() for k, v in state.items()}


def float64_experts(model: torch.nn.Module) -> torch.nn.Module:
    """A transformers mixture of experts in float64 runs its experts as transformers' "eager"
    loop: its default grouped matmul takes float32 and bfloat16 only (the same sums, one
    expert at a time)."""
    get = getattr(model, "get_experts_implementation", None)
    dtype = next((p.dtype for p in model.parameters()), None)
    if get is not None and dtype == torch.float64 and get().get("") not in (None, "eager"):
        model.set_experts_implementation("eager")
    return model


def run_config(cfg: RunConfig, steps: int, dtype: str, env: DistEnv | None = None, *,
               reference: bool = False) -> dict[str, Any]:
    """`steps` optimizer steps of `cfg`'s run, as `meshfit train` takes them
    (`meshfit.train.TrainingRun`: the same model, data order, accumulation, clipping,
    optimizer and schedule), the model in `dtype` with dropout off. Call on every rank of the
    layout."""
    dropouts = []

    def comparable(model: torch.nn.Module) -> torch.nn.Module:
        dropouts.append(no_dropout(model))
        return float64_experts(model.to(DTYPES[dtype]))

    run = TrainingRun(cfg, env or init(), model_hook=comparable)
    acc = run.accelerator
    # the optimizer that steps (the prepared one wraps it): the largest gradient it is given
    seen = _watch_gradients(run.optimizer.optimizer, run.model) if reference else {}
    initial = _copied(run.state_dict()) if reference else None
    losses = []
    for _ in range(steps):
        mine = run.step().loss  # this rank's micro-batches, in float64
        losses.append(float(acc.reduce(mine, "mean")))  # tp/pp ranks hold the same value
    final = run.state_dict()
    final = _copied(final) if reference else final
    acc.wait_for_everyone()
    return {"losses": losses, "initial": initial, "final": final, "dropouts": dropouts[0],
            "device": str(acc.device), **seen}


def _share(batch, dp: int, rank: int, dtype: torch.dtype, device: torch.device):
    """Data-parallel rank `rank` of `dp`'s contiguous share of the rows of every tensor in
    `batch` (a tensor, or a tuple/list/dict of them), floating tensors in `dtype`."""
    if isinstance(batch, torch.Tensor):
        n = batch.shape[0] // dp
        part = batch[rank * n:(rank + 1) * n]
        if part.is_floating_point():
            part = part.to(dtype)
        return part.to(device)
    if isinstance(batch, dict):
        return {k: _share(v, dp, rank, dtype, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_share(v, dp, rank, dtype, device) for v in batch)
    return batch


def default_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """`compare_layouts`' optimizer when none is given: AdamW, lr 1e-3, torch's defaults."""
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def run_loop(step_fn: Callable, build: Callable, batches: list, request: dict, steps: int,
             dtype: str, make_optimizer: Callable, accelerator_kwargs: dict,
             pipeline_plan=None, env: DistEnv | None = None, *,
             reference: bool = False) -> dict[str, Any]:
    """`steps` calls of ``step_fn(acc, model, optimizer, batch)`` under the layout of
    `request` (`meshfit.parallel.request.LayoutRequest`'s fields), each on this
    data-parallel rank's share of one global batch. Call on every rank of the layout."""
    env = env or init()
    layout = LayoutRequest(**request)  # the layout's [parallel] keys, whole
    acc = Accelerator(parallel=layout, env=env, **(accelerator_kwargs or {}))
    torch.manual_seed(0)
    model = build().to(DTYPES[dtype])
    dropouts = no_dropout(model)
    if acc.parallel.pp > 1:  # (schedule and virtual stages: the request's)
        prepared = acc.prepare_pipeline(model, plan=pipeline_plan,
                                        microbatches=layout.microbatches or acc.parallel.pp)
    else:
        prepared = acc.prepare(model)
    optimizer = make_optimizer(prepared)
    seen = _watch_gradients(optimizer, prepared) if reference else {}
    optimizer = acc.prepare(optimizer)
    initial = _copied(acc.get_state_dict(prepared)) if reference else None
    dp, rank = acc.runtime.dp_size, acc.runtime.dp_rank
    losses = []
    for batch in batches[:steps]:
        loss = step_fn(acc, prepared, optimizer, _share(batch, dp, rank, DTYPES[dtype],
                                                        acc.device))
        mine = torch.as_tensor(loss).detach().double().reshape(()).to(acc.device)
        losses.append(float(acc.reduce(mine, "mean")))
    final = acc.get_state_dict(prepared)
    final = _copied(final) if reference else final
    acc.wait_for_everyone()
    return {"losses": losses, "initial": initial, "final": final, "dropouts": dropouts,
            "device": str(acc.device), **seen}


@contextlib.contextmanager
def quiet():
    """Without torchao's import noise (transformers and peft import it) and DTensor's advice
    on 2-D meshes (two collectives where one would do, logged by every rank at every
    gradient norm and gather): about the libraries, not about the comparison."""
    with quiet_logs(), quiet_logs(("torch.distributed.tensor._redistribute",)):
        yield


@contextlib.contextmanager
def warnings_once(shown: set[str], prefix: str = "meshfit verify"):
    """meshfit's own warnings in a layout's process: those in `shown` (the command showed
    them: every process reads the same data and would repeat them) left out, the others as
    one line ``<prefix>: warning: ...`` as the command shows its own; other libraries'
    warnings as Python shows them."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    previous, seen = warnings.showwarning, set(shown)

    def show(message, category, filename, lineno, file=None, line=None):
        if not os.path.abspath(filename).startswith(package):
            return previous(message, category, filename, lineno, file, line)
        if str(message) not in seen:
            seen.add(str(message))
            print(f"{prefix}: warning: {' '.join(str(message).split())}",
                  file=file or sys.stderr, flush=True)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = previous


def config_rank(rank: int, world_size: int, cfg: RunConfig, steps: int, dtype: str,
                shown: set[str] = frozenset()) -> dict:
    """One rank of a layout's run of a configuration (`meshfit.distributed.spawn`'s target);
    only rank 0's result carries the state dict. `shown`: warnings the command has shown."""
    with quiet(), warnings_once(shown):
        out = run_config(cfg, steps, dtype)
    return out if rank == 0 else {"losses": out["losses"]}


def loop_rank(rank: int, world_size: int, spec: dict) -> dict:
    """One rank of a layout's run of a user's loop (`meshfit.distributed.spawn`'s target)."""
    with quiet():
        out = run_loop(**spec)
    return out if rank == 0 else {"losses": out["losses"]}


def devices_for(worlds: list[int]) -> tuple[bool, str | None]:
    """(CPU only, a note): GPUs when there is one for every process of every layout."""
    if not torch.cuda.is_available() or cpu_requested(None):
        return True, None
    count = torch.cuda.device_count()
    if max(worlds, default=1) > count:
        return True, (f"{count} GPU(s) for layouts of up to {max(worlds)} processes: every run "
                      "on the CPU (gloo)")
    return False, None


def check_rows(batch, dp: int, name: str, index: int) -> None:
    """Every tensor of a global batch has rows that divide by the data-parallel degree."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0 or batch.shape[0] % dp:
            raise ValueError(f"batches[{index}] has {batch.shape[0] if batch.dim() else 0} "
                             f"rows, which layout {name!r} cannot split over its {dp} "
                             "data-parallel ranks; give global batches whose rows divide by "
                             f"{dp}")
    elif isinstance(batch, dict):
        for v in batch.values():
            check_rows(v, dp, name, index)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            check_rows(v, dp, name, index)
