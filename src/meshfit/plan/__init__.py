"""Choosing a layout: the multi-GPU guide's first step made executable.

    from meshfit.plan import Cluster, search, DEVICES
    result = search("llama-7b", Cluster(gpus_per_node=8, nodes=2, device=DEVICES["h100"]),
                    seq_len=4096, global_batch_size=256)
    best = result.plans[0]       # .layout, .estimate.per_rank_bytes, .step_time_s, .mfu, .why

    devices.py    what a device, an interconnect and a network are assumed to do
    search.py     enumeration (meshfit's `Layout.candidates`), memory fit, ranking
    cost.py       the cost model: a cluster (`Cluster`) and a layout's predicted step time
    calibrate.py  this machine's measured throughput, collectives and engines: the file
                  (its schema, each figure's meaning) and its loader
    fit.py        the models those figures belong to (a collective, a training step, the
                  data-parallel engines' collectives) and the fits that find them
    probes.py     the timed probes: matmul, memory, collectives, training steps, engines
    trust.py      which of a file's figures can be told from noise (the flags calibrate
                  writes and the planner heeds)
    measure.py    `measure`: the probes on every rank, then tensor parallel and pipelines
                  against the planner's own prediction (the command: `meshfit.cli.calibrate`)
"""

from meshfit.plan.cost import Cluster, predict
from meshfit.plan.devices import DEVICES, INTERCONNECTS, NETWORKS, Device, Link, parse_bytes
from meshfit.plan.search import Plan, SearchResult, search

__all__ = ["DEVICES", "INTERCONNECTS", "NETWORKS", "Cluster", "Device", "Link", "Plan",
           "SearchResult", "parse_bytes", "predict", "search"]
