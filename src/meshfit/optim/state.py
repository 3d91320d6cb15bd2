"""`state_bytes`: the optimizer state a live optimizer holds, measured per parameter kind."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshfit.distributed.tensors import local_tensor, storage_bytes

__all__ = ["StateReport", "format_report", "state_bytes"]


@dataclass(frozen=True, kw_only=True)
class StateReport:
    """Bytes of optimizer state, measured on a live optimizer (see `state_bytes`)."""

    total_bytes: int
    """All state tensors, each storage once (a shared lookup table counts once)."""
    num_params: int
    """Parameter elements the optimizer holds (local shards for DTensors)."""
    matrix_bytes: int
    """State of parameters with ndim >= 2."""
    matrix_params: int
    """Elements of parameters with ndim >= 2."""

    @property
    def other_bytes(self) -> int:
        """State of 1-D and 0-D parameters (biases, norm weights)."""
        return self.total_bytes - self.matrix_bytes

    @property
    def other_params(self) -> int:
        return self.num_params - self.matrix_params

    @property
    def bytes_per_param(self) -> float:
        return _ratio(self.total_bytes, self.num_params)

    @property
    def matrix_bytes_per_param(self) -> float:
        return _ratio(self.matrix_bytes, self.matrix_params)

    @property
    def other_bytes_per_param(self) -> float:
        return _ratio(self.other_bytes, self.other_params)


def _ratio(num: int, den: int) -> float:
    return num / den if den else 0.0


def state_bytes(optimizer: torch.optim.Optimizer) -> StateReport:
    """Measure `optimizer.state`: bytes of every tensor it holds, per parameter kind, each
    storage once (`meshfit.distributed.tensors.storage_bytes`: a lookup table shared by all
    of bitsandbytes' states counts once). Scalar `step` tensors count; Python numbers in the
    state do not (they are not tensor memory). State is created lazily by most optimizers:
    measure after the first step."""
    seen_storage: set[tuple[str, int]] = set()
    seen_params: set[int] = set()
    total = matrix = n_params = n_matrix = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in seen_params:
                continue
            seen_params.add(id(p))
            numel = local_tensor(p).numel()
            nbytes = storage_bytes(optimizer.state.get(p, {}), seen_storage)
            total, n_params = total + nbytes, n_params + numel
            if p.ndim >= 2:
                matrix, n_matrix = matrix + nbytes, n_matrix + numel
    return StateReport(total_bytes=total, num_params=n_params, matrix_bytes=matrix,
                       matrix_params=n_matrix)


def format_report(reports: dict[str, StateReport]) -> str:
    """A small fixed-width table: one row per optimizer, bytes/param overall and split."""
    header = ("optimizer", "params", "state MiB", "B/param", "matrix B/param", "other B/param")
    rows = [header] + [
        (name, f"{r.num_params:,}", f"{r.total_bytes / 2**20:.3f}", f"{r.bytes_per_param:.3f}",
         f"{r.matrix_bytes_per_param:.3f}", f"{r.other_bytes_per_param:.3f}")
        for name, r in reports.items()]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                       enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
