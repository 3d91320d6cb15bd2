"""float8 training (`meshfit.parallel.float8`): which layers are converted, the numerics of
torchao's rowwise recipe against the recipe computed here by hand, a short training run against
fp32, and the refusals. The float8 kernels need a GPU of compute capability 8.9+; here torchao's
emulation runs the same casts and scales with the products in fp32."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshfit.models import GPT, GPTConfig
from meshfit.parallel.float8 import apply_float8, check_float8_device
from meshfit.parallel.options import ModelOptions

pytest.importorskip("torchao.float8")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def _gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=96, d_model=64, n_layer=2, n_head=4, d_ff=128,
                         max_seq_len=32))


def _rowwise(t: torch.Tensor) -> torch.Tensor:
    """The rowwise recipe's cast, by its definition: per row, scale = 448 / amax rounded down
    to a power of two, cast to e4m3, back to fp32 and unscaled."""
    amax = t.abs().amax(dim=-1, keepdim=True).double().clamp(min=1e-12)
    scale = torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax))).float()
    q = (t * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.float() / scale


def test_conversion_keeps_the_head_and_the_names():
    model = _gpt()
    names = list(model.state_dict())
    converted = apply_float8(model, emulate=True)
    f8 = [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]
    # 2 blocks x (wq, wk, wv, wo + the MLP's two or three linears); the head stays.
    assert converted == len(f8) and len(f8) >= 2 * 6
    assert type(model.lm_head) is nn.Linear
    assert list(model.state_dict()) == names  # checkpoints move between float8 and not


def test_only_multiples_of_16_are_converted():
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 24), nn.Linear(24, 64))
    assert apply_float8(model, emulate=True) == 1
    assert [type(m).__name__ for m in model] == ["Float8Linear", "Linear", "Linear"]


def test_rowwise_forward_and_backward_equal_the_recipe_by_hand():
    torch.manual_seed(0)
    ref = nn.Linear(64, 48, bias=False)
    model = nn.Sequential(copy.deepcopy(ref))
    apply_float8(model, "rowwise", emulate=True)
    x = torch.randn(8, 64, requires_grad=True)
    y = model(x)
    expected = _rowwise(x.detach()) @ _rowwise(ref.weight.detach()).T
    # Same float8 values both sides; only the fp32 summation order may differ (64 terms).
    assert torch.allclose(y, expected, rtol=1e-5, atol=1e-5)
    # And it is float8, not fp32: the plain product is measurably different.
    assert (y - x @ ref.weight.T).abs().max() > 1e-3
    grad_out = torch.randn_like(y)
    y.backward(grad_out)
    # grad_input = grad_out (rows cast) @ weight (cast along its other axis).
    g_in = _rowwise(grad_out) @ _rowwise(ref.weight.detach().T.contiguous()).T
    assert torch.allclose(x.grad, g_in, rtol=1e-5, atol=1e-5)


def test_training_follows_fp32_within_the_float8_error():
    """20 AdamW steps of a small GPT on a fixed batch: the float8 run's losses stay within 5%
    of fp32's (e4m3 keeps 3 mantissa bits, a rounding of up to 6% of each element that the
    sums average down; measured: at most 1.3%, torch 2.13 with torchao 0.18), and it learns."""
    torch.manual_seed(1)
    data = torch.randint(0, 96, (8, 33))
    losses = {}
    for name in ("fp32", "float8"):
        model = _gpt(seed=0)
        if name == "float8":
            apply_float8(model, emulate=True)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        trace = []
        for _ in range(20):
            logits = model(data[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), data[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            trace.append(loss.item())
        losses[name] = trace
    for a, b in zip(losses["fp32"], losses["float8"]):
        assert abs(a - b) <= 0.05 * a
    assert losses["float8"][-1] < 0.8 * losses["float8"][0]


def test_refusals_are_one_line():
    with pytest.raises(ValueError, match=r"float8=True needs an NVIDIA GPU.*device is cpu"):
        check_float8_device("cpu")
    with pytest.raises(ValueError, match="needs an NVIDIA GPU"):
        apply_float8(_gpt())  # no emulation on the CPU
    with pytest.raises(ValueError, match="float8_recipe='delayed' is not one of"):
        ModelOptions(float8=True, float8_recipe="delayed")
    with pytest.raises(ValueError, match=r"float8=1 must be True or False"):
        ModelOptions(float8=1)
    with pytest.raises(ValueError, match="no nn.Linear with both dimensions in multiples of 16"):
        apply_float8(nn.Sequential(nn.Linear(10, 10)), emulate=True)


def test_accelerate_fp8_is_float8_in_bf16():
    """Accelerate's ``mixed_precision="fp8"`` (its torchao backend): bf16 autocast with the
    linears in float8; on a CPU, prepare refuses it in one line."""
    from meshfit import Accelerator

    acc = Accelerator(mixed_precision="fp8", cpu=True)
    assert acc.model_options.float8 and acc.mixed_precision == "bf16"
    with pytest.raises(ValueError, match="float8=True needs an NVIDIA GPU"):
        acc.prepare(_gpt())
