"""Mixed precision: autocast for the forward pass, dynamic loss scaling for fp16.

Master weights and optimizer state stay in fp32: autocast only changes the dtype of the
operations' outputs inside the forward pass (Micikevicius et al., 2018, "Mixed Precision
Training"). fp16 has a narrow exponent range, so its losses are multiplied by a dynamic scale
and a step whose gradients overflow is skipped (torch.amp.GradScaler); bf16 has fp32's range
and needs no scaling.
"""

from __future__ import annotations

import contextlib
from typing import Literal, get_args

import torch

from meshfit.ops import apply_to_tensors

MixedPrecision = Literal["no", "bf16", "fp16"]
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_mixed_precision(value: object, field: str = "mixed_precision") -> str:
    if value not in get_args(MixedPrecision):
        raise ValueError(f"{field}={value!r} is not a precision meshfit knows; use one of "
                         f"{', '.join(repr(v) for v in get_args(MixedPrecision))}")
    return value  # type: ignore[return-value]


class Precision:
    """Autocast context and (for fp16) a GradScaler for one device type."""

    def __init__(self, mode: str, device: torch.device):
        self.mode = check_mixed_precision(mode)
        self.device_type = device.type
        self.dtype = _DTYPES.get(self.mode)
        if self.dtype is not None and not torch.amp.is_autocast_available(self.device_type):
            raise ValueError(f"mixed_precision={mode!r}: autocast is not available on "
                             f"{self.device_type}; use mixed_precision='no'")
        self.scaler = torch.amp.GradScaler(self.device_type) if self.mode == "fp16" else None

    def autocast(self):
        """A context that runs the enclosed operations in the low-precision dtype."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def wrap_forward(self, module: torch.nn.Module) -> None:
        """Run `module`'s forward under autocast, returning fp32 floating outputs (as
        Accelerate's convert_outputs_to_fp32) so that losses computed outside stay exact."""
        if self.dtype is None or getattr(module, "_meshfit_autocast", False):
            return
        forward = module.forward
        precision = self

        def autocast_forward(*args, **kwargs):
            with precision.autocast():
                out = forward(*args, **kwargs)
            return _to_fp32(out)

        module.forward = autocast_forward
        module._meshfit_autocast = True


def _to_fp32(obj):
    def upcast(t: torch.Tensor) -> torch.Tensor:
        return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t

    return apply_to_tensors(upcast, obj)
