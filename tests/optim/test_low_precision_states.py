"""AdamW with smaller states (`meshfit.optim.states`): bf16 moments, torchao's 8-bit and 4-bit.

- `adamw_bf16_states` equals, bit for bit, torch's AdamW whose moments are rounded to bf16
  after every step (the update itself from the fp32 moments of the step: its docstring).
- Under ZeRO-1/2/3 on 2 ranks each optimizer equals one process (fp64, 4 steps). Layouts
  differ in the order of the gradients' sums only (~1e-16 relative per operation, grown by
  Adam over 4 steps to ~1e-13; measured: 2e-13 with bf16 moments, 0 with torchao's, whose
  update is computed in fp32 and rounds those differences away). The quantized states see
  them through their block scales (continuous: the largest magnitude of a block) and codes
  (a code changes only where a value sits within ~1e-13 of the midpoint between two codes:
  ~1e-11 of the elements, none here). Tolerance 1e-9 relative (+ ATOL); the mistakes this
  guards against miss by more than 1e-3 absolute (measured on one process, 8-bit: the
  4096-element matrices kept in fp32 as torchao's own rule would keep their 2048-element
  shards, 1.7e-3; blocks of 128 instead of 256, i.e. other block boundaries, 2.8e-3).
  Every tensor of the tiny GPT is cut by FSDP2 into shards whose length is a multiple of 256
  (`unaligned` is empty), and its 4096-element matrices are quantized in 2048-element shards
  (the same tensors quantized as on one process).
- bf16 weights (stochastic rounding: `meshfit.optim.rounding`): from the same gradients
  (drawn per parameter and step, each rank given its part), ZeRO-1/2/3 equal one process
  bit for bit after 4 steps, for each optimizer. torchao's own rounding (each rank's
  generator over its shard) fails this for 8-bit and 4-bit. From a bf16 backward, the
  gradients differ by layout (each rank's sums rounded to bf16 before the reduction), and a
  few weights (< 1%) with them after one step.
- A shard that cuts the whole tensor's blocks (68 x 64 over 2 ranks: 2176 elements, 8.5
  blocks of 256; 66 x 64 for 4-bit's 128) equals one process bit for bit (fp32 weights, and
  bf16 with stochastic rounding) from the same gradients; plain fp32 moments there (main
  before `meshfit.optim.edge_blocks`) are 1e-3 apart. Its stop and resume (DCP) is bitwise
  with bf16 weights: the fp32 moments are not rounded to bf16 on loading.
- A stop at step 2 and a resume (checkpoint: model, optimizer states, schedule, loader,
  generators) give the same losses and weights bit for bit as the run without the stop, on
  one process (fp32 weights) and under ZeRO-3 (bf16 weights: the stopped run rounds with
  rounding_seed=5 and the resumed one is built with the default, so the seed must come back
  from the checkpoint's param groups; a moment restored off by its quantization error would
  move the fp32 results by ~1e-5 and so the rounding of some of the 68k weights).
- Bytes per parameter measured on a live optimizer are within 2% of the estimator's table.
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from torch import nn

from conftest import run_distributed
from reference import tiny_gpt, token_batches
from meshfit import optim
from meshfit.memory.estimate import OPTIMIZER_BYTES
from meshfit.optim.states import unaligned

pytest.importorskip("torchao")
pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py: tiny models)

NAMES = ("adamw_bf16_states", "adamw_8bit", "adamw_4bit")
STEPS, SAVE_AT, GLOBAL = 4, 2, 8
LAYOUTS = {"one": ({}, {}),
           "zero1": (dict(dp_shard=2, dp_replicate=1), dict(zero_stage=1)),
           "zero2": (dict(dp_shard=2, dp_replicate=1), dict(zero_stage=2)),
           "zero3": (dict(dp_shard=2, dp_replicate=1), dict(zero_stage=3))}
RTOL = 1e-9
# An element whose gradient is ~0 in exact arithmetic (the attention key bias: softmax ignores
# a constant added to a query's scores) has Adam step noise / (|noise| + eps): the bound of
# tests/reference.py, S lr dg / eps = 4 x 1e-2 x 1e-16 / 1e-8 = 4e-10 absolute.
ATOL = 1e-9


def _accelerator(layout: str):
    from meshfit import Accelerator, DataLoaderConfiguration, ParallelDims

    dims, options = LAYOUTS[layout]
    return Accelerator(parallel=ParallelDims(**dims) if dims else None,
                       step_scheduler_per_process=False,
                       dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
                       **options)


def _build(name: str, model, **kwargs):
    return optim.build(name, model, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95),
                       compile=False, **kwargs)


def _run(layout: str, name: str, dtype, *, save: str | None = None,
         load: str | None = None, seed: int = 0, steps: int = STEPS) -> dict:
    """Train the tiny GPT for `steps` steps of `name` under `layout` (saving at SAVE_AT into
    `save`, or starting from `load`; `seed`: the stochastic rounding's): the losses of the
    steps taken and the whole model."""
    from torch.utils.data import DataLoader, TensorDataset

    acc = _accelerator(layout)
    x, y = token_batches(STEPS * GLOBAL + 4, 16)
    loader = DataLoader(TensorDataset(x, y), batch_size=GLOBAL // acc.runtime.dp_size,
                        shuffle=True, generator=torch.Generator().manual_seed(7))
    model = acc.prepare(tiny_gpt(n_layer=1, dtype=dtype))
    opt = _build(name, model, rounding_seed=seed)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    opt, loader, sched = acc.prepare(opt, loader, sched)
    if load:
        acc.load_state(load)
    losses, done = [], acc._registry.optimizer_steps
    for xb, yb in loader:
        if done == steps:
            break
        with acc.accumulate():
            loss = model(xb, yb)
            acc.backward(loss)
            losses.append(acc.reduce(loss.detach(), "mean").item())
            opt.step()
            sched.step()
            opt.zero_grad()
        done += 1
        if save and done == SAVE_AT:
            acc.save_state(save)
    acc.wait_for_checkpoint(close=True)
    return {"losses": losses, "state": acc.get_state_dict(model), "unaligned": unaligned(opt),
            "bytes": optim.state_bytes(opt).total_bytes, "quantized": _quantized(model, opt)}


def _same_gradients(layout: str, name: str) -> dict:
    """STEPS steps of `name` on the bf16 tiny GPT under `layout` from gradients that are the
    same under every layout (drawn per parameter and step, each rank given its part): the
    whole model. (Gradients a backward computes differ by layout in their bf16 rounding.)"""
    from torch.distributed.tensor import DTensor, distribute_tensor

    acc = _accelerator(layout)
    model = acc.prepare(tiny_gpt(n_layer=1, dtype=torch.bfloat16))
    opt = acc.prepare(_build(name, model))
    for step in range(STEPS):
        for i, p in enumerate(model.parameters()):
            g = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i))
            g = g.bfloat16()
            p.grad = (distribute_tensor(g, p.device_mesh, p.placements)
                      if isinstance(p, DTensor) else g)
        opt.step()
        opt.zero_grad()
    return acc.get_state_dict(model)


def _quantized(model, opt) -> list[str]:
    """Names of the parameters whose moments this rank keeps quantized (torchao's subclass)."""
    from meshfit.distributed.tensors import local_tensor

    inner = getattr(opt, "optimizer", opt)
    inner = getattr(inner, "optim", inner)  # ZeRO-1: this rank's partition
    return sorted(name for name, p in model.named_parameters() if p in inner.state
                  and type(local_tensor(inner.state[p]["exp_avg"])) is not torch.Tensor)


def _unaligned_shard(rank, world):
    """FSDP2 cuts a 68 x 64 weight (4352 = 17 x 256 elements: quantized on one process) into
    shards of 34 rows = 2176 elements, not a multiple of 256: no shard holds whole blocks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    layer = nn.Linear(64, 68, bias=False)
    fully_shard(layer, mesh=mesh)
    opt = optim.build("adamw_8bit", layer, lr=1e-3, compile=False)
    layer(torch.randn(2, 64)).sum().backward()
    opt.step()
    # a column shard (tensor parallel's rowwise weights): strided ranges, not whole blocks
    column = nn.Parameter(distribute_tensor(torch.zeros(64, 512), mesh, [Shard(1)]))
    column.grad = distribute_tensor(torch.ones(64, 512), mesh, [Shard(1)])
    by_column = optim.build("adamw_8bit", [column], lr=1e-3, compile=False)
    by_column.step()
    return (unaligned(opt), _quantized(layer, opt), optim.state_bytes(opt).total_bytes,
            unaligned(by_column))


CUTS = {"adamw_8bit": (68, 64), "adamw_4bit": (66, 64)}
"""Whole tensors of 17 blocks of 256 (33 of 128) that FSDP2 cuts on 2 ranks into 34 (33)
rows: 2176 (2112) elements, not a multiple of the block: block 8 (16) spans both ranks."""


def _cut_blocks(name: str, dtype, mesh=None):
    """STEPS steps of `name` on the weight CUTS[name] from the same gradients, on one
    process or FSDP2-sharded over `mesh`: the whole weight."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    rows, cols = CUTS[name]
    layer = nn.Linear(cols, rows, bias=False)
    torch.nn.init.normal_(layer.weight, generator=torch.Generator().manual_seed(1))
    layer.to(dtype)
    if mesh is not None:
        fully_shard(layer, mesh=mesh)
    opt = optim.build(name, layer, lr=1e-2, compile=False)
    w = layer.weight
    for step in range(STEPS):
        g = torch.randn(rows, cols, generator=torch.Generator().manual_seed(step)).to(dtype)
        w.grad = distribute_tensor(g, w.device_mesh, w.placements) if mesh is not None else g
        opt.step()
    return w.full_tensor().detach() if mesh is not None else w.detach()


CUT_CASES = [("adamw_8bit", torch.float32), ("adamw_4bit", torch.float32),
             ("adamw_8bit", torch.bfloat16)]


def _cut_blocks_resume(mesh, folder: str) -> tuple[torch.Tensor, torch.Tensor]:
    """adamw_8bit on the bf16 weight CUTS["adamw_8bit"] sharded over `mesh`: STEPS steps, and
    the same with a DCP save at SAVE_AT and a fresh optimizer (default seed) loading it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    shape = CUTS["adamw_8bit"]

    def build(seed):
        layer = nn.Module()
        layer.w = nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(1))
                               .bfloat16())
        fully_shard(layer, mesh=mesh)
        return layer, optim.build("adamw_8bit", layer, lr=1e-2, compile=False,
                                  rounding_seed=seed)

    def train(layer, opt, steps):
        for step in steps:
            g = torch.randn(shape, generator=torch.Generator().manual_seed(step)).bfloat16()
            layer.w.grad = distribute_tensor(g, mesh, layer.w.placements)
            opt.step()

    layer, opt = build(5)
    train(layer, opt, range(SAVE_AT))
    dcp.save({"w": layer.w, "optim": get_optimizer_state_dict(layer, opt)}, checkpoint_id=folder)
    train(layer, opt, range(SAVE_AT, STEPS))
    resumed, opt2 = build(0)
    loaded = {"w": resumed.w, "optim": get_optimizer_state_dict(resumed, opt2)}
    dcp.load(loaded, checkpoint_id=folder)
    set_optimizer_state_dict(resumed, opt2, loaded["optim"])
    train(resumed, opt2, range(SAVE_AT, STEPS))
    return layer.w.full_tensor(), resumed.w.full_tensor()


def _two_ranks(rank, world, root):
    out = {}
    for name in NAMES:
        for layout in ("zero1", "zero2", "zero3"):
            out[name, layout] = _run(layout, name, torch.float64)
            out[name, "bf16", layout] = _same_gradients(layout, name)
        out[name, "resume"] = _stop_and_resume("zero3", name, torch.bfloat16, root)
    out["bf16 backward"] = _run("zero2", "adamw_8bit", torch.bfloat16, steps=1)["state"]
    out["unaligned"] = _unaligned_shard(rank, world)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    for name, dtype in CUT_CASES:
        out["cut", name, dtype] = _cut_blocks(name, dtype, mesh)
    out["cut resume"] = _cut_blocks_resume(mesh, f"{root}/cut")
    return out


def _stop_and_resume(layout: str, name: str, dtype, root: str) -> tuple[dict, dict]:
    """The run without a stop, and the run resumed from its checkpoint at SAVE_AT. The first
    rounds bf16 weights with rounding_seed=5; the resumed one is built with the default
    seed (0): the checkpoint's must replace it."""
    folder = f"{root}/{name}-{layout}-{str(dtype)[6:]}"
    return (_run(layout, name, dtype, save=folder, seed=5),
            _run(layout, name, dtype, load=folder))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("states")
    out = {(name, "one"): _run("one", name, torch.float64) for name in NAMES}
    for name in NAMES:
        out[name, "bf16", "one"] = _same_gradients("one", name)
        out[name, "resume-one"] = _stop_and_resume("one", name, torch.float32, root)
    out["bf16 backward", "one"] = _run("one", "adamw_8bit", torch.bfloat16, steps=1)["state"]
    for name, dtype in CUT_CASES:
        out["cut one", name, dtype] = _cut_blocks(name, dtype)
    out.update(run_distributed(_two_ranks, 2, str(root), timeout=600)[0])
    yield out
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("layout", ["zero1", "zero2", "zero3"])
@pytest.mark.parametrize("name", NAMES)
def test_sharded_equals_one_process(runs, name, layout):
    one, sharded = runs[name, "one"], runs[name, layout]
    assert sharded["unaligned"] == []
    if layout != "zero1":  # (ZeRO-1: each rank holds the states of its own parameters)
        assert sharded["quantized"] == one["quantized"]  # 4096-element matrices included
    assert sharded["losses"] == pytest.approx(one["losses"], rel=RTOL)
    worst = max((sharded["state"][k] - v).abs().max().item() for k, v in one["state"].items())
    print(f"{name} {layout}: largest difference {worst:.1e}")
    for key, value in one["state"].items():
        torch.testing.assert_close(sharded["state"][key], value, rtol=RTOL, atol=ATOL, msg=key)


@pytest.mark.parametrize("name,dtype", CUT_CASES)
def test_a_shard_that_cuts_blocks_equals_one_process(runs, name, dtype):
    """The shards keep fp32 moments holding what one process's quantized ones dequantize
    to, the edge blocks scaled by the maximum over both ranks (`meshfit.optim.edge_blocks`):
    the weights equal one process's bit for bit (keeping plain fp32 moments instead: 1e-3
    apart after 4 steps)."""
    one, sharded = runs["cut one", name, dtype], runs["cut", name, dtype]
    assert one.dtype == dtype and torch.equal(sharded, one)


def test_a_shard_that_cuts_blocks_stops_and_resumes_bitwise(runs):
    """Its fp32 moments come back as saved, not through torch's cast to the bf16 weight's
    dtype (which would round them), and the rounding's seed with the param groups."""
    full, resumed = runs["cut resume"]
    assert full.dtype == torch.bfloat16 and torch.equal(full, resumed)


def test_a_shard_without_whole_blocks_keeps_fp32_moments_and_is_listed(runs):
    """A shard that is not made of the whole tensor's blocks: detected, fp32 there, and
    listed (`unaligned`: their bytes are fp32's)."""
    shapes, quantized, nbytes, by_column = runs["unaligned"]
    assert shapes == [(68, 64)] and quantized == []
    assert nbytes == 8 * 34 * 64 + 4  # fp32 moments of this rank's 34 rows, and the step
    assert by_column == [(64, 512)]


@pytest.mark.parametrize("layout", ["zero1", "zero2", "zero3"])
@pytest.mark.parametrize("name", NAMES)
def test_bf16_weights_from_the_same_gradients_equal_one_process_bitwise(runs, name, layout):
    """Stochastic rounding draws its bits from (seed, step, tensor, index in the whole
    tensor), not from each rank's generator over its own shard."""
    one, sharded = runs[name, "bf16", "one"], runs[name, "bf16", layout]
    assert {v.dtype for v in one.values()} == {torch.bfloat16}
    for key, value in one.items():
        assert torch.equal(sharded[key], value), key


def test_bf16_gradients_differ_by_layout_and_move_a_few_weights(runs):
    """What the bitwise claim above leaves out: a bf16 backward on 2 ranks rounds each
    rank's sums to bf16 before they are reduced, so its gradients are not one process's;
    the fp32 updates then differ, and an element rounds to the other neighbour where its
    random threshold lies between the two (measured after one step of adamw_8bit under
    ZeRO-2: 0.2% of the weights, as many as with round to nearest)."""
    one, two = runs["bf16 backward", "one"], runs["bf16 backward"]
    differ = sum((two[k] != v).sum().item() for k, v in one.items())
    total = sum(v.numel() for v in one.values())
    print(f"bf16 backward, one step, ZeRO-2: {differ} of {total} weights differ")
    assert 0 < differ < 0.01 * total


@pytest.mark.parametrize("where", ["resume-one", "resume"])
@pytest.mark.parametrize("name", NAMES)
def test_stop_and_resume_is_bitwise(runs, name, where):
    full, resumed = runs[name, where]
    assert len(full["losses"]) == STEPS and len(resumed["losses"]) == STEPS - SAVE_AT
    assert resumed["losses"] == full["losses"][SAVE_AT:]
    assert resumed["bytes"] == full["bytes"]  # the states loaded in their own format
    for key, value in full["state"].items():
        assert torch.equal(value, resumed["state"][key]), key


# ------------------------------------------------------------------ one process, in-process
def test_bf16_states_equal_adamw_with_moments_rounded_after_each_step():
    x, y = token_batches(4 * 5, 16)
    model, reference = tiny_gpt(n_layer=1, dtype=torch.float32), tiny_gpt(n_layer=1,
                                                                          dtype=torch.float32)
    opt = optim.build("adamw_bf16_states", model, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))
    ref = torch.optim.AdamW(optim.param_groups(reference, 0.1), lr=1e-2, betas=(0.9, 0.95),
                            foreach=False)
    for i in range(5):
        for m, o in ((model, opt), (reference, ref)):
            m(x[4 * i:4 * i + 4], y[4 * i:4 * i + 4]).backward()
            o.step()
            o.zero_grad()
        for state in ref.state.values():  # what AdamWBf16States carries to the next step
            for key in ("exp_avg", "exp_avg_sq"):
                state[key].copy_(state[key].bfloat16())
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name
    for p in model.parameters():
        assert {opt.state[p][k].dtype for k in ("exp_avg", "exp_avg_sq")} == {torch.bfloat16}
    # ... and not what plain AdamW (fp32 moments) gives: the rounding is seen
    plain = tiny_gpt(n_layer=1, dtype=torch.float32)
    adamw = torch.optim.AdamW(optim.param_groups(plain, 0.1), lr=1e-2, betas=(0.9, 0.95))
    for i in range(5):
        plain(x[4 * i:4 * i + 4], y[4 * i:4 * i + 4]).backward()
        adamw.step()
        adamw.zero_grad()
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))


@pytest.mark.parametrize("beta2,decays", [(0.999, False), (0.95, True)])
def test_bf16_second_moment_decays_only_by_more_than_half_an_ulp(beta2, decays):
    p = nn.Parameter(torch.zeros(16))
    opt = optim.build("adamw_bf16_states", [p], lr=1e-3, betas=(0.9, beta2))
    p.grad = torch.linspace(0.5, 2.0, 16)  # mantissas across a binade
    opt.step()
    first = opt.state[p]["exp_avg_sq"].clone()
    for _ in range(10):  # gradients gone: v should shrink by beta2 each step
        p.grad = torch.zeros(16)
        opt.step()
    last = opt.state[p]["exp_avg_sq"]
    assert (last < first).all() if decays else torch.equal(last, first)


def _wide_gpt():
    """Matrices of 512 x 512 to 2048 x 512 elements (GPT-2 small's are 768 x 768 and up):
    the per-tensor lookup tables (1 KiB per 8-bit moment) and the fp32 moments of the norms
    weigh < 1% there, as in any model worth shrinking the states of (on the tiny GPT's
    32k-element matrices the tables alone add 3%)."""
    from meshfit.models import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=2048, n_layer=1, n_head=8, d_model=512, d_ff=2048,
                         max_seq_len=16))


@pytest.mark.parametrize("name", NAMES)
def test_measured_bytes_per_param_within_2_percent_of_the_estimate(name):
    model = _wide_gpt()
    opt = optim.build(name, model, lr=1e-3,
                      compile=False)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    report = optim.state_bytes(opt)
    print(f"{name}: measured {report.bytes_per_param:.4f} B/param, "
          f"estimated {OPTIMIZER_BYTES[name]:.4f}")
    assert report.bytes_per_param == pytest.approx(OPTIMIZER_BYTES[name], rel=0.02)


@pytest.mark.parametrize("name", NAMES)
def test_bf16_weights_round_stochastically_to_a_neighbour(name):
    """One step from the same state: the fp32 weight gets the fp32 result r; a bf16 weight
    (same values) gets r rounded toward zero to bf16 or one bf16 ulp away from zero, at
    random, and unbiased: the mean rounding error, in ulps, over the elements whose dropped
    fraction is below 1/2 and over the others, is 0 within 5 standard errors (each element's
    error has sd <= 1/2 ulp)."""
    torch.manual_seed(0)
    w, g = torch.randn(64, 64).bfloat16(), torch.randn(64, 64).bfloat16()
    full, low = nn.Parameter(w.float()), nn.Parameter(w.clone())
    full.grad, low.grad = g.float(), g.clone()
    for p in (full, low):
        optim.build(name, [p], lr=1e-2,
                    compile=False).step()
    bits32 = full.detach().view(torch.int32)
    toward = (bits32 & -65536).view(torch.float32)  # the upper 16 bits: bf16 toward zero
    away = ((bits32 & -65536) + 65536).view(torch.float32)
    got = low.detach().float()
    assert ((got == toward) | (got == away)).all()
    nearest = full.detach().bfloat16().float()
    assert 0.05 < (got != nearest).float().mean() < 0.95  # random, not round-to-nearest
    error = ((got - full.detach()) / (away - toward)).double()
    fraction = (bits32 & 65535).double() / 65536  # what is dropped, in ulps
    for part in (fraction < 0.5, fraction >= 0.5):  # (a rounding biased either way shows)
        assert abs(error[part].mean().item()) < 5 * 0.5 / math.sqrt(part.sum().item())


def test_4bit_without_torchao_names_the_extra_before_launch(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(ValueError) as info:
        optim.build("adamw_4bit", nn.Linear(2, 2), lr=1e-3)
    message = str(info.value)
    assert "\n" not in message and "adamw_4bit" in message
    assert message.endswith('needs torchao, which is not installed; pip install "meshfit[optim]"')
    # ... and `meshfit train` refuses it before launch, with the same line
    from meshfit.train.configfile import load_config
    from meshfit.train.preflight import preflight

    with pytest.raises(ValueError) as info:
        preflight(load_config(None, ["--optim.optimizer=adamw_4bit"]), memory_check=False)
    assert str(info.value) == message


def test_a_torchao_that_does_not_import_says_which_release(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torchao.optim", None)  # import raises ImportError
    with pytest.raises(ValueError) as info:
        optim.build("adamw_4bit", nn.Linear(2, 2), lr=1e-3)
    message = str(info.value)
    assert message.startswith("optimizer='adamw_4bit': torchao ") and "\n" not in message
    assert "pip install" in message
