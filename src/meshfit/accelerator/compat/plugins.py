"""Accelerate's configuration objects and plugins (fields and defaults of Accelerate 1.15);
`meshfit.accelerator.arguments` translates them into meshfit's options.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from meshfit.accelerator.compat.handlers import KwargsHandler

__all__ = ["DataLoaderConfiguration", "FullyShardedDataParallelPlugin",
           "GradientAccumulationPlugin", "ProjectConfiguration"]


@dataclass
class DataLoaderConfiguration:
    """How `Accelerator.prepare` shards data loaders (Accelerate's fields and defaults).

    split_batches, even_batches: see `meshfit.accelerator.sampler`.
    dispatch_batches: None or False (True is not available: every meshfit rank reads its own
        batches; for an IterableDataset, see `meshfit.accelerator.stream`).
    use_seedable_sampler, data_seed: shuffle each epoch with a generator seeded
        ``data_seed + epoch`` (``data_seed`` None: ``torch.initial_seed()`` when prepared).
    non_blocking: accepted (meshfit copies batches to CUDA devices ahead, non-blocking,
        whatever the value).
    use_stateful_dataloader: `load_state` puts every prepared loader back where it was (on
        any number of processes); False (Accelerate's default): loaders are left as they are.
    """

    split_batches: bool = False
    dispatch_batches: Optional[bool] = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: Optional[int] = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False


@dataclass
class ProjectConfiguration:
    """Where a run writes: ``project_dir``, ``logging_dir`` (trackers; default project_dir);
    ``automatic_checkpoint_naming``: see `meshfit.accelerator.state`."""

    project_dir: Optional[str] = None
    logging_dir: Optional[str] = None
    automatic_checkpoint_naming: bool = False
    total_limit: Optional[int] = None
    iteration: int = 0
    save_on_each_node: bool = False

    def set_directories(self, project_dir: Optional[str] = None) -> None:
        self.project_dir = project_dir
        if self.logging_dir is None:
            self.logging_dir = project_dir

    def __post_init__(self) -> None:
        self.set_directories(self.project_dir)


@dataclass
class GradientAccumulationPlugin(KwargsHandler):
    """Gradient accumulation: ``num_steps`` micro-batches per optimizer step;
    ``sync_with_dataloader``: also step at the end of each data loader; ``sync_each_batch``:
    meshfit's; ``adjust_scheduler`` has no effect on learning rates (in Accelerate it only
    counts the scheduler's internal step counter)."""

    num_steps: Optional[int] = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False


@dataclass
class FullyShardedDataParallelPlugin:
    """Accelerate's FSDP plugin, mapped onto meshfit's FSDP2 layouts.

    Every process shards the model (``ParallelDims(dp_shard=world)``): ``reshard_after_forward``
    True / ``sharding_strategy`` "FULL_SHARD" (the default) is ZeRO-3, False /
    "SHARD_GRAD_OP" is ZeRO-2, "NO_SHARD" is DDP; "HYBRID_SHARD" is refused (use
    ``Accelerator(parallel=ParallelDims(dp_replicate=R, dp_shard=S))``). ``cpu_offload``
    keeps the shards in host memory (ZeRO-3 only); ``activation_checkpointing`` recomputes
    every transformer block; ``mixed_precision_policy`` "bf16"/"fp16" (or a dict/object
    whose param_dtype is one) sets the Accelerator's mixed precision. Wrapping is meshfit's
    own (per transformer block); the other fields are accepted and have no effect.
    """

    fsdp_version: Optional[int] = None
    sharding_strategy: Any = None
    reshard_after_forward: Any = None
    backward_prefetch: Any = None
    mixed_precision_policy: Any = None
    auto_wrap_policy: Any = None
    cpu_offload: Any = None
    ignored_modules: Any = None
    state_dict_type: Any = None
    state_dict_config: Any = None
    optim_state_dict_config: Any = None
    limit_all_gathers: bool = True
    use_orig_params: Optional[bool] = None
    param_init_fn: Optional[Callable] = None
    sync_module_states: Optional[bool] = None
    forward_prefetch: Optional[bool] = None
    activation_checkpointing: Optional[bool] = None
    cpu_ram_efficient_loading: Optional[bool] = None
    transformer_cls_names_to_wrap: Optional[list] = None
    min_num_params: Optional[int] = None

    def zero_stage(self) -> int:
        """The ZeRO stage this plugin asks for: 3, 2, or 0 (no sharding)."""
        strategy = self.reshard_after_forward
        if strategy is None:
            strategy = self.sharding_strategy
        if strategy is None or strategy is True:
            return 3
        if strategy is False:
            return 2
        name = str(getattr(strategy, "name", strategy)).upper()
        if name.isdigit():  # Accelerate's numbered strategies: 1 FULL_SHARD, 2 SHARD_GRAD_OP, ...
            name = {"1": "FULL_SHARD", "2": "SHARD_GRAD_OP", "3": "NO_SHARD",
                    "4": "HYBRID_SHARD", "5": "HYBRID_SHARD_ZERO2"}.get(name, name)
        stages = {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2, "NO_SHARD": 0}
        if name not in stages:
            raise ValueError(f"FullyShardedDataParallelPlugin: sharding {name} is not available; "
                             "use FULL_SHARD, SHARD_GRAD_OP or NO_SHARD, or "
                             "Accelerator(parallel=ParallelDims(dp_replicate=R, dp_shard=S)) "
                             "for hybrid sharding")
        return stages[name]

    def offload(self) -> str:
        policy = self.cpu_offload
        on = bool(getattr(policy, "offload_params", True)) if policy not in (None, False) \
            else False
        return "cpu" if on else "none"

    def mixed_precision(self) -> Optional[str]:
        """"bf16", "fp16" or None (not set by the plugin)."""
        policy = self.mixed_precision_policy
        if policy is None:
            return None
        dtype = policy if isinstance(policy, (str, torch.dtype)) else (
            policy.get("param_dtype") if isinstance(policy, dict)
            else getattr(policy, "param_dtype", None))
        names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "no",
                 "bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16",
                 "fp32": "no", "float32": "no", None: None}
        key = dtype if not isinstance(dtype, str) else dtype.replace("torch.", "")
        if key not in names:
            raise ValueError(f"FullyShardedDataParallelPlugin: mixed_precision_policy "
                             f"{policy!r} is not available; use 'bf16', 'fp16' or 'fp32'")
        return names[key]
