"""`build_pipeline`: cut a model into stages over the ``pp`` mesh and return this rank's
`Pipeline`, with a torch schedule chosen by name."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from meshfit.models.plans import PipelinePlan
from meshfit.parallel.pp.pipeline import Pipeline
from meshfit.parallel.pp.schedule import (TORCH_SCHEDULES, MicrobatchMean, TimedStage,
                                          TokenCrossEntropy, check_pipeline, stage_placement)
from meshfit.parallel.pp.split import (build_stage_module, materialize, resolve_plan,
                                       split_points, ties)

__all__ = ["build_pipeline"]


def build_pipeline(model: nn.Module, pp_mesh, *, schedule: str = "1f1b", microbatches: int,
                   virtual_stages: int | None = None,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                   points: Sequence[int] | None = None, balance: str = "params",
                   times: Sequence[float] | None = None,
                   record_timings: bool = True, init_seed: int = 0,
                   parallelize: Callable[[nn.Module], nn.Module] | None = None,
                   plan: PipelinePlan | None = None,
                   fill_stage: Callable[[nn.Module, torch.device], None] | None = None
                   ) -> Pipeline:
    """Cut `model` into stages over the 1-D `pp_mesh` and return this rank's `Pipeline`.

    `model`: the full model, identical on every rank (built from one seed), or built on the
    meta device: then each stage is materialised on the mesh's device and filled by the
    plan's `init_weights` with ``torch.Generator().manual_seed(init_seed)``, the values the
    full model gets from the same call, or by ``fill_stage(stage, device)`` when given (a
    saved model read stage by stage: `meshfit.checkpoint.pretrained.stage_filler`).
    `plan`: where the blocks are (`PipelinePlan`); default the built-in plan of the model's
    type. `model` is not modified. Stages are copied out of it (`build_stage_module`) and
    moved to the mesh's device; build the optimizer afterwards on `pipeline.parameters()`.
    `points`: where stages begin (`split_points`), else balanced by `balance`/`times`.
    `loss_fn`: None for token cross-entropy on logits (targets [B, T], ignore_index -100,
    normalised by the whole batch's counted tokens, so the result equals the single-process
    mean exactly); or `loss_fn(output, target)` returning the mean over one micro-batch,
    which is divided by `microbatches` here (equal weight per micro-batch).
    torch's own gradient scaling (`scale_grads`) is turned off: it divides the whole `.grad`,
    including gradients accumulated by earlier steps.
    `record_timings`: append per-micro-batch forward/backward times to `pipeline.timings`
    (with a device synchronisation around each on CUDA, which removes compute/communication
    overlap while on).
    `parallelize`: applied to each stage module once it is on the device, returning the
    module the schedule runs: tensor parallel, checkpointing/compile and a data-parallel
    wrapper (FSDP2; torch's schedules also drive DDP, which meshfit does not use here: see
    `meshfit.parallel.layout`), as `Accelerator.prepare_pipeline` passes. The schedule
    reduces the wrapper's gradients once per `step`, after its last micro-batch.
    """
    cut = _cut(model, pp_mesh, plan, schedule=schedule, microbatches=microbatches,
               virtual_stages=virtual_stages, points=points, balance=balance, times=times)
    pp_rank, group = pp_mesh.get_local_rank(), pp_mesh.get_group()
    device, held = _device(pp_mesh), cut.placement[pp_rank]
    modules = _stage_modules(model, cut.plan, held, cut.num_stages, cut.points, device,
                             group, init_seed=init_seed, fill_stage=fill_stage)
    runs = [parallelize(m) for m in modules] if parallelize is not None else modules
    modules = [r.module if isinstance(r, nn.parallel.DistributedDataParallel) else r
               for r in runs]
    timings = [] if record_timings else None
    info = {"step": 0, "rank": pp_rank, "record": True}
    stages = _timed_stages(runs, held, cut.num_stages, device, group, timings, info)
    loss = TokenCrossEntropy() if loss_fn is None else MicrobatchMean(loss_fn, microbatches)
    sched = TORCH_SCHEDULES[schedule](stages[0] if cut.virtual_stages == 1 else stages,
                                      n_microbatches=microbatches, loss_fn=loss,
                                      scale_grads=False)
    return Pipeline(modules, stages, sched, name=schedule, pp_group=group, pp_rank=pp_rank,
                    num_stages=cut.num_stages, points=cut.points, microbatches=microbatches,
                    loss_fn=loss, last_rank=cut.last_rank,
                    tied=ties(model, cut.plan, cut.placement, cut.num_stages, cut.points),
                    timings=timings, step_info=info, virtual_stages=cut.virtual_stages,
                    placement=cut.placement)


@dataclass(frozen=True, kw_only=True)
class _Cut:
    """Where the model is cut: its plan, the stages (`virtual_stages` per rank), where each
    begins, and which ranks hold which (`stage_placement`)."""

    plan: PipelinePlan
    virtual_stages: int
    num_stages: int
    points: list[int]
    placement: list[list[int]]

    @property
    def last_rank(self) -> int:
        """The pp rank holding the last stage."""
        return next(r for r, held in enumerate(self.placement) if self.num_stages - 1 in held)


def _cut(model: nn.Module, pp_mesh, plan: PipelinePlan | None, *, schedule: str,
         microbatches: int, virtual_stages: int | None, points: Sequence[int] | None,
         balance: str, times: Sequence[float] | None) -> _Cut:
    """The pipeline's stages over `pp_mesh`, checked before anything is built."""
    if pp_mesh.ndim != 1:
        raise ValueError(f"build_pipeline needs a 1-D mesh, got axes {pp_mesh.mesh_dim_names}; "
                         "pass mesh['pp']")
    plan = resolve_plan(model, plan)
    pp = pp_mesh.size()
    v = check_pipeline(len(plan.blocks_of(model)), pp, schedule=schedule,
                       microbatches=microbatches, virtual_stages=virtual_stages)
    points = split_points(model, pp * v, balance=balance, times=times, points=points,
                          plan=plan)
    return _Cut(plan=plan, virtual_stages=v, num_stages=pp * v, points=points,
                placement=stage_placement(schedule, pp, v))


def _device(pp_mesh) -> torch.device:
    """This rank's device on the mesh (the current CUDA device on a CUDA mesh)."""
    if pp_mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(pp_mesh.device_type)


def _timed_stages(runs: list[nn.Module], held: Sequence[int], num_stages: int,
                  device: torch.device, group, timings: list | None,
                  info: dict) -> list[TimedStage]:
    """This rank's torch stages over the modules the schedule runs, recording into
    `timings` (None: not recorded) on a wall clock read through `perf_counter`."""
    anchor_wall, anchor_perf = time.time(), time.perf_counter()
    return [TimedStage(m, s, num_stages, device, group=group, log=timings, info=info,
                       clock=lambda: anchor_wall + time.perf_counter() - anchor_perf)
            for m, s in zip(runs, held)]


def _stage_modules(model: nn.Module, plan: PipelinePlan, held: Sequence[int], num_stages: int,
                   points, device: torch.device, group, *, init_seed: int,
                   fill_stage) -> list[nn.Module]:
    """This rank's stage modules, cut out of `model` and put on `device` with the full
    model's values (a meta-device model's stages materialised; otherwise the ranks' copies
    checked to be the same)."""
    modules = [build_stage_module(model, s, num_stages, points, plan=plan) for s in held]
    if any(p.is_meta for m in modules for p in m.parameters()):
        materialize(modules, plan, device, init_seed, fill=fill_stage)
        return modules
    _check_same_weights(model, group)
    return [m.to(device) for m in modules]


def _check_same_weights(model: nn.Module, group) -> None:
    # Each rank keeps its own slice of its own copy: ranks that built different weights (an
    # unseeded init) would train a model nobody built, silently. Compare cheap fingerprints.
    with torch.no_grad():
        mine = [round(float(p.double().sum() + p.double().abs().sum()), 6)
                for p in model.parameters()]
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    if any(other != everyone[0] for other in everyone):
        raise ValueError("the pp ranks passed different model weights to build_pipeline; build "
                         "the full model after torch.manual_seed(seed) with one seed on every "
                         "rank, or on the meta device (stages are then initialised from init_seed)")
