"""Pipeline parallel on a 1-D ``pp`` mesh, on `torch.distributed.pipelining`.

The model's blocks are cut into contiguous stages (GPipe, Huang et al. 2019); each rank runs
its stage(s) and a torch schedule passes activations forward and gradients backward between
ranks, one micro-batch ("chunk" in the guide) at a time. Where a model can be cut is data:
its `PipelinePlan` (`meshfit.models.plans`; built in for the reference GPT and GPT-2, read
from transformers' own ``base_model_pp_plan`` for every other transformers decoder).
`pp_problem(model_or_config, pp, virtual_stages)` says in one line why a model cannot be cut.

    split.py     where to cut (`split_points`, `block_times`, `pp_problem`), stage modules
    schedule.py  schedules by name, their validation, timed stages, the exact batch-mean loss
    pipeline.py  `Pipeline`: one batch per `step`, tied weights kept equal, clipping, export
    build.py     `build_pipeline`: stages + schedule for this rank
    bubble.py    idle time measured from timings, and the textbook figure

Names load on first use: the bubble figures and the schedule names need no torch
(`meshfit pipeline-chart` reads a finished run without it).
"""

from __future__ import annotations

from meshfit._lazy import lazy_exports

_EXPORTS = {"SCHEDULES": "meshfit.parallel.options",
            **{n: "meshfit.parallel.pp.bubble" for n in ("bubble_fraction", "bubble_ratio",
                                                         "gather_timings", "theoretical_bubble")},
            "build_pipeline": "meshfit.parallel.pp.build",
            "Pipeline": "meshfit.parallel.pp.pipeline",
            **{n: "meshfit.parallel.pp.schedule" for n in ("check_pipeline", "pipeline_problem",
                                                           "stage_placement")},
            **{n: "meshfit.parallel.pp.split" for n in ("StageBlocks", "block_times",
                                                        "build_stage_module", "pp_problem",
                                                        "split_points")}}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
