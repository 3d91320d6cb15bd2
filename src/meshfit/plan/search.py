"""The layout planner: every legal layout of a cluster (`Layout.candidates`, meshfit's own
rules), those that fit in memory (`meshfit.memory.estimate` with a safety margin), ranked
by the cost model (`meshfit.plan.cost`), each with the multi-GPU guide's reason (the package
docstring shows a call).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from meshfit.memory.estimate import DTYPE_BYTES, Adapters, Estimate, LayoutSpec, estimate
from meshfit.memory.shape import ModelShape
from meshfit.parallel.layout import Layout, ModelFacts
from meshfit.parallel.pp import SCHEDULES
from meshfit.plan.cost import Cluster, predict
from meshfit.plan.devices import GiB

# Cluster and predict are the cost model's (`meshfit.plan.cost`); this documented module
# keeps them under the names users import them by.
__all__ = ["Cluster", "Plan", "SearchResult", "predict", "search"]


@dataclass(frozen=True, kw_only=True)
class Plan:
    """One ranked layout."""

    estimate: Estimate
    step_time_s: float
    tokens_per_s: float
    mfu: float
    why: str
    breakdown: dict = field(default_factory=dict)
    host_bytes_per_node: float = 0.0
    """Host memory the offloaded states of one node's ranks take (CPU offload)."""

    @property
    def layout(self) -> LayoutSpec:
        return self.estimate.layout

    def to_json(self) -> dict:
        return {"layout": self.layout.to_json(), "per_rank_bytes": self.estimate.per_rank_bytes,
                "host_bytes_per_node": self.host_bytes_per_node,
                "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
                "mfu": self.mfu, "why": self.why}


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    model: ModelShape
    cluster: Cluster
    plans: list[Plan]
    """The layouts that fit, best (shortest predicted step) first."""
    considered: int
    """Layouts and settings estimated (legal ones)."""
    refused: int
    """Layouts meshfit's rules refuse for this model and world size."""
    too_big: int
    """Legal layouts that did not fit in memory (the GPUs', or the host's for offload)."""
    scenario: str
    sources: dict = field(default_factory=dict)
    """Where the predicted figures come from (`Cluster.sources`)."""

    def to_json(self) -> dict:
        return {"model": self.model.name, "params": self.model.params,
                "scenario": self.scenario, "sources": self.sources,
                "plans": [p.to_json() for p in self.plans]}


# ---------------------------------------------------------------------------- the guide
def scenario(shape: ModelShape, cluster: Cluster, *, seq_len: int, dtype: str,
             optimizer: str, budget: float,
             adapters: Adapters | None = None) -> tuple[str, dict]:
    """The guide's decision tree: one GPU / one node / many nodes; the model fits one GPU /
    does not / its largest layer does not; fast or slow links."""
    one = estimate(shape, LayoutSpec(), seq_len=seq_len, dtype=dtype, optimizer=optimizer,
                   adapters=adapters)
    fits_one = one.total <= budget
    layer = shape.block_params * (DTYPE_BYTES[dtype] + 4)  # one block gathered + its grads
    layer_fits = layer <= budget
    facts = {"fits_one_gpu": fits_one, "largest_layer_fits": layer_fits,
             "one_gpu_bytes": one.total}
    if cluster.world_size == 1:
        text = ("one GPU: the model fits" if fits_one else
                "one GPU and the model does not fit: only checkpointing, smaller batches and "
                "CPU offload can help")
    elif cluster.nodes == 1:
        if fits_one:
            text = ("one node, the model fits one GPU: data parallel (DDP; ZeRO may or may not "
                    "be faster)")
        elif not layer_fits:
            text = "one node, the largest layer does not fit one GPU: tensor parallel is needed"
        elif cluster.interconnect_name == "nvlink":
            text = ("one node, the model does not fit one GPU, NVLink: ZeRO-3/FSDP, pipeline "
                    "or tensor parallel are about equal")
        else:
            text = ("one node, the model does not fit one GPU, no NVLink: pipeline parallel "
                    "is preferred over tensor parallel and ZeRO")
    else:
        if cluster.network_name == "infiniband":  # a fast network
            text = ("many nodes, fast network: ZeRO-3/FSDP needs no model changes; or "
                    "PP + TP + DP, with TP inside a node")
        else:
            text = ("many nodes, slow network: TP inside the node, PP across nodes, DP with "
                    "ZeRO-1 at most (ZeRO-3's traffic would cross the slow network)")
        if not layer_fits:
            text += "; its largest layer does not fit one GPU: tensor parallel is needed"
        elif not fits_one:
            text += "; the model does not fit one GPU"
    return text, facts


def _why(layout: LayoutSpec, scene: str, est: Estimate, terms: dict) -> str:
    biggest = max(("compute", "bubble", "tp", "pp", "ep", "dp_exposed", "offload", "optimizer"),
                  key=lambda k: terms[k])
    states = (est.params + est.grads + est.optimizer) / GiB
    return (f"{scene}. This layout: {layout.describe()}; {states:.1f} GiB of model states and "
            f"{est.activations / GiB:.1f} GiB of activations per rank; its time goes mostly "
            f"to {biggest.replace('_exposed', ' (not overlapped)')}")


# ---------------------------------------------------------------------------- the search
def _micro_batches(per_dp: int, limit: int = 64) -> list[int]:
    return [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= min(per_dp, limit) and per_dp % b == 0]


def search(model: ModelShape | str, cluster: Cluster, *, seq_len: int, global_batch_size: int,
           dtype: str = "bf16", optimizer: str = "adamw", margin: float = 0.1,
           checkpointing: tuple[str, ...] = ("none", "selective", "full"),
           attention: str = "flash", top: int | None = None,
           host_memory: float | None = None, adapters: Adapters | None = None) -> SearchResult:
    """Rank every legal layout of `cluster` for `model` that fits in memory with `margin`
    (a share of the device's memory kept free: allocator caching, workspaces) and, with
    `host_memory` (bytes per node), whose CPU-offloaded states fit the host. A layout that
    does not fit is tried again with activation offload (its saved activations in host
    memory), which is proposed when that is what makes it fit. `adapters`:
    LoRA/QLoRA on the frozen `model` (`meshfit.memory.Adapters`): the memory counts them (the
    predicted step times are still those of full training)."""
    shape = ModelShape.of(model) if isinstance(model, str) else model
    _check_request(shape, seq_len, global_batch_size, margin)
    budget = cluster.memory_per_rank * (1 - margin)
    scene, facts = scenario(shape, cluster, seq_len=seq_len, dtype=dtype, optimizer=optimizer,
                            budget=budget, adapters=adapters)
    model_facts = ModelFacts(n_blocks=shape.n_layer, divisible=shape.divisible,
                             experts=(shape.n_experts,) * shape.moe_layers)  # ep's candidates
    plans: list[Plan] = []
    considered = refused = too_big = 0
    precision = "no" if dtype == "fp32" else dtype
    for cand in Layout.candidates(cluster.world_size, model_facts, mixed_precision=precision,
                                  local_world_size=cluster.gpus_per_node, seq_len=seq_len):
        d = cand.dims
        if cand.layout is None or cluster.gpus_per_node % d.tp or global_batch_size % d.dp:
            refused += 1  # (tp must divide a node's GPUs, so it never exceeds them)
            continue
        for spec in _specs(cand, model_facts, global_batch_size // d.dp, seq_len,
                           checkpointing):
            considered += 1
            est = estimate(shape, spec, seq_len=seq_len, dtype=dtype, optimizer=optimizer,
                           attention=attention, adapters=adapters)
            fits = _fits(est, budget, host_memory, cluster)
            # activations may be what does not fit (not where the device memory is the host's)
            if not fits and est.activations and not cluster.device.shared:
                spec = dataclasses.replace(spec, activation_offload=True)
                est = estimate(shape, spec, seq_len=seq_len, dtype=dtype, optimizer=optimizer,
                               attention=attention, adapters=adapters)
                fits = _fits(est, budget, host_memory, cluster)
            if not fits:
                too_big += 1
                continue
            plans.append(_plan(shape, spec, cluster, est, scene, seq_len=seq_len,
                               global_batch_size=global_batch_size, dtype=dtype))
    plans.sort(key=lambda p: (p.step_time_s, p.estimate.total))
    if not plans:  # the last resort: the optimizer state on disk (the slowest, by far)
        plans = _on_disk(shape, cluster, model_facts, budget, scene, seq_len=seq_len,
                         global_batch_size=global_batch_size, dtype=dtype, optimizer=optimizer,
                         attention=attention, checkpointing=checkpointing,
                         adapters=adapters, precision=precision, host_memory=host_memory)
    if not plans:
        raise ValueError(_impossible(shape, cluster, budget, seq_len=seq_len, dtype=dtype,
                                     optimizer=optimizer, host_memory=host_memory,
                                     adapters=adapters))
    return SearchResult(model=shape, cluster=cluster, plans=plans[:top] if top else plans,
                        considered=considered, refused=refused, too_big=too_big,
                        scenario=scene, sources=cluster.sources(dtype))


def _on_disk(shape, cluster, model_facts, budget, scene, *, seq_len, global_batch_size, dtype,
             optimizer, attention, checkpointing, adapters, precision,
             host_memory=None) -> list[Plan]:
    """The layouts that fit only with the optimizer state on disk (every ZeRO stage, without
    pp; under ZeRO-3, with the parameter shards there too when the state alone is not
    enough), best first; each one's step time carries the state's read and write."""
    plans = []
    for cand in Layout.candidates(cluster.world_size, model_facts, mixed_precision=precision,
                                  local_world_size=cluster.gpus_per_node, seq_len=seq_len,
                                  offload=False):
        d = cand.dims
        if cand.layout is None or d.pp > 1 or cluster.gpus_per_node % d.tp \
                or global_batch_size % d.dp:
            continue
        for spec in _specs(cand, model_facts, global_batch_size // d.dp, seq_len,
                           checkpointing):
            for params in (False, True) if spec.zero_stage == 3 else (False,):
                spec = dataclasses.replace(spec, offload="disk", offload_params=params)
                est = estimate(shape, spec, seq_len=seq_len, dtype=dtype, optimizer=optimizer,
                               attention=attention, adapters=adapters)
                if est.total <= budget and (host_memory is None or
                                            est.host * cluster.gpus_per_node <= host_memory):
                    plans.append(_plan(shape, spec, cluster, est, scene, seq_len=seq_len,
                                       global_batch_size=global_batch_size, dtype=dtype))
                    break  # (the parameters stay in memory when that fits)
    plans.sort(key=lambda p: (p.step_time_s, p.estimate.total))
    return plans


def _fits(est: Estimate, budget: float, host_memory: float | None, cluster: Cluster) -> bool:
    return est.total <= budget and (host_memory is None
                                    or est.host * cluster.gpus_per_node <= host_memory)


def _check_request(shape: ModelShape, seq_len: int, global_batch_size: int,
                   margin: float) -> None:
    if not 0 <= margin < 1:
        raise ValueError(f"margin={margin!r} must be in [0, 1)")
    if seq_len < 1 or global_batch_size < 1:
        raise ValueError("seq_len and global_batch_size must be >= 1")
    if shape.max_seq_len is not None and seq_len > shape.max_seq_len:
        raise ValueError(f"--seq-len={seq_len} is longer than the model's "
                         f"{shape.max_seq_len} positions")


def _specs(cand, model_facts, per_dp: int, seq_len: int,
           checkpointing: tuple[str, ...]) -> Iterator[LayoutSpec]:
    """Every way to run a legal candidate layout on `per_dp` sequences per data-parallel
    rank: each micro-batch size, each pipeline schedule the blocks allow (with pp), each
    checkpointing mode."""
    d = cand.dims
    for mbs in _micro_batches(per_dp):
        m = per_dp // mbs
        schedules = [("1f1b", 1)] if d.pp == 1 else [
            (s, 2 if s in ("interleaved_1f1b", "zero_bubble") else 1) for s in SCHEDULES]
        for schedule, v in schedules:
            if d.pp > 1 and cand.layout.model_problem(model_facts, seq_len=seq_len,
                                                      schedule=schedule, microbatches=m,
                                                      virtual_stages=v):
                continue
            for ckpt in checkpointing:
                yield LayoutSpec.from_request(cand.request, schedule=schedule,
                                              microbatches=m if d.pp > 1 else 1,
                                              virtual_stages=v, activation_checkpointing=ckpt,
                                              micro_batch_size=mbs)


def _plan(shape: ModelShape, spec: LayoutSpec, cluster: Cluster, est: Estimate, scene: str,
          *, seq_len: int, global_batch_size: int, dtype: str) -> Plan:
    """A layout that fits, with its predicted step time, throughput, MFU and the reason."""
    step, terms = predict(shape, spec, cluster, seq_len=seq_len,
                          global_batch_size=global_batch_size, dtype=dtype, est=est)
    tokens = global_batch_size * seq_len / step
    mfu = shape.flops_per_token(seq_len) * tokens / (cluster.peak_flops(dtype) *
                                                     cluster.world_size)
    why = _why(spec, scene, est, terms)
    if spec.offload == "disk":
        what = "the parameters and optimizer state" if spec.offload_params else \
            "the optimizer state"
        why += (f"; nothing fits without {what} on disk ({est.disk / GiB:.1f} GiB "
                f"per rank): reading and writing it adds {terms['offload']:.2f} s to each step "
                f"({step / max(step - terms['offload'], 1e-12):.1f}x the step without it, at "
                f"{cluster.disk_bandwidth / 1e9:.1f} GB/s per node)")
    if spec.activation_offload:
        why += (f"; its activations are what does not fit the device: "
                f"{est.detail['activations_on_host'] / GiB:.1f} GiB per rank of them go to "
                f"host memory (activation_offload), overlapped with compute "
                f"({terms['offload']:.2f} s of the step)")
    return Plan(estimate=est, step_time_s=step, tokens_per_s=tokens, mfu=mfu,
                why=why, breakdown=terms,
                host_bytes_per_node=est.host * cluster.gpus_per_node)


def _impossible(shape: ModelShape, cluster: Cluster, budget: float, *, seq_len: int,
                dtype: str, optimizer: str, host_memory: float | None = None,
                adapters: Adapters | None = None) -> str:
    """What would make a request possible: the GPUs ZeRO-3 with full checkpointing and
    micro-batch 1 needs, or CPU offload's host memory."""
    per_gpu = budget / GiB
    smallest = estimate(shape, LayoutSpec(activation_checkpointing="full"), seq_len=seq_len,
                        dtype=dtype, optimizer=optimizer, adapters=adapters)
    states = smallest.params + smallest.grads + smallest.optimizer
    # ZeRO-3's buffers: two gathered blocks in the compute dtype and one block's gradients
    rest = smallest.activations + shape.block_params * (2 * DTYPE_BYTES[dtype] + 4)
    if rest >= budget:
        return (f"no layout fits {cluster.world_size} GPU(s) of "
                f"{cluster.memory_per_rank / GiB:.0f} GiB: even one sequence of {seq_len} "
                f"tokens needs {rest / GiB:.1f} GiB of activations on one rank with full "
                "checkpointing; lower --seq-len or use tensor parallel with sequence parallel "
                "on more GPUs")
    need = math.ceil(states / (budget - rest))
    need = math.ceil(need / cluster.gpus_per_node) * cluster.gpus_per_node
    host = states / cluster.world_size / GiB
    offload = (f"ZeRO-3 with CPU offload (~{host:.0f} GiB of host memory per rank)"
               if host_memory is None else
               f"more host memory than --host-memory={host_memory / GiB:,.0f} GiB per node for "
               f"ZeRO-3 with CPU offload (~{host * cluster.gpus_per_node:,.0f} GiB per node)")
    return (f"no layout fits {cluster.world_size} GPU(s) of {cluster.memory_per_rank / GiB:.0f} "
            f"GiB ({per_gpu:.0f} GiB usable): the model states alone are "
            f"{states / GiB:.0f} GiB; it needs at least {need} GPUs of that size (ZeRO-3, full "
            f"checkpointing, micro-batch 1), or {offload}")
