"""The planner's cost model: the machines a plan is for (`Cluster`: a device's data sheet and
the links' tables, or a `meshfit calibrate` profile's measured figures) and the predicted
seconds of one optimizer step of a layout on them (`predict`), term by term.

Cost model of one optimizer step (seconds), per rank:

    compute   = 6N+12LdT FLOPs per token x tokens / (ranks x peak x efficiency)
                x 4/3 with full checkpointing (the forward again), 7/6 with selective,
                1 + (1 - b)/3 with memory budget b
    bubble    = compute x (p-1)/m (GPipe, 1F1B), (p-1)/(v m) (interleaved), (p-1)/(3 v m)
                (zero-bubble: a third of interleaved's, ZB-H1's ratio; ZB-V reaches ~0 only
                when the weight-gradient work fills every gap); (p-1)/m for any schedule
                when m < p (each stage waits for the one micro-batch ahead of it)
    tp        = per micro-batch and block, 4 all-reduces of b·s·d activations (6 with full
                checkpointing) over the TP group's link, not overlapped
    pp        = per micro-batch, a send and a receive of b·s·d activations
    ep        = per micro-batch and MoE block of the stage, 4 all-to-alls (6 with full
                checkpointing) of the b·s·k·d routed rows over the ep group (tp x ep
                consecutive ranks), not overlapped (dropless: the mean load; a skewed router
                sends more to its busiest rank)
    dp        = DDP/ZeRO-1: an all-reduce of the fp32 gradients per 25 MiB bucket (ZeRO-1:
                + the parameters' all-gather); FSDP2: per unit (each block and the root)
                parameter all-gathers per micro-batch (twice at stage 3) + a gradient
                reduce-scatter (+ all-reduce across replicas) (`data_parallel_seconds`);
                overlapped with compute up to 80% of it, the overlapped part still charged
                10% -- or, with a profile that measured the engine in training steps, that
                measured exposed share of it
    offload   = the sharded states over the host link, twice, + the optimizer step on the CPU;
                on disk: the state read and written on the node's disk, which its ranks share;
                activation offload: each micro-batch's saved activations over the host link
                twice, overlapped with compute (the rest exposed, the overlap charged 10%)

Each collective: latency + factor x bytes / bus bandwidth (all-reduce 2(n-1)/n, all-gather
and reduce-scatter (n-1)/n, send 1), on the link the group crosses: the node's
interconnect when all its ranks share a node (mesh order pp, dp_replicate, dp_shard, tp:
tp innermost), the network otherwise. A `meshfit calibrate` profile replaces the device's
throughput and the collectives' figures with measured ones, each figure only where the
profile does not flag it (`meshfit.plan.trust`: a fit that explains nothing, a difference
the noise covers, a machine too noisy to measure); `Cluster.sources` says which were used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshfit.memory.activations import in_flight
from meshfit.memory.estimate import DTYPE_BYTES, Estimate, LayoutSpec, estimate, resolve_layout
from meshfit.memory.shape import ModelShape
from meshfit.plan.devices import DEVICES, INTERCONNECTS, NETWORKS, Device, GiB, Link
from meshfit.plan.fit import DP_ENGINES, KINDS, bus_factor, data_parallel_seconds

__all__ = ["Cluster", "predict"]


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """The machines a plan is for."""

    gpus_per_node: int
    nodes: int = 1
    device: Device = DEVICES["h100"]
    interconnect: Link | None = None
    """The link between the ranks of a node; None: `interconnect_name`'s `INTERCONNECTS`
    entry."""
    network: Link | None = None
    """The link between nodes; None: `network_name`'s `NETWORKS` entry."""
    interconnect_name: str | None = None
    """None: the name of `interconnect` in `INTERCONNECTS` ("custom" if none), else
    "loopback" on the "cpu" device (processes of one host), "nvlink" on GPUs."""
    network_name: str | None = None
    """None: as `interconnect_name`, in `NETWORKS`; "ethernet" on the "cpu" device,
    "infiniband" on GPUs."""
    calibration: object | None = None
    """A `meshfit.plan.calibrate.Calibration`: measured throughput and collectives (its
    flagged figures are not used: `meshfit.plan.trust`)."""
    disk_bandwidth: float = 2e9
    """Bytes/s each node's offload disk reads and writes sequentially (offload="disk"):
    2 GB/s, a datacentre NVMe drive's order (measure yours: benchmarks/disk_offload.py)."""

    def __post_init__(self):
        cpu = self.device.name == "cpu"
        for attr, table, default in (
                ("interconnect", INTERCONNECTS, "loopback" if cpu else "nvlink"),
                ("network", NETWORKS, "ethernet" if cpu else "infiniband")):
            link, name = getattr(self, attr), getattr(self, f"{attr}_name")
            if name is None:
                name = default if link is None else next(
                    (k for k, v in table.items() if v == link), "custom")
            if link is None and name not in table:
                raise ValueError(f"{attr}_name={name!r} is not one of {', '.join(table)}; "
                                 f"name one, or give {attr}=Link(bandwidth, latency)")
            object.__setattr__(self, attr, link or table[name])
            object.__setattr__(self, f"{attr}_name", name)

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def memory_per_rank(self) -> float:
        """Bytes each rank may use: its device's, or its share of a node's shared memory."""
        return self.device.memory_per_rank(self.gpus_per_node)

    def describe(self) -> str:
        """The machines in words: "1 x 8 h100 (80 GiB, nvlink)"; a CPU as the host it is."""
        if self.device.shared:
            what = (f"{self.nodes} x {self.gpus_per_node} {self.device.name} processes "
                    f"({self.device.memory / GiB:.1f} GiB of memory per node, "
                    f"{self.memory_per_rank / GiB:.1f} GiB each; {self.interconnect_name}")
        else:
            what = (f"{self.nodes} x {self.gpus_per_node} {self.device.name} "
                    f"({self.device.memory / GiB:.0f} GiB, {self.interconnect_name}")
        return what + (f", {self.network_name})" if self.nodes > 1 else ")")

    def uses(self, figure: str) -> bool:
        """Whether a figure of the profile is used: the profile holds `figure` (a
        `Calibration.flags` path: "matmul_flops.bf16", "collectives.all_reduce", ...)
        and `meshfit calibrate` did not flag it."""
        return self.calibration is not None and self.calibration.trusted(figure)

    def flops(self, dtype: str) -> float:
        """FLOP/s a training step's matrix products reach: the profile's measured matmul,
        or the data sheet's peak x the device's assumed efficiency."""
        if self.uses(f"matmul_flops.{dtype}"):  # measured: achieved, not peak
            measured = self.calibration.matmul_flops.get(dtype)
            if not measured:
                raise ValueError(f"the calibration has no {dtype} matmul figure (this device "
                                 "could not run it); use another --dtype")
            return measured
        return self.device.flops[dtype] * self.device.efficiency

    def peak_flops(self, dtype: str) -> float:
        """What MFU divides by: the data sheet's peak, or with a profile the fastest matmul
        it measured (no step can beat either, so MFU stays at most 100%)."""
        if self.uses(f"matmul_flops.{dtype}"):
            return self.calibration.peak_flops(dtype) or self.flops(dtype)
        return self.device.flops[dtype]

    def step_fit(self, dtype: str):
        """The profile's training-step fit for `dtype` (`TrainStepFit`), or None."""
        steps = getattr(self.calibration, "train_step", None)
        return (steps or {}).get(dtype) if self.uses(f"train_step.{dtype}") else None

    def pipeline_overhead(self, schedule: str) -> float | None:
        """The profile's measured seconds per micro-batch of `schedule` beyond the model
        (`meshfit.plan.calibrate`, ``pipeline``), or None."""
        schedules = getattr(self.calibration, "pipeline", None)
        return (schedules or {}).get(schedule) if self.uses(f"pipeline.{schedule}") else None

    def dp_exposed(self, engine: str) -> float | None:
        """The profile's measured exposed share of `engine`'s modelled data-parallel
        collectives (`meshfit.plan.calibrate`, ``data_parallel``), or None."""
        engines = getattr(self.calibration, "data_parallel", None)
        return (engines or {}).get(engine) if self.uses(f"data_parallel.{engine}") else None

    def sources(self, dtype: str) -> dict[str, str]:
        """Where each predicted figure comes from, in words; "not_used": the profile's
        figures that `meshfit calibrate` flagged, and why ("" if none)."""
        if self.uses(f"matmul_flops.{dtype}"):
            peak = (f"the fastest measured {dtype} matmul, "
                    f"{self.peak_flops(dtype) / 1e12:.3g} TFLOP/s")
        else:
            peak = f"the data sheet's {self.peak_flops(dtype) / 1e12:.3g} TFLOP/s"
        flags = getattr(self.calibration, "flags", None) or {}
        if "machine" in flags:
            not_used = f"the whole profile: this machine was {flags['machine']}"
        else:
            not_used = "; ".join(f"{k}: {why}" for k, why in flags.items())
        return {"compute": self._compute_source(dtype), "collectives": self._link_source(),
                "mfu_peak": peak, "not_used": not_used,
                "memory": "meshfit.memory.estimate (model states, activations, buffers)"}

    def _compute_source(self, dtype: str) -> str:
        fit = self.step_fit(dtype)
        if fit is not None:
            return (f"measured training steps ({self.calibration.device}, profile): "
                    f"{fit.step_overhead * 1e3:.2f} ms per micro-batch, "
                    f"{fit.block_overhead * 1e3:.2f} ms per block, elementwise and "
                    f"attention-score terms, FLOPs at {fit.flops / 1e9:.1f} GFLOP/s; AdamW "
                    f"{fit.optimizer_per_param * 1e9:.2f} ns per parameter")
        if self.uses(f"matmul_flops.{dtype}"):
            steps = (getattr(self.calibration, "train_step", None) or {}).get(dtype)
            why = ("its training-step fit is flagged" if steps is not None else
                   "a profile without training steps: rerun meshfit calibrate")
            return (f"measured matmul ({self.calibration.device}, profile): "
                    f"{self.flops(dtype) / 1e12:.3g} TFLOP/s, no framework overhead ({why})")
        return (f"{self.device.name} data sheet {self.device.flops[dtype] / 1e12:.3g} "
                f"TFLOP/s {dtype} x an assumed efficiency of {self.device.efficiency:.0%} "
                "(not measured)")

    def _link_source(self) -> str:
        table = (f"link table: {self.interconnect_name} "
                 f"{self.interconnect.bandwidth / 1e9:.3g} GB/s" +
                 (f", {self.network_name} {self.network.bandwidth / 1e9:.3g} GB/s"
                  if self.nodes > 1 else "") + " (not measured)")
        measured = [k for k in KINDS if self.uses(f"collectives.{k}")]
        if not measured:
            links = table
        elif len(measured) == len(KINDS):
            links = "measured collectives (profile)"
        else:
            links = f"measured {', '.join(measured)} (profile), the others from the {table}"
        engines = getattr(self.calibration, "data_parallel", None) or {}
        exposed = ", ".join(f"{name} x{self.dp_exposed(name):.2f}" for name in engines
                            if self.dp_exposed(name) is not None)  # engines and tp, tp_sp
        links += (f"; exposed in a training step as measured there: {exposed} of the modelled "
                  "time" if exposed else ", 80% hidden behind compute (assumed)")
        schedules = getattr(self.calibration, "pipeline", None) or {}
        per_micro = ", ".join(f"{k} {self.pipeline_overhead(k) * 1e3:.2f} ms" for k in schedules
                              if self.pipeline_overhead(k) is not None)
        if per_micro:
            links += f"; pipeline schedules' own work per micro-batch as measured: {per_micro}"
        return links

    def collective(self, kind: str, nbytes: float, n: int, span: int) -> float:
        """Seconds of one collective of `kind` over `n` ranks whose group spans `span`
        consecutive ranks (inside one node when span <= gpus_per_node): the profile's fit
        where it is used, else the link table's."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        if self.uses(f"collectives.{kind}"):
            return self.calibration.collective_time(kind, nbytes, n)
        link = self.interconnect if span <= self.gpus_per_node else self.network
        return link.latency + bus_factor(kind, n) * nbytes / link.bandwidth


def predict(shape: ModelShape, layout: LayoutSpec, cluster: Cluster, *, seq_len: int,
            global_batch_size: int, dtype: str = "bf16",
            est: Estimate | None = None) -> tuple[float, dict]:
    """Predicted seconds per optimizer step of `layout`, and the terms (see the module
    docstring). `est`: the layout's memory estimate where the caller has it (offload reads
    the bytes it moves from it)."""
    share = _Share.of(shape, layout, seq_len=seq_len, global_batch_size=global_batch_size)
    compute = _compute_seconds(shape, layout, cluster, share, seq_len=seq_len, dtype=dtype)
    bubble = _bubble(layout)
    tp, pp = _activation_seconds(shape, layout, cluster, share, seq_len=seq_len, dtype=dtype)
    ep = _expert_seconds(shape, layout, cluster, share, seq_len=seq_len, dtype=dtype)
    family, dp = _data_parallel_seconds(layout, cluster, share, dtype)
    offload = _offload_seconds(shape, layout, cluster, est, seq_len=seq_len, dtype=dtype) \
        + _activation_offload_seconds(layout, cluster, est, share, compute)
    optimizer = _optimizer_seconds(layout, cluster, share, dtype)
    exposed_dp, charged_dp = _exposed(dp, compute, cluster.dp_exposed(family))
    step = compute * (1 + bubble) + tp + pp + ep + charged_dp + offload + optimizer
    return step, {"compute": compute, "bubble": compute * bubble, "tp": tp, "pp": pp, "ep": ep,
                  "dp": dp, "dp_exposed": exposed_dp, "offload": offload,
                  "optimizer": optimizer}


@dataclass(frozen=True, kw_only=True)
class _Share:
    """One rank's share of an optimizer step under a layout."""

    micro: int
    """Micro-batches per rank per step."""
    blocks: int
    """Blocks per pipeline stage."""
    recompute: float
    """The compute's multiple for recomputation: 1, 7/6 with selective checkpointing, 4/3
    with full (the forward again)."""
    flops: float
    """The whole step's FLOPs, on all ranks together (without recomputation)."""
    params: float
    """The parameters this rank holds: its pipeline stage's, tensor parallel's share of them."""

    @classmethod
    def of(cls, shape: ModelShape, layout: LayoutSpec, *, seq_len: int,
           global_batch_size: int) -> _Share:
        T, P = layout.tp, layout.pp
        blocks = math.ceil(shape.n_layer / P)
        stage_params = (blocks * shape.block_params + max(shape.first_params, shape.last_params)
                        if P > 1 else shape.params)
        per_dp = global_batch_size // layout.dp
        return cls(micro=per_dp // layout.micro_batch_size, blocks=blocks,
                   recompute=_recompute(layout),
                   flops=shape.flops_per_token(seq_len) * (global_batch_size * seq_len),
                   params=stage_params * (shape.tp_split / T + 1 - shape.tp_split))


def _recompute(layout: LayoutSpec) -> float:
    """The compute's multiple for recomputation; memory budget b: the share 1 - b of the
    forward again (b = 0 about full's)."""
    if layout.activation_checkpointing == "budget":
        return 1 + (1 - layout.activation_checkpointing_budget) / 3
    return {"none": 1.0, "selective": 7 / 6, "full": 4 / 3}[layout.activation_checkpointing]


def _compute_seconds(shape: ModelShape, layout: LayoutSpec, cluster: Cluster, share: _Share,
                     *, seq_len: int, dtype: str) -> float:
    """The forward and backward of this rank's micro-batches: the profile's measured
    training steps, else the FLOPs at the device's rate; never below the FLOPs at the peak
    (so MFU <= 100%)."""
    work = share.flops * share.recompute
    fit = cluster.step_fit(dtype)
    if fit is None:
        compute = work / (cluster.world_size * cluster.flops(dtype))
    else:  # measured steps, each term of the fit for this rank's share of a micro-batch
        per_micro = fit.seconds(
            d_model=shape.d_model, n_layer=share.blocks * share.recompute, seq_len=seq_len,
            tokens=layout.micro_batch_size * seq_len / layout.tp, heads=shape.n_head,
            flops=work / (cluster.world_size * share.micro))
        compute = share.micro * per_micro
    return max(compute, work / (cluster.world_size * cluster.peak_flops(dtype)))


def _bubble(layout: LayoutSpec) -> float:
    """The pipeline's idle share of the compute (the module docstring's schedules)."""
    P, m, v = layout.pp, layout.microbatches, layout.virtual_stages
    if P == 1:
        return 0.0
    bubble = {"gpipe": (P - 1) / m, "1f1b": (P - 1) / m, "interleaved_1f1b": (P - 1) / (v * m),
              "zero_bubble": (P - 1) / (3 * v * m)}[layout.schedule]
    if m < P:  # too few micro-batches to fill the stages: no schedule hides the wait
        bubble = (P - 1) / m
    return bubble


def _activation_seconds(shape: ModelShape, layout: LayoutSpec, cluster: Cluster,
                        share: _Share, *, seq_len: int, dtype: str) -> tuple[float, float]:
    """The activations' traffic: tensor parallel's all-reduces, and the pipeline's sends with
    its schedule's own work, where a profile measured them."""
    T, P = layout.tp, layout.pp
    message = layout.micro_batch_size * seq_len * shape.d_model * DTYPE_BYTES[dtype]
    calls = 6 if layout.activation_checkpointing == "full" else 4
    tp = share.micro * share.blocks * calls * cluster.collective("all_reduce", message, T, T)
    if T > 1:  # what a real step spends on them (DTensor's dispatch, waits), where measured
        tp *= cluster.dp_exposed("tp_sp" if layout.sequence_parallel else "tp") or 1.0
    if P == 1:
        return tp, 0.0
    sent = message / (T if layout.sequence_parallel else 1)
    pp = share.micro * 2 * cluster.collective("send_recv", sent, 2, cluster.world_size)
    return tp, pp + share.micro * (cluster.pipeline_overhead(layout.schedule) or 0.0)


def _expert_seconds(shape: ModelShape, layout: LayoutSpec, cluster: Cluster, share: _Share,
                    *, seq_len: int, dtype: str) -> float:
    """Expert parallel's all-to-alls (see the module docstring); 0 without ep."""
    E = layout.ep
    if E == 1 or not shape.moe_layers:
        return 0.0
    # top-k from the active parameters: the routed experts a token uses of n_experts
    routed = (shape.active_params or shape.params) - (shape.params - shape.expert_params)
    top_k = max(1, round(shape.n_experts * routed / shape.expert_params))
    rows = layout.micro_batch_size * seq_len * top_k * shape.d_model * DTYPE_BYTES[dtype]
    calls = 6 if layout.activation_checkpointing == "full" else 4
    blocks = shape.moe_layers * share.blocks / shape.n_layer  # the stage's MoE blocks
    return share.micro * blocks * calls * cluster.collective(
        "all_to_all", rows, E, layout.tp * E)


def _data_parallel_seconds(layout: LayoutSpec, cluster: Cluster, share: _Share,
                           dtype: str) -> tuple[str, float]:
    """The layout's data-parallel engine ("ddp", "zero1", "fsdp2", or another without
    data-parallel collectives) and the modelled seconds of its collectives."""
    T, S, R = layout.tp, layout.dp_shard, layout.dp_replicate
    resolved = resolve_layout(layout, dtype)
    engine = resolved.engine.value
    family = "fsdp2" if engine.startswith("fsdp2") else engine
    if family not in DP_ENGINES:
        return family, 0.0
    passes = share.micro if layout.pp == 1 else 1  # a pipeline gathers once per schedule step
    return family, data_parallel_seconds(
        family, cluster.collective, params=share.params, units=share.blocks + 1, shard=S,
        replicate=R, spans=(T * S * R, T * S),
        gathers=passes * (2 if layout.zero_stage == 3 else 1),
        gathered_bytes=DTYPE_BYTES[dtype] if resolved.param_dtype is not None else 4)


def _offload_seconds(shape: ModelShape, layout: LayoutSpec, cluster: Cluster,
                     est: Estimate | None, *, seq_len: int, dtype: str) -> float:
    """Offloaded states moved each step: over the host link to and from the CPU (and its
    optimizer step there), or read and written on the node's disk, which its ranks share."""
    if layout.offload not in ("cpu", "disk"):
        return 0.0
    est = est or estimate(shape, layout, seq_len=seq_len, dtype=dtype)
    states = est.host - est.detail.get("activations_on_host", 0.0)
    if layout.offload == "cpu":
        return 2 * states / cluster.device.host_link + states / 20e9
    offload = 2 * est.disk * cluster.gpus_per_node / cluster.disk_bandwidth
    if layout.offload_params:  # + the shards and gradients over the host link (as "cpu")
        moved = est.detail["params_on_disk"] + est.host
        offload += 2 * moved / cluster.device.host_link
    return offload


def _activation_offload_seconds(layout: LayoutSpec, cluster: Cluster, est: Estimate | None,
                                share: _Share, compute: float) -> float:
    """Activation offload: each micro-batch's saved activations out to the host and back over
    the host link, on a side stream that overlaps the compute; what the compute does not
    cover is exposed, and the overlapped part is still charged 10% (as the data-parallel
    traffic's)."""
    if not layout.activation_offload or est is None:
        return 0.0
    per_micro = est.detail.get("activations_on_host", 0.0) / in_flight(layout)
    moved = 2 * per_micro * share.micro / cluster.device.host_link
    return max(moved - compute, 0.0) + 0.1 * min(moved, compute)


def _optimizer_seconds(layout: LayoutSpec, cluster: Cluster, share: _Share, dtype: str) -> float:
    """The optimizer step over this rank's parameters (ZeRO: its shard), where a profile
    measured one; else 0 (the data sheet's model leaves it out)."""
    fit = cluster.step_fit(dtype)
    if fit is None:
        return 0.0
    return share.params / (layout.dp_shard if layout.zero_stage >= 1 else 1) \
        * fit.optimizer_per_param


def _exposed(dp: float, compute: float, scale: float | None) -> tuple[float, float]:
    """The data-parallel collectives' seconds not hidden behind the compute, and those the
    step is charged: the measured exposed share where a profile has one (`scale`), else what
    80% of the compute cannot hide."""
    if scale is not None:  # measured on this machine: the exposed share of the modelled time
        return dp * scale, dp * scale
    exposed = max(0.0, dp - 0.8 * compute)
    # Overlapped collectives still take memory bandwidth and SMs from the compute: 10% of
    # their time is charged (so that, all else equal, less traffic ranks first).
    return exposed, exposed + 0.1 * (dp - exposed)
