"""Mixed precision: autocast for the forward pass, dynamic loss scaling for fp16. Master
weights and optimizer state stay fp32: autocast only changes the dtype of operations' outputs
inside the forward (Micikevicius et al., 2018). fp16's narrow exponent range needs losses
multiplied by a dynamic scale, and steps whose gradients overflow skipped (GradScaler); bf16
has fp32's range.
"""

from __future__ import annotations

import contextlib

import torch

from meshfit.distributed.collectives import apply_to_tensors
from meshfit.parallel.layout import check_precision, precision_dtype

__all__ = ["Precision", "empty_device_cache", "set_tf32"]


def set_tf32(enabled: bool) -> bool:
    """Let fp32 matrix products and cuDNN convolutions use TF32 tensor cores (10-bit mantissa
    inputs, fp32 accumulation; NVIDIA Ampere and newer, no effect elsewhere), process-wide as
    PyTorch's own flags are. Returns whether the hardware has them."""
    if not isinstance(enabled, bool):
        raise ValueError(f"tf32={enabled!r} must be True or False")
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8


def empty_device_cache(device: torch.device) -> None:
    """Return the allocator's cached blocks of `device` to the driver (the CPU keeps none)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif device.type == "xpu" and hasattr(torch, "xpu"):
        torch.xpu.empty_cache()
    elif device.type == "mps" and hasattr(torch, "mps"):
        torch.mps.empty_cache()


def _check_autocast_runs(device_type: str, dtype: torch.dtype, mode: str) -> None:
    """One small linear layer forward and backward under autocast; a clear error if this
    device cannot do it (older PyTorch releases have no fp16 kernels on CPU)."""
    device = "cuda" if device_type == "cuda" else device_type
    layer = torch.nn.Linear(8, 8, device=device)
    try:
        with torch.autocast(device_type=device_type, dtype=dtype):
            out = layer(torch.randn(2, 8, device=device))
        out.float().sum().backward()
    except RuntimeError as err:
        other = "bf16" if mode == "fp16" else "'no'"
        raise ValueError(f"mixed_precision={mode!r} does not run on {device_type} with this "
                         f"PyTorch ({str(err).splitlines()[0][:80]}); use "
                         f"mixed_precision={other!s}") from None


class Precision:
    """Autocast context and (for fp16) a GradScaler for one device type; `scaler_kwargs`
    and `autocast_kwargs`: GradScalerKwargs' / AutocastKwargs' fields, passed to torch."""

    def __init__(self, mode: str, device: torch.device, *, scaler_kwargs: dict | None = None,
                 autocast_kwargs: dict | None = None):
        check_precision(mode)  # the one list of modes: meshfit.parallel.rules
        self.mode = mode
        self.device_type = device.type
        self.dtype = precision_dtype(mode)
        if self.dtype is not None:
            if not torch.amp.is_autocast_available(self.device_type):
                raise ValueError(f"mixed_precision={mode!r}: autocast is not available on "
                                 f"{self.device_type}; use mixed_precision='no'")
            _check_autocast_runs(self.device_type, self.dtype, self.mode)
        self.autocast_kwargs = dict(autocast_kwargs or {})
        self.scaler = torch.amp.GradScaler(self.device_type, **(scaler_kwargs or {})) \
            if self.mode == "fp16" else None

    def autocast(self, **overrides):
        """A context that runs the enclosed operations in the low-precision dtype."""
        if self.dtype is None:
            return contextlib.nullcontext()
        kwargs = {**self.autocast_kwargs, **overrides}
        return torch.autocast(device_type=self.device_type, dtype=self.dtype, **kwargs)

    def wrap_forward(self, module: torch.nn.Module) -> None:
        """Run `module`'s forward under autocast, returning fp32 floating outputs (as
        Accelerate's convert_outputs_to_fp32) so that losses computed outside stay exact."""
        if self.dtype is None or getattr(module, "_meshfit_autocast", False):
            return
        forward = module.forward

        def autocast_forward(*args, **kwargs):
            with self.autocast():
                out = forward(*args, **kwargs)
            return _to_fp32(out)

        module.forward = autocast_forward
        module._meshfit_autocast = True


def _to_fp32(obj):
    return apply_to_tensors(
        lambda t: t.float() if t.dtype in (torch.float16, torch.bfloat16) else t, obj)
