"""What this machine has, as Accelerate's ``is_*_available`` helpers answer it (devices,
precisions, optional packages; a package is available when it can be imported, looked up
without importing it), and `synchronize_rng_states`."""

from __future__ import annotations

import importlib.util

import torch

from meshfit.accelerator.shuffle import broadcast_state

__all__ = ["is_aim_available", "is_bf16_available", "is_bnb_available",
           "is_clearml_available", "is_comet_ml_available", "is_cuda_available",
           "is_datasets_available", "is_deepspeed_available", "is_dvclive_available",
           "is_fp16_available", "is_hpu_available", "is_mlflow_available", "is_mlu_available",
           "is_mps_available", "is_npu_available", "is_peft_available", "is_pytest_available",
           "is_rich_available", "is_safetensors_available", "is_schedulefree_available",
           "is_swanlab_available",
           "is_tensorboard_available", "is_timm_available", "is_torch_xla_available",
           "is_torchvision_available", "is_trackio_available", "is_transformers_available",
           "is_wandb_available", "is_xpu_available", "synchronize_rng_state",
           "synchronize_rng_states"]


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _package(name: str):
    def available() -> bool:
        return _importable(name)
    available.__name__ = f"is_{name}_available"
    available.__doc__ = f"Whether ``{name}`` can be imported."
    return available


is_aim_available = _package("aim")
is_clearml_available = _package("clearml")
is_comet_ml_available = _package("comet_ml")
is_datasets_available = _package("datasets")
is_deepspeed_available = _package("deepspeed")
is_dvclive_available = _package("dvclive")
is_mlflow_available = _package("mlflow")
is_peft_available = _package("peft")
is_pytest_available = _package("pytest")
is_rich_available = _package("rich")
is_safetensors_available = _package("safetensors")
is_schedulefree_available = _package("schedulefree")
is_swanlab_available = _package("swanlab")
is_timm_available = _package("timm")
is_torchvision_available = _package("torchvision")
is_trackio_available = _package("trackio")
is_transformers_available = _package("transformers")
is_wandb_available = _package("wandb")
is_bnb_available = _package("bitsandbytes")


def is_tensorboard_available() -> bool:
    """Whether TensorBoard's writer can be used (``tensorboard`` or ``tensorboardX``)."""
    return _importable("tensorboard") or _importable("tensorboardX")


def is_cuda_available() -> bool:
    return torch.cuda.is_available()


def is_mps_available(min_version: str = "1.12") -> bool:
    return torch.backends.mps.is_available() and torch.backends.mps.is_built()


def is_xpu_available(check_device: bool = False) -> bool:
    return hasattr(torch, "xpu") and torch.xpu.is_available()


def is_npu_available(check_device: bool = False) -> bool:
    return _importable("torch_npu") and hasattr(torch, "npu") and torch.npu.is_available()


def is_mlu_available(check_device: bool = False) -> bool:
    return _importable("torch_mlu") and hasattr(torch, "mlu") and torch.mlu.is_available()


def is_hpu_available(init_hccl: bool = False) -> bool:
    return _importable("habana_frameworks") and hasattr(torch, "hpu") and \
        torch.hpu.is_available()


def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    return _importable("torch_xla")


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """As Accelerate's: the GPU's answer on CUDA, True on the CPU (autocast runs bf16)."""
    if is_cuda_available():
        return torch.cuda.is_bf16_supported()
    return True


def is_fp16_available() -> bool:
    """As Accelerate's: True (but on Gaudi 1, which meshfit does not run on)."""
    return True


def synchronize_rng_state(rng_type: str | None = None,
                          generator: torch.Generator | None = None) -> None:
    """Give every process process 0's state of one generator: "torch" (the global CPU one),
    "cuda", "xpu" or "generator" (`generator`)."""
    kind = str(rng_type)
    if kind == "torch":
        torch.set_rng_state(broadcast_state(torch.get_rng_state()))
    elif kind == "cuda":
        torch.cuda.set_rng_state(broadcast_state(torch.cuda.get_rng_state()))
    elif kind == "xpu":
        torch.xpu.set_rng_state(broadcast_state(torch.xpu.get_rng_state()))
    elif kind == "generator":
        if generator is None:
            raise ValueError("synchronize_rng_state('generator') needs generator=")
        generator.set_state(broadcast_state(generator.get_state()))
    else:
        raise ValueError(f"rng_type={rng_type!r} is not supported; use 'torch', 'cuda', 'xpu' "
                         "or 'generator'")


def synchronize_rng_states(rng_types, generator: torch.Generator | None = None) -> None:
    """`synchronize_rng_state` for each of `rng_types` (a collective)."""
    for rng_type in rng_types:
        synchronize_rng_state(rng_type, generator=generator)
