"""Tests for meshfit.optim: every optimizer trains the tiny GPT, its measured state matches
a closed form, parameter groups, input validation, and single-device references.

torchao's AdamW8bit compiles its step on first use (measured: ~50 s cold on a 2-core CPU), so it
runs in one test only: the 25-step training run, which also measures its state.
"""

from __future__ import annotations

import contextlib

import copy
import importlib.util
import math

import pytest
import torch
from torch import nn

from conftest import run_distributed
from reference import tiny_preset  # full width, fp32: the model `meshfit train` trains
from meshfit import optim
from meshfit.data import TokenDataset, load_tokens

STEPS, BATCH, SEQ = 25, 8, 32
# Learning rates that train the tiny GPT in 25 steps. Adafactor's lr caps its relative step
# size (torch's default 1e-2); SGD diverges on this model from about lr=0.2 with momentum 0.9.
LR = {"adamw": 3e-3, "adamw_fused": 3e-3, "adamw_8bit": 3e-3, "adafactor": 1e-2, "sgd": 0.1,
      "muon": 3e-3,  # muon: AdamW's lr on embeddings and 1-D parameters, muon_lr 0.02 on matrices
      "adamw_bf16_states": 3e-3, "adamw_4bit": 3e-3}


@pytest.fixture(scope="module")
def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """25 fixed batches of 8 x 32 byte tokens from the built-in corpus (the stdlib)."""
    data = TokenDataset(load_tokens().train, seq_len=SEQ)
    idx = torch.randint(0, len(data), (STEPS, BATCH), generator=torch.Generator().manual_seed(0))
    return [tuple(torch.stack(t) for t in zip(*(data[int(i)] for i in row))) for row in idx]


def expected_state_bytes(name: str, shapes: list[torch.Size], muon: set | None = None) -> int:
    """Closed form of each optimizer's state, fp32 parameters, one 4-byte `step` per tensor
    (muon: `muon` holds the indices of the shapes Muon steps, 4 B, one momentum each)."""
    total = 0
    for i, shape in enumerate(shapes):
        n = math.prod(shape)
        if name == "muon":
            total += 4 * n if i in muon else 8 * n + 4
        elif name in ("adamw", "adamw_fused"):
            total += 8 * n + 4
        elif name == "sgd":
            total += 4 * n  # momentum buffer only; SGD keeps no step
        elif name == "adafactor":
            # factored second moment: one row and one column vector (Shazeer & Stern 2018)
            total += (4 * (shape[-2] + shape[-1]) if len(shape) >= 2 else 4 * n) + 4
        elif name == "adamw_bf16_states":
            total += 4 * n + 4  # two bf16 moments
        elif name == "adamw_4bit" and n >= 4096 and n % 128 == 0:
            # per moment: two 4-bit codes a byte, an fp32 scale per 128, a 16-entry fp32 qmap
            total += 2 * (n // 2 + 4 * n // 128 + 4 * 16) + 4
        elif name == "adamw_8bit" and n >= 4096 and n % 256 == 0:  # torchao quantizes it
            # per moment: uint8 codes, an fp32 scale per block of 256, a 256-entry fp32 qmap
            total += 2 * (n + 4 * n // 256 + 4 * 256) + 4
        else:  # adamw_8bit / adamw_4bit, small tensors keep fp32 moments
            total += 8 * n + 4
    return total


# ---------------------------------------------------------------- training and state size
@pytest.mark.parametrize("name", optim.OPTIMIZERS)
def test_optimizer_trains_tiny_gpt_and_state_matches_closed_form(name, batches, request):
    if name in ("adamw_8bit", "adamw_4bit"):
        pytest.importorskip("torchao")
    # 2 OpenMP threads on a busy 2-core machine: 20x slower (muon's bf16 matmuls), ~10x
    # (adamw_bf16_states' per-tensor loop: 2.7 s with one thread, 30 s with two)
    if name in ("muon", "adamw_bf16_states"):
        request.getfixturevalue("one_thread")
    model = tiny_preset()
    opt = optim.build(name, model, lr=LR[name], weight_decay=0.1)
    losses = []
    # torchao's step is torch.compile'd: with a cold inductor cache (a fresh CI machine) the
    # default compile worker pool leaves a thread behind, which the hygiene check rejects.
    compile_threads = torch._inductor.config.patch(compile_threads=1) \
        if name in ("adamw_8bit", "adamw_4bit") else contextlib.nullcontext()
    with compile_threads:
        for x, y in batches:
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
    late = sum(losses[-5:]) / 5
    # ln(256) = 5.55 at init (5.48 on the first batch); the last 5 steps average 3.25 (AdamW,
    # fused or 8-bit), 3.76 (SGD), 4.00 (Adafactor): a drop of 1 nat leaves 0.48 nat or more.
    assert math.isfinite(late) and late < losses[0] - 1.0, (losses[0], late)

    report = optim.state_bytes(opt)
    print("\n" + optim.format_report({name: report}))
    params = list(model.parameters())
    stepped = {id(p) for g in opt.param_groups if g.get("use_muon") for p in g["params"]}
    muon = {i for i, p in enumerate(params) if id(p) in stepped}
    assert report.num_params == sum(p.numel() for p in params)
    assert report.total_bytes == expected_state_bytes(name, [p.shape for p in params], muon)
    matrices = [i for i, p in enumerate(params) if p.ndim >= 2]
    assert report.matrix_bytes == expected_state_bytes(
        name, [params[i].shape for i in matrices], {j for j, i in enumerate(matrices) if i in muon})
    if name in ("adamw", "adamw_fused"):
        assert report.bytes_per_param == pytest.approx(8, rel=0.01)  # step scalars included
    elif name == "sgd":
        assert report.bytes_per_param == 4
    elif name == "muon":  # 4 B on the blocks' matrices; the embeddings keep AdamW's 8 B
        assert len(muon) == 4 * 6 and report.bytes_per_param < 4.5
    elif name == "adamw_8bit":
        # 1 B per moment plus small per-block scales (4 B per 256) and a 1 KiB lookup table per
        # moment: 2.094 B/param on the tiny GPT's matrices (32k elements on average). Its
        # biases and norms (<4096 elements) keep fp32 moments, 8 B/param.
        assert report.matrix_bytes_per_param <= 2.1
        assert report.other_bytes_per_param == pytest.approx(8, rel=0.01)
    elif name == "adamw_4bit":
        # half a byte per moment, an fp32 scale per 128 and a 64 B table per moment: 1.066
        assert report.matrix_bytes_per_param <= 1.07
        assert report.other_bytes_per_param == pytest.approx(8, rel=0.01)
    elif name == "adamw_bf16_states":
        assert report.bytes_per_param == pytest.approx(4, rel=0.01)
    else:
        assert report.matrix_bytes_per_param < 0.1  # ~(rows + cols) * 4 B per matrix


def test_adafactor_factors_a_256x256_matrix():
    layer = nn.Linear(256, 256, bias=False)
    opt = optim.build("adafactor", layer, lr=1e-2)
    layer(torch.randn(4, 256)).sum().backward()
    opt.step()
    report = optim.state_bytes(opt)
    assert report.total_bytes == (256 + 256) * 4 + 4  # row and column vectors, and the step
    assert report.bytes_per_param < 1


def _fsdp_state(rank: int, world_size: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.LayerNorm(128), nn.Linear(128, 64))
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    opt = optim.build("adamw", model, lr=1e-3, weight_decay=0.1)  # after sharding (torchtitan)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    return optim.state_bytes(opt), len(list(model.parameters()))


def test_state_of_fsdp2_dtensors_counts_the_local_shard():
    reports = run_distributed(_fsdp_state, 2)
    full = sum(p.numel() for p in nn.Sequential(nn.Linear(64, 128), nn.LayerNorm(128),
                                                 nn.Linear(128, 64)).parameters())
    assert sum(r.num_params for r, _ in reports) == full
    for report, n_tensors in reports:
        assert report.num_params == full // 2  # every dim 0 here is even: equal shards
        assert report.total_bytes == 8 * report.num_params + 4 * n_tensors


def test_shared_state_tensors_count_once():
    # bitsandbytes keeps one quantization map referenced from every parameter's state.
    a, b = nn.Parameter(torch.zeros(10)), nn.Parameter(torch.zeros(2, 5))
    opt = torch.optim.SGD([a, b], lr=0.1)
    shared = torch.zeros(256)
    opt.state[a] = {"qmap": shared, "buf": torch.zeros(10, dtype=torch.uint8), "step": 3}
    opt.state[b] = {"qmap": shared, "buf": torch.zeros(10, dtype=torch.uint8)}
    report = optim.state_bytes(opt)
    assert report.total_bytes == 256 * 4 + 10 + 10  # the Python int step holds no tensor memory
    assert (report.num_params, report.matrix_params, report.matrix_bytes) == (20, 10, 10)


def test_format_report_has_one_row_per_optimizer():
    reports = {"adamw": optim.StateReport(total_bytes=800, num_params=100, matrix_bytes=640,
                                          matrix_params=80),
               "sgd": optim.StateReport(total_bytes=400, num_params=100, matrix_bytes=320,
                                        matrix_params=80)}
    lines = optim.format_report(reports).splitlines()
    assert len(lines) == 4 and "B/param" in lines[0]
    assert lines[2].split()[:2] == ["adamw", "100"] and "8.000" in lines[2]
    assert lines[3].split()[0] == "sgd" and "4.000" in lines[3]


# ---------------------------------------------------------------- parameter groups
class ScaleNorm(nn.Module):
    """A user norm with a 2-D gain: excluded by its class name, not by its shape."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(1, d))

    def forward(self, x):
        return self.gain * x / x.norm(dim=-1, keepdim=True)


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_param_groups_decay_only_weight_matrices(norm):
    model = tiny_preset(norm=norm, n_layer=2)
    groups = optim.param_groups(model, 0.1)
    decay = {id(p) for p in groups[0]["params"]}
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert sorted(groups[0]) == ["params", "weight_decay"]
    for name, p in model.named_parameters():
        is_norm = "norm" in name
        assert (id(p) in decay) == (p.ndim >= 2 and not is_norm and not name.endswith("bias")), name
    assert id(model.tok_emb.weight) in decay and id(model.layers["0"].attn.wq.weight) in decay
    n_listed = sum(len(g["params"]) for g in groups)
    assert n_listed == len(list(model.parameters()))  # the tied head is listed once


def test_param_groups_norms_by_name_and_extra_substrings():
    model = nn.Sequential(nn.Linear(8, 8), ScaleNorm(8), nn.GroupNorm(2, 8), nn.Linear(8, 8))
    groups = optim.param_groups(model, 0.1, no_decay=["3."])
    assert groups[0]["params"] == [model[0].weight]
    assert len(groups[1]["params"]) == 6  # bias, gain, 2 GroupNorm, model[3] weight and bias
    assert optim.param_groups(model, 0.1, no_decay="3.") == groups  # one substring, not chars


def test_frozen_params_get_no_state_and_empty_groups_are_dropped(batches):
    model = tiny_preset()
    for p in model.parameters():
        p.requires_grad_(p.ndim < 2)  # freeze every matrix: the decay group is empty
    opt = optim.build("adamw", model, lr=1e-3, weight_decay=0.1)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0]
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    assert held == {id(p) for p in model.parameters() if p.requires_grad}
    x, y = batches[0]
    model(x, y).backward()
    opt.step()
    assert len(opt.state) == len(held) and all(id(p) in held for p in opt.state)
    report = optim.state_bytes(opt)
    assert report.matrix_params == 0 and report.num_params == sum(
        p.numel() for p in model.parameters() if p.requires_grad)


def test_params_and_groups_pass_through_minus_frozen():
    a, b, c = (nn.Parameter(torch.ones(4, 4)) for _ in range(3))
    c.requires_grad_(False)
    opt = optim.build("sgd", [a, c], lr=0.1, weight_decay=0.01)
    assert opt.param_groups[0]["params"] == [a] and opt.param_groups[0]["weight_decay"] == 0.01
    assert optim.build("sgd", a, lr=0.1).param_groups[0]["params"] == [a]  # a lone tensor
    opt = optim.build("adamw", [{"params": [a], "weight_decay": 0.5}, {"params": [b, c]},
                                {"params": [c]}], lr=0.1, weight_decay=0.01)
    assert [(g["params"], g["weight_decay"]) for g in opt.param_groups] == [([a], 0.5), ([b], 0.01)]


def test_hyperparameters_reach_each_optimizer():
    model = nn.Linear(4, 4)
    kw = dict(lr=0.01, weight_decay=0.1, betas=(0.8, 0.9), eps=1e-6, momentum=0.5)
    adamw = optim.build("adamw", model, **kw).param_groups[0]
    assert (adamw["betas"], adamw["eps"], adamw["foreach"], adamw["fused"]) == ((0.8, 0.9), 1e-6, True, None)
    assert optim.build("adamw_fused", model, **kw).param_groups[0]["fused"] is True
    ada = optim.build("adafactor", model, **kw).param_groups[0]
    assert (ada["lr"], ada["eps"], ada["weight_decay"]) == (0.01, (1e-6, 1e-3), 0.1)
    sgd = optim.build("sgd", model, nesterov=True, **kw).param_groups[0]
    assert (sgd["momentum"], sgd["nesterov"], sgd["weight_decay"]) == (0.5, True, 0.1)


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs, field", [
    (dict(name="adam", lr=1e-3), "optimizer='adam'"),
    (dict(name="adamw", lr=0.0), "lr=0.0"),
    (dict(name="adamw", lr=-1e-3), "lr=-0.001"),
    (dict(name="adamw", lr=float("nan")), "lr=nan"),
    (dict(name="sgd", lr=0.1, weight_decay=-0.1), "weight_decay=-0.1"),
])
def test_bad_input_is_a_one_line_value_error(kwargs, field):
    name = kwargs.pop("name")
    with pytest.raises(ValueError) as info:
        optim.build(name, nn.Linear(2, 2), **kwargs)
    message = str(info.value)
    assert field in message and "\n" not in message
    if name == "adam":
        assert message.endswith("is not one of " + ", ".join(optim.OPTIMIZERS))


def test_fused_on_an_unsupported_device_suggests_adamw():
    with torch.device("meta"):
        model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"adamw_fused.*meta.*optimizer='adamw'"):
        optim.build("adamw_fused", model, lr=1e-3)


def test_missing_8bit_library_says_what_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("torchao", "bitsandbytes") else real(name, *a))
    with pytest.raises(ValueError, match=r'pip install "meshfit\[optim\]"') as info:
        optim.build("adamw_8bit", nn.Linear(2, 2), lr=1e-3)
    assert "\n" not in str(info.value)


def test_all_frozen_is_an_error():
    model = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        optim.build("sgd", model, lr=0.1)


# ---------------------------------------------------------------- references
def _train(model, opt, batches, steps):
    for x, y in batches[:steps]:
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_adamw_equals_a_hand_built_torch_adamw(batches):
    model = tiny_preset()
    ref = copy.deepcopy(model)
    opt = optim.build("adamw", model, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
    # The hand-built groups of the single-GPU guide, and torch's default (for-loop on CPU)
    # implementation, not the foreach one `build` picks: both kernels compute the same fp32
    # operations in the same order, so the result is bit-identical.
    groups = [{"params": [p for p in ref.parameters() if p.ndim >= 2], "weight_decay": 0.1},
              {"params": [p for p in ref.parameters() if p.ndim < 2], "weight_decay": 0.0}]
    ref_opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    _train(model, opt, batches, 2)
    _train(ref, ref_opt, batches, 2)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name


def test_adamw_fused_matches_adamw(batches):
    # fp64: the key bias's gradient is zero in exact arithmetic (softmax ignores
    # a constant added to one query's scores), so in fp32 it is rounding noise, which Adam
    # normalises into steps of up to lr whose sign differs between kernels (2e-6 apart after
    # 3 steps here). In fp64 that noise sits far below eps.
    model = tiny_preset(dtype=torch.float64)
    ref = copy.deepcopy(model)
    _train(model, optim.build("adamw_fused", model, lr=1e-3, weight_decay=0.1), batches, 3)
    _train(ref, optim.build("adamw", ref, lr=1e-3, weight_decay=0.1), batches, 3)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        # The kernels order their fp64 operations differently: ~6e-15 apart, at most.
        torch.testing.assert_close(p, q, rtol=0, atol=1e-12, msg=name)
