"""Where to cut a model into pipeline stages, and the stage modules cut from it.

The model's `PipelinePlan` (`meshfit.models.plans`) says where its blocks are, what comes
before them (the first stage keeps it) and after them (the last stage keeps it). A stage is a
copy of the model holding only its part, with parameter names unchanged: its blocks stay
under their indices in the full model (a `ModuleDict` loses the others; a `ModuleList`
becomes a `StageBlocks` keyed by the original indices), the parts it does not keep become
None or the plan's stand-ins, and its forward is the plan's.
"""

from __future__ import annotations

import copy
import functools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from meshfit._compat import nn as nn_internals
from meshfit.distributed.tensors import names_by_parameter
from meshfit.models.config import GPTConfig
from meshfit.models.plans import PipelinePlan, pipeline_plan_for
from meshfit.models.plans.transformers_pp import pipeline_plan_problem
from meshfit.models.plans.stage import StageBlocks
from meshfit.parallel.pp.schedule import _sync

__all__ = ["StageBlocks", "block_times", "build_stage_module", "pp_problem", "split_points"]


def resolve_plan(model: nn.Module, plan: PipelinePlan | None) -> PipelinePlan:
    """`plan`, or the built-in one of `model`'s type, checked against the model's layout."""
    plan = plan or pipeline_plan_for(model)
    keys = list(_block_items(plan.blocks_of(model)))
    if keys != [str(i) for i in range(len(keys))]:
        raise ValueError(f"the blocks of {type(model).__name__} at {plan.blocks!r} are keyed "
                         f"{keys[:4]}...; a pipeline needs them keyed '0'..'L-1' in order")
    return plan


def pp_problem(model_or_config, pp: int, virtual_stages: int = 1) -> str | None:
    """Why `model_or_config` cannot be cut into ``pp * virtual_stages`` pipeline stages, in one
    line (None: it can): a model (meshfit's GPT, any transformers causal LM), a `GPTConfig`
    or a transformers configuration. Refused: a model without a pipeline plan (a transformers
    family that ships no ``base_model_pp_plan``, an encoder-decoder, a linear-attention or
    state-space hybrid; `meshfit.models.plans.transformers_pp.pipeline_plan_problem`), and
    more stages than layers (each stage holds at least one)."""
    what = type(model_or_config).__name__
    if isinstance(model_or_config, GPTConfig):
        n = model_or_config.n_layer
    elif isinstance(model_or_config, nn.Module):
        try:
            plan = pipeline_plan_for(model_or_config)
        except ValueError as err:
            return str(err)
        n = len(plan.blocks_of(model_or_config))
    else:  # a transformers configuration (GPT-2's plan is meshfit's own)
        problem = (None if getattr(model_or_config, "model_type", None) == "gpt2"
                   else pipeline_plan_problem(model_or_config))
        if problem:
            return f"no built-in pipeline plan for {what}: {problem}"
        n = model_or_config.num_hidden_layers
    stages = pp * virtual_stages
    if stages > n:
        count = f"pp={pp}" if virtual_stages == 1 else \
            f"pp={pp} x virtual_stages={virtual_stages} = {stages} stages"
        return (f"{count} exceeds the {n} layers of {what} (each stage holds at least one); "
                f"use pp*virtual_stages <= {n}")
    return None


def _block_items(blocks: nn.Module) -> dict[str, nn.Module]:
    return {k: m for k, m in nn_internals.child_slots(blocks).items() if m is not None}


def _submodule(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _params(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


# ---------------------------------------------------------------------------- splitting
def _part_costs(model_or_cfg, plan) -> tuple[float, list[float], float]:
    """(first-stage extras, per-block, last-stage extras) parameter counts.

    A tied head counts on the last stage too: in a pipeline it is a second copy there.
    """
    if isinstance(model_or_cfg, GPTConfig):
        cfg, parts = model_or_cfg, model_or_cfg.param_breakdown()
        head = cfg.vocab_size * cfg.d_model
        return (parts["tok_emb"] + parts["pos_emb"],
                [parts["layers"] / cfg.n_layer] * cfg.n_layer, parts["norm"] + head)
    model = model_or_cfg
    blocks = [_params(b) for b in _block_items(plan.blocks_of(model)).values()]
    first = sum(_params(_submodule(model, n)) for n in plan.first)
    return first, blocks, sum(_params(_submodule(model, n)) for n in plan.last)


def split_points(model_or_cfg, stages: int, *, balance: str = "params",
                 times: Sequence[float] | None = None, points: Sequence[int] | None = None,
                 plan: PipelinePlan | None = None) -> list[int]:
    """Block indices where stages 1..stages-1 begin (stage s holds blocks [b_s, b_{s+1})).

    `model_or_cfg`: a model (its `plan`, default the built-in one) or a `GPTConfig`.
    `balance="params"`: minimise the largest stage's parameter count (the plan's first parts
    with the first stage, its last parts with the last). `balance="time"`: minimise the
    largest stage's time, from `times` = one measured time per block, or [first extras,
    blocks..., last extras] (see `block_times`). `points` given: validated and returned as a
    list. Among partitions with the same maximum, the most even one (least sum of squares)
    wins.
    """
    if isinstance(model_or_cfg, nn.Module):
        plan = resolve_plan(model_or_cfg, plan)
        n = len(plan.blocks_of(model_or_cfg))
    else:
        n = model_or_cfg.n_layer
    if not isinstance(stages, int) or stages < 1 or stages > n:
        raise ValueError(f"stages={stages!r} must be between 1 and the model's {n} blocks")
    if points is not None:
        pts = list(points)
        ints = all(isinstance(p, int) and not isinstance(p, bool) for p in pts)
        if not ints or len(pts) != stages - 1 or pts != sorted(set(pts)) or \
                (pts and not 0 < pts[0] <= pts[-1] < n):
            raise ValueError(f"points={pts} must be {stages - 1} strictly increasing block "
                             f"indices in 1..{n - 1} (where stages 1..{stages - 1} begin)")
        return pts
    if balance == "params":
        first, blocks, last = _part_costs(model_or_cfg, plan)
    elif balance == "time":
        if times is None or len(times) not in (n, n + 2):
            raise ValueError(f"balance='time' needs times= with {n} per-block times (or {n + 2}: "
                             "first extras, blocks, last extras); measure them with block_times()")
        t = [float(x) for x in times]
        first, blocks, last = (t[0], t[1:-1], t[-1]) if len(t) == n + 2 else (0.0, t, 0.0)
    else:
        raise ValueError(f"balance={balance!r} must be 'params' or 'time'")
    costs = list(blocks)
    costs[0] += first
    costs[-1] += last
    return _min_max_partition(costs, stages)


def _min_max_partition(costs: list[float], k: int) -> list[int]:
    # best[s][j]: (max, sum of squares, cuts) for blocks [0, j) in s stages; O(k n^2).
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    best = [{0: (0.0, 0.0, [])}]
    for s in range(1, k + 1):
        row = {}
        for j in range(s, n - (k - s) + 1):
            options = []
            for i, (mx, sq, cuts) in best[s - 1].items():
                if i < j:
                    c = prefix[j] - prefix[i]
                    options.append((max(mx, c), sq + c * c, cuts + [i] if i else cuts))
            row[j] = min(options, key=lambda o: (o[0], o[1]))
        best.append(row)
    return best[k][n][2]


def block_times(model: nn.Module, sample: torch.Tensor, *, repeats: int = 3,
                plan: PipelinePlan | None = None) -> list[float]:
    """Measured forward+backward seconds of [first extras, each block, last extras] on `sample`
    ids [b, T]: each part run alone (cut out as `build_stage_module` cuts stages), median of
    `repeats` runs after one warm-up, CUDA synchronised. For `split_points(balance="time")`."""
    plan = resolve_plan(model, plan)
    n = len(plan.blocks_of(model))
    pieces = [_prune(model, plan, [], first=True, last=False),
              *(_prune(model, plan, [i], first=False, last=False) for i in range(n)),
              _prune(model, plan, [], first=False, last=True)]
    out, x = [], sample
    for piece in pieces:
        runs = []
        for _ in range(repeats + 1):
            inp = x.detach().requires_grad_(x.is_floating_point())
            _sync(x.device)
            t0 = time.perf_counter()
            y = piece(inp)
            y.float().square().mean().backward()
            _sync(x.device)
            runs.append(time.perf_counter() - t0)
        out.append(statistics.median(runs[1:]))
        x = y.detach()
    return out


# ---------------------------------------------------------------------------- stage modules
def stage_range(stage_index: int, num_stages: int, points: Sequence[int], n: int) -> range:
    """The block indices stage `stage_index` holds."""
    bounds = [0, *points, n]
    if len(bounds) != num_stages + 1:
        raise ValueError(f"points={list(points)} gives {len(bounds) - 1} stages, not "
                         f"num_stages={num_stages}; pass split_points(model, {num_stages})")
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"stage_index={stage_index} must be in 0..{num_stages - 1}")
    return range(bounds[stage_index], bounds[stage_index + 1])


def build_stage_module(model: nn.Module, stage_index: int, num_stages: int,
                       points: Sequence[int], *, plan: PipelinePlan | None = None) -> nn.Module:
    """A copy of `model` holding only stage `stage_index`'s part; `model` is not changed.

    Keeps the blocks in [points[s-1], points[s]) under their global keys, the plan's first
    parts on the first stage and its last parts on the last, so parameter names match the
    full model."""
    plan = resolve_plan(model, plan)
    points = split_points(model, num_stages, points=points, plan=plan)  # validated
    keep = stage_range(stage_index, num_stages, points, len(plan.blocks_of(model)))
    return _prune(model, plan, keep, first=stage_index == 0,
                  last=stage_index == num_stages - 1)


def _prune(model: nn.Module, plan: PipelinePlan, keep, *, first: bool, last: bool) -> nn.Module:
    # Only the kept parts are copied: the dropped modules are pre-seeded as None in deepcopy's
    # memo, so a meta-device model stays free and a real one costs one stage of memory. A
    # weight tied between a kept and a dropped module is copied with the kept one.
    keep = {str(i) for i in keep}
    ends = ([] if first else list(plan.first)) + ([] if last else list(plan.last))
    drop = [b for k, b in _block_items(plan.blocks_of(model)).items() if k not in keep]
    drop += [m for m in (_submodule(model, n) for n in ends) if m is not None]
    stage = copy.deepcopy(model, memo={id(m): None for m in drop})
    blocks = plan.blocks_of(stage)
    kept = {k: b for k, b in _block_items(blocks).items() if k in keep}
    if isinstance(blocks, nn.ModuleDict):
        for key in [k for k in blocks.keys() if k not in keep]:
            del blocks[key]
    else:
        _set(stage, plan.blocks, StageBlocks(kept))
    for name in ends:
        if _submodule(model, name) is not None:
            make = plan.stand_ins.get(name)
            _set(stage, name, None if make is None else make())
    if plan.forward is not None:
        # The stage's own forward stays what the plan's forward calls; hooks (FSDP, TP)
        # run around the instance's forward as around the class's.
        stage.forward = functools.partial(plan.forward, stage.forward)
    return stage


def _set(model: nn.Module, path: str, value) -> None:
    parent, _, attr = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, value)


def materialize(stages: list[nn.Module], plan: PipelinePlan, device: torch.device,
                seed: int, *, fill: Callable[[nn.Module, torch.device], None] | None = None
                ) -> None:
    """Meta stages -> real ones holding exactly the values of the full model, through the
    plan's `init_weights` with ``torch.Generator().manual_seed(seed)``, or through
    ``fill(stage, device)`` (e.g. reading each stage's own tensors from a saved model:
    `meshfit.checkpoint.pretrained.stage_filler`)."""
    if fill is not None:
        for s in stages:
            fill(s, device)
        return
    if plan.init_weights is None:
        raise ValueError("the model is on the meta device and its pipeline plan has no "
                         "init_weights to fill each stage with the full model's values; "
                         "build the model on a real device (with one seed on every rank)")
    for s in stages:
        s.to_empty(device=device)
        plan.init_weights(s, torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------- tied weights
@dataclass(frozen=True)
class Tie:
    """One tensor the full model shares between parts that land on different stages."""

    names: tuple[str, ...]  # the full model's names of the shared tensor
    cross_rank: bool  # copies on more than one pp rank
    shape: torch.Size


def holds(model: nn.Module, plan: PipelinePlan, name: str, stage: int, num_stages: int,
          points) -> bool:
    """Whether stage `stage` keeps parameter `name` of the full model."""
    prefix = plan.blocks + "."
    if name.startswith(prefix):
        index = int(name[len(prefix):].split(".", 1)[0])
        n = len(plan.blocks_of(model))
        return index in stage_range(stage, num_stages, points, n)
    if any(name.startswith(part + ".") for part in plan.first):
        return stage == 0
    if any(name.startswith(part + ".") for part in plan.last):
        return stage == num_stages - 1
    return True


def ties(model: nn.Module, plan: PipelinePlan, placement, num_stages: int, points) -> list[Tie]:
    """The trainable tensors that end up as copies on several stages."""
    out = []
    for names in (n for n in names_by_parameter(model) if len(n) > 1):
        if not model.get_parameter(names[0]).requires_grad:
            continue  # frozen (e.g. LoRA): no gradients to keep equal
        holders = [(r, s) for r, held in enumerate(placement) for s in held
                   for n in names if holds(model, plan, n, s, num_stages, points)]
        if len(holders) > 1:
            shape = model.get_parameter(names[0]).shape
            out.append(Tie(tuple(names), len({r for r, _ in holders}) > 1, shape))
    return out
