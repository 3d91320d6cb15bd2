"""`LocalSGD` (Accelerate's ``accelerate.local_sgd``): data-parallel processes train on their
own, gradients not synchronised, and average their parameters every `local_sgd_steps`
optimizer steps (Lin et al., "Don't Use Large Mini-Batches, Use Local SGD", ICLR 2020;
Stich, "Local SGD Converges Fast and Communicates Little", ICLR 2019): fewer, larger
exchanges than DDP's all-reduce of every step's gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshfit.accelerator.compat.config import DistributedType

__all__ = ["LocalSGD"]


class LocalSGD:
    """``with LocalSGD(accelerator, model, local_sgd_steps=8) as local_sgd:`` around the
    loop, ``local_sgd.step()`` after each ``optimizer.step()``. Inside the block the model's
    backward passes do not synchronise; every `local_sgd_steps` steps, and on leaving the
    block, the parameters are averaged over the data-parallel processes. One process, or
    ``enabled=False``: nothing changes. Data parallel (DDP) only, as Accelerate's."""

    def __init__(self, accelerator, model: torch.nn.Module, local_sgd_steps: int,
                 enabled: bool = True):
        kind = accelerator.distributed_type
        if kind not in (DistributedType.NO, DistributedType.MULTI_CPU,
                        DistributedType.MULTI_GPU, DistributedType.MULTI_XPU,
                        DistributedType.MULTI_NPU, DistributedType.MULTI_MLU,
                        DistributedType.MULTI_HPU):
            raise NotImplementedError(f"LocalSGD runs on data parallel (DDP) layouts; this "
                                      f"one is {kind}: use zero_stage=0 (or 1)")
        if isinstance(local_sgd_steps, bool) or not isinstance(local_sgd_steps, int) or \
                local_sgd_steps < 1:
            raise ValueError(f"local_sgd_steps={local_sgd_steps!r} must be an integer >= 1")
        self.enabled = enabled and kind != DistributedType.NO
        self.num_steps = 0
        self.accelerator, self.model, self.local_sgd_steps = accelerator, model, local_sgd_steps
        self._no_sync = None

    def __enter__(self):
        if self.enabled:
            self._no_sync = self.accelerator.no_sync(self.model)
            self._no_sync.__enter__()
        return self

    def __exit__(self, kind, value, traceback):
        if self.enabled:
            self._average()  # the last steps' too
            self._no_sync.__exit__(kind, value, traceback)

    def step(self) -> None:
        """One optimizer step done; every `local_sgd_steps`-th averages the parameters."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._average()

    @torch.no_grad()
    def _average(self) -> None:
        """Every parameter replaced by its mean over the data-parallel processes."""
        acc = self.accelerator
        group, size = acc.runtime.dp_group, acc.runtime.dp_size
        if size == 1:
            return
        for param in self.model.parameters():
            dist.all_reduce(param.data, group=group)
            param.data /= size
