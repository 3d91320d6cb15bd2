"""Accelerate's data-loader functions that work without an `Accelerator`:
`prepare_data_loader` (over the processes of `PartialState`, or the ones given) and
`skip_first_batches`."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from meshfit.accelerator.loader import PreparedDataLoader
from meshfit.accelerator.shared_state import PartialState

__all__ = ["prepare_data_loader", "skip_first_batches"]


def prepare_data_loader(dataloader: DataLoader, device: torch.device | None = None,
                        num_processes: int | None = None, process_index: int | None = None,
                        split_batches: bool = False, put_on_device: bool = False,
                        rng_types: list | None = None, dispatch_batches: bool | None = None,
                        even_batches: bool = True, slice_fn_for_dispatch=None,
                        use_seedable_sampler: bool = False, data_seed: int | None = None,
                        non_blocking: bool = False, use_stateful_dataloader: bool = False,
                        torch_device_mesh=None) -> PreparedDataLoader:
    """`dataloader` sharded as `Accelerator.prepare` shards it (Accelerate's arguments and
    defaults): process `process_index` of `num_processes` (default: this one of
    `PartialState`'s) gets its batches, on `device` with `put_on_device`.
    ``dispatch_batches=True``: process 0 reads the loader and sends each process its part."""
    if slice_fn_for_dispatch is not None or torch_device_mesh is not None:
        raise ValueError("prepare_data_loader: slice_fn_for_dispatch and torch_device_mesh "
                         "are not supported; leave them None (an Accelerator built with "
                         "parallelism_config shards by its mesh)")
    state = PartialState()
    num_processes = state.num_processes if num_processes is None else num_processes
    process_index = state.process_index if process_index is None else process_index
    device = (device or state.device) if put_on_device else torch.device("cpu")
    return PreparedDataLoader(
        dataloader, device=device, num_replicas=num_processes, rank=process_index,
        even_batches=even_batches, split_batches=split_batches,
        seedable=use_seedable_sampler, data_seed=data_seed,
        sync_generator=rng_types is None or "generator" in [str(r) for r in rng_types],
        dispatch=bool(dispatch_batches))


def skip_first_batches(dataloader, num_batches: int = 0):
    """`dataloader` (prepared, or a plain DataLoader: prepared for this process alone) whose
    next iteration leaves out its first `num_batches` batches."""
    if not isinstance(dataloader, PreparedDataLoader):
        dataloader = PreparedDataLoader(dataloader, device=torch.device("cpu"), num_replicas=1,
                                        rank=0)
    dataloader.skip_first_batches(num_batches)
    return dataloader
