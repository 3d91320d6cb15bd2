"""Pipeline parallel on a 1-D ``pp`` mesh, on `torch.distributed.pipelining`.

The model's blocks are cut into contiguous stages (GPipe, Huang et al. 2019); each rank runs
its stage(s) and a torch schedule passes activations forward and gradients backward between
ranks, one micro-batch ("chunk" in the guide) at a time. Where a model can be cut is data:
its `PipelinePlan` (`meshfit.models.plans`; built in for the reference GPT, Hugging Face
Llama and GPT-2).

    split.py     where to cut (`split_points`, `block_times`) and the stage modules
    schedule.py  schedules by name, their validation, timed stages, the exact batch-mean loss
    pipeline.py  `Pipeline`: one batch per `step`, tied weights kept equal, clipping, export
    build.py     `build_pipeline`: stages + schedule for this rank
    bubble.py    idle time measured from timings, and the textbook figure
"""

from meshfit.parallel.pp.bubble import (bubble_fraction, bubble_ratio, gather_timings,
                                        theoretical_bubble)
from meshfit.parallel.pp.build import build_pipeline
from meshfit.parallel.pp.pipeline import Pipeline
from meshfit.parallel.pp.schedule import (SCHEDULES, check_pipeline, pipeline_problem,
                                          stage_placement)
from meshfit.parallel.pp.split import StageBlocks, block_times, build_stage_module, split_points

__all__ = ["SCHEDULES", "Pipeline", "StageBlocks", "block_times", "bubble_fraction",
           "bubble_ratio", "build_pipeline", "build_stage_module", "check_pipeline",
           "gather_timings", "pipeline_problem", "split_points", "stage_placement",
           "theoretical_bubble"]
