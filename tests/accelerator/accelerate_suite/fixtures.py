"""What Accelerate's test scripts import from ``accelerate.test_utils``, for their runs under
meshfit (`runner.as_meshfit`): the regression dataset and model are Accelerate's own (plain
torch), the helpers that read the framework's state read meshfit's."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from accelerate.test_utils.training import RegressionDataset, RegressionModel  # noqa: F401

from meshfit.state import AcceleratorState
from meshfit.utils import gather


def are_the_same_tensors(tensor: torch.Tensor) -> bool:
    """Whether every process holds the same `tensor` (as Accelerate's helper)."""
    state = AcceleratorState()
    tensor = tensor[None].clone().to(state.device)
    tensors = gather(tensor).cpu()
    return all(torch.equal(t, tensor[0].cpu()) for t in tensors)


@contextmanager
def assert_exception(exception_class: type, msg: str | None = None):
    """The block must raise `exception_class` (whose message contains `msg`, if given)."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 - checked below
        assert isinstance(err, exception_class), f"{type(err).__name__} raised, not " \
            f"{exception_class.__name__}: {err}"
        assert msg is None or msg in str(err), f"{msg!r} not in {err}"
        return
    raise AssertionError(f"{exception_class.__name__} was not raised")
