"""Expert parallelism: each MoE block's experts split over the ``ep`` ranks, tokens sent to
their experts' ranks and back with all-to-all.

    apply_ep(model, mesh["ep"])      # before FSDP2 (`meshfit.parallel.parallelize` step 2b)

The ``ep`` ranks are a group of data-parallel ranks (``ep`` divides ``dp_shard``; see
`meshfit.distributed.ParallelDims`), so each of them routes its own tokens. With E experts
and P = ep ranks, rank p holds experts [p E/P, (p+1) E/P) as the local shard of a DTensor
``Shard(0)`` over ``mesh["ep"]`` (so checkpoints, `full_tensor` export and gradient-norm
clipping see whole expert tensors). One MoE forward on rank p (`ExpertParallel.dispatch`):

1. its assignments, already sorted by expert, are counted per destination rank; the
   counts [P, E/P] are exchanged with one ``all_to_all_single`` so each rank knows how
   many rows it receives from each source for each of its experts;
2. the rows go out with ``all_to_all_single`` and variable splits (torch.distributed's
   own collective, NCCL or gloo), arriving ordered by (source rank, local expert); they are
   regrouped by local expert (a stable sort keeps each source's token order), computed by
   the local experts, put back in arrival order and returned with the inverse
   ``all_to_all_single``; backward runs the same two exchanges the other way.

Gradients. A rank's expert gradient holds the contributions of all P ranks' tokens (they
came through its experts), while every other gradient holds its own tokens' only and is
averaged over the D data-parallel ranks by DDP/FSDP. The experts' gradients are therefore
scaled by 1/P in backward (`Experts.grad_scale`); FSDP2 then averages them over the D/P
ranks that hold the same experts (`Layout.expert_fsdp_mesh`), which gives the same 1/D
average as every other parameter. With D = P no rank shares this rank's experts: FSDP2
leaves them out (`ignored_params`) and nothing else reduces them.

Capacity (`GPTConfig.capacity_factor`) is applied to each rank's own tokens before they are
sent, as GShard's per-group capacity: the same as one process only when dropless. The
auxiliary losses are each rank's own (its tokens' routing), as under data parallel: they are
computed inside `meshfit.models.MoE`, which holds no process group (a global version needs
the block to all-reduce its statistics, as `meshfit.parallel.ep_hf.load_balancing_loss`
does for transformers' models).

transformers' MoE families (Mixtral, Qwen2/3-MoE, GLM-4-MoE, DeepSeek-V3) are split by
`meshfit.parallel.ep_hf.apply_hf_ep` with the same exchange (`meshfit.parallel.ep_exchange`);
`moe_modules` and `ep_problem` cover both kinds.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from meshfit.distributed import is_initialized
from meshfit.parallel.ep_exchange import ExpertParallel
from meshfit.parallel.ep_hf import HFMoE, hf_ep_problem, is_experts
from meshfit.distributed.tensors import local_tensor
from meshfit.models.config import GPTConfig
from meshfit.models.moe import MoE

__all__ = ["ExpertParallel", "apply_ep", "ep_problem", "moe_modules", "routing_metrics"]


def ep_problem(model_or_config, ep: int, name: str = "ep") -> str | None:
    """Why a model (or its configuration: a `GPTConfig` or a transformers configuration)
    cannot run expert parallel over `ep` ranks, or None when it can: a dense model, a
    transformers MoE class meshfit has not mapped (`meshfit.parallel.ep_hf.MAPPED`), or `ep`
    not dividing the number of experts."""
    if ep <= 1:
        return None
    if isinstance(model_or_config, GPTConfig):
        if model_or_config.n_experts < 1:
            return (f"{name}={ep} needs a mixture-of-experts model, and this GPT is dense "
                    f"(n_experts=0); set its n_experts (e.g. the moe-tiny preset) or {name}=1")
        return _split_problem([model_or_config.n_experts], ep, name)
    if isinstance(model_or_config, nn.Module) and any(
            isinstance(m, MoE) for m in model_or_config.modules()):
        return _split_problem([m.n_experts for m in moe_modules([model_or_config])], ep, name)
    if hasattr(getattr(model_or_config, "config", model_or_config), "model_type"):
        return hf_ep_problem(model_or_config, ep, name)
    return (f"{name}={ep} needs a mixture-of-experts model, and this one has no MoE "
            f"blocks; use {name}=1 (ZeRO/FSDP and DDP work with every model)")


def _split_problem(counts, ep: int, name: str) -> str | None:
    """Why blocks of these expert counts cannot be split over `ep` ranks (None: they can, or
    there are none — a pipeline stage may hold only dense blocks)."""
    for n in counts:
        if n % ep:
            return (f"{name}={ep} must divide the number of experts ({n}): each ep rank "
                    f"holds n_experts / ep of them; use an ep that divides {n}")
    return None


def apply_ep(model: nn.Module, ep_mesh, device: torch.device | None = None) -> list[nn.Module]:
    """Split every MoE block's experts of `model` over the 1-D `ep_mesh`, in place (taken
    from the whole weights every rank holds, without communication; the local shards go to
    `device`, default: where the weights are). Returns the `Experts` modules (for FSDP2)."""
    # deferred: torch.distributed.tensor adds ~0.5 s to the trainer's import, which loads this
    # module for every run (moe_modules, routing_metrics)
    from torch.distributed.tensor import DTensor, Shard

    size, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    problem = _split_problem([m.n_experts for m in moe_modules([model])], size, "ep")
    if problem:
        raise ValueError(problem)
    out = []
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        experts = module.experts
        for name, p in list(experts.named_parameters(recurse=False)):
            # under tp the experts are whole on every tp rank (a replicated DTensor)
            whole = local_tensor(p.detach())
            local = whole.chunk(size, dim=0)[rank].to(device or p.device).clone()
            shard = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False,
                                       shape=p.shape, stride=p.stride())
            setattr(experts, name, nn.Parameter(shard, requires_grad=p.requires_grad))
        experts.grad_scale = 1.0 / size
        module.ep = ExpertParallel(ep_mesh.get_group(), size, rank, module.n_experts)
        out.append(experts)
    return out


def moe_modules(modules) -> list:
    """The mixture-of-experts blocks inside `modules`: meshfit's `meshfit.models.MoE`, and
    a transformers MoE's routed-experts modules seen as blocks (`meshfit.parallel.ep_hf.
    HFMoE`: ``n_experts``, ``ep``, ``last_stats``)."""
    return [m if isinstance(m, MoE) else HFMoE(m) for module in modules
            for m in module.modules() if isinstance(m, MoE) or is_experts(m)]


def routing_metrics(moes: list[nn.Module], *, dp_group=None, dp_size: int = 1,
                    pp_group=None) -> dict[str, float]:
    """Routing statistics of the last forward of every MoE block of the model, whichever
    rank holds it; a collective: every rank calls it with its own blocks (an empty list on
    a pipeline stage without MoE blocks, but then every rank of the run must call).

    Tokens per expert are summed over the data-parallel ranks (`dp_group`: every token of
    the global micro-batch once), then per block: min, max and coefficient of variation
    (std / mean) over experts; blocks on other pipeline stages are combined over `pp_group`.
    Returns ``moe_tokens_per_expert_min / _max``, ``moe_tokens_per_expert_cv`` (mean over
    blocks), ``moe_dropped_fraction`` (capacity drops / assignments), ``moe_aux_loss``
    (the blocks' auxiliary losses summed, averaged over data-parallel ranks) and
    ``moe_a2a_s`` (seconds spent in expert-parallel exchanges since the last call, the
    slowest rank's; 0 without ep), or {} for a dense model."""
    stats = [m.last_stats for m in moes if m.last_stats is not None]
    distributed = is_initialized() and dist.get_world_size() > 1
    if stats:
        device = stats[0]["tokens_per_expert"].device
    elif distributed and dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    counts = torch.stack([s["tokens_per_expert"].to(device, torch.float64) for s in stats]) \
        if stats else torch.zeros(0, 1, dtype=torch.float64, device=device)
    sums = torch.tensor([sum(s["dropped"] for s in stats), sum(s["assignments"] for s in stats),
                         sum(float(s["aux_loss"]) for s in stats) / dp_size],
                        dtype=torch.float64, device=device)
    if dp_group is not None and dp_size > 1:
        dist.all_reduce(counts, group=dp_group)
        dist.all_reduce(sums, group=dp_group)
    seconds = 0.0
    for m in moes:
        if m.ep is not None:
            seconds += m.ep.seconds
            m.ep.seconds = 0.0
    if len(stats):
        cv = counts.std(dim=1, unbiased=False) / counts.mean(dim=1).clamp_min(1e-12)
        per_stage = [float(cv.sum()), float(len(stats)), *sums.tolist()]
        lo, hi = float(counts.min()), float(counts.max())
    else:
        per_stage, lo, hi = [0.0, 0.0, 0.0, 0.0, 0.0], math.inf, -math.inf
    total = torch.tensor(per_stage, dtype=torch.float64, device=device)
    extremes = torch.tensor([-lo, hi, seconds], dtype=torch.float64, device=device)
    if distributed:  # over every rank: other stages' blocks, the slowest exchange
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    cv_sum, layers, dropped, assignments, aux = total.tolist()
    if layers == 0:
        return {}
    neg_lo, hi, seconds = extremes.tolist()
    return {"moe_tokens_per_expert_min": int(-neg_lo), "moe_tokens_per_expert_max": int(hi),
            "moe_tokens_per_expert_cv": round(cv_sum / layers, 4),
            "moe_dropped_fraction": round(dropped / max(assignments, 1.0), 5),
            "moe_aux_loss": round(aux, 6), "moe_a2a_s": round(seconds, 4)}
