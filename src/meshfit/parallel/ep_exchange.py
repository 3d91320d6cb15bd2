"""The all-to-all exchange of expert parallelism (`ExpertParallel.dispatch`), shared by
meshfit's MoE blocks (`meshfit.parallel.ep`) and transformers' (`meshfit.parallel.ep_hf`);
the algorithm is described in `meshfit.parallel.ep`'s docstring."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["ExpertParallel"]


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` with variable splits, differentiable (backward sends the
    gradients back along the same routes), timed when its owner asks."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, owner):
        ctx.out_splits, ctx.in_splits, ctx.group, ctx.owner = out_splits, in_splits, group, owner
        return owner._exchange(x.contiguous(), out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        back = ctx.owner._exchange(grad.contiguous(), ctx.in_splits, ctx.out_splits, ctx.group)
        return back, None, None, None, None


class ExpertParallel:
    """The ``ep`` group of one MoE block and the all-to-all exchange around its experts."""

    def __init__(self, group, size: int, rank: int, n_experts: int) -> None:
        self.group, self.size, self.rank = group, size, rank
        self.n_local = n_experts // size
        self.timing = False
        """Add the wall time of every exchange (forward and backward) to `seconds`; on CUDA
        this synchronises the device around each exchange."""
        self.seconds = 0.0

    def _exchange(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                  group) -> torch.Tensor:
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        if self.timing:
            if x.is_cuda:
                torch.cuda.synchronize(x.device)
            start = time.perf_counter()
        dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
        if self.timing:
            if x.is_cuda:
                torch.cuda.synchronize(x.device)
            self.seconds += time.perf_counter() - start
        return out

    def dispatch(self, xs: torch.Tensor, counts: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        """Expert outputs for this rank's rows `xs` [M, d], sorted by global expert with
        counts[e] rows each: rows are computed on their experts' ranks and come back in the
        order they were sent."""
        P, L = self.size, self.n_local
        send = counts.reshape(P, L).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)  # recv[q, e]: rows from q for e
        in_splits = send.sum(dim=1).tolist()
        out_splits = recv.sum(dim=1).tolist()
        rows = _AllToAll.apply(xs, out_splits, in_splits, self.group, self)
        # Arrival order is (source, local expert); the experts want (local expert, source).
        expert_of_row = torch.repeat_interleave(
            torch.arange(L, device=recv.device).repeat(P), recv.reshape(-1))
        order = torch.argsort(expert_of_row, stable=True)
        out = experts(rows[order], recv.sum(dim=0))
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        return _AllToAll.apply(out[back], in_splits, out_splits, self.group, self)
