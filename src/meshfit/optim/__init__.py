"""Optimizers by name, with weight-decay parameter groups and a measured state-size report.

    optimizer = build("adamw_fused", model, lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95))
    print(format_report({"adamw_fused": state_bytes(optimizer)}))   # after a step

Build the optimizer after the model is parallelised (torchtitan's order): the parameters it
is given are then the sharded DTensors and the fused kernel can check their device.

Optimizer state per trainable parameter element (fp32 parameters), as `state_bytes`
measures it on a live optimizer:

    adamw, adamw_fused  8 B      exp_avg + exp_avg_sq in fp32 (Loshchilov & Hutter 2019).
                                 `adamw` uses the foreach kernels, `adamw_fused` the fused one
                                 (fastest on CPU and GPU; measured on CPU with torch 2.13:
                                 29 ms per step vs 135 foreach, 189 loop, 33.5M parameters).
    adamw_8bit          ~2 B     both moments as uint8 codes with one fp32 scale per block of
                                 256 (+4/256 B per moment) and 256-entry fp32 lookup tables
                                 (Dettmers et al. 2022, "8-bit Optimizers via Block-wise
                                 Quantization"). Only tensors of >= 4096 elements are quantized
                                 (torchao: also a multiple of its block_size); smaller ones
                                 (biases, norms) keep 8 B fp32 state. bitsandbytes on CUDA
                                 (tables shared by all parameters: 2.03 B/param on matrices),
                                 torchao elsewhere (2 KiB of tables per matrix: 2.09 B/param on
                                 the tiny GPT's). torchao compiles its step per parameter shape
                                 on first use and keeps lr as a tensor, which torch's
                                 LRScheduler fills in place.
    adamw_bf16_states   4 B      exp_avg + exp_avg_sq in bf16, the step computed in fp32
                                 (`meshfit.optim.states.AdamWBf16States`).
    adamw_4bit          ~1.06 B  torchao's AdamW4bit: 4-bit codes, one fp32 scale per block of
                                 128 and 16-entry tables (Li et al. 2023); as adamw_8bit, only
                                 tensors of >= 4096 elements. These two and adamw_bf16_states
                                 round bf16 weights stochastically, with bits that depend on
                                 the element's place in the whole tensor and not on the
                                 layout (`meshfit.optim.rounding`); the torchao ones decide
                                 which tensors to quantize on the whole tensor
                                 (`meshfit.optim.states`).
    adafactor           ~(r+c)*4 per r x c matrix: a factored second moment, one row and one
                                 column vector, and no first moment (Shazeer & Stern 2018);
                                 4 B for vectors. torch.optim.Adafactor.
    sgd                 4 B      the momentum buffer (none with momentum=0).
    muon                4 B      on the blocks' matrices: one momentum buffer (Jordan et al.
                                 2024); 8 B (AdamW) on embeddings, head, norms and biases
                                 (`meshfit.optim.muon`).

AdamW, Adafactor and torchao also keep a scalar `step` tensor per parameter tensor (4 B, not
per element); bitsandbytes keeps a Python int, SGD none.
"""

from meshfit.optim.build import build
from meshfit.optim.groups import param_groups
from meshfit.optim.muon import Muon, sharded_class
from meshfit.optim.state import StateReport, format_report, state_bytes
from meshfit.optim_names import OPTIMIZERS, OptimizerName

__all__ = ["Muon", "OPTIMIZERS", "OptimizerName", "StateReport", "build", "format_report",
           "param_groups", "sharded_class", "state_bytes"]
