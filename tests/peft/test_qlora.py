"""QLoRA (`meshfit.peft.qlora`): LoRA adapters on a base whose linear weights are held in
4-bit NormalFloat by torchao (Dettmers et al. 2023).

- The numbers: in fp64, the QLoRA model's logits and adapter gradients equal those of the
  same model whose block linears hold their NF4 round trip (torchao's `to_nf4` applied
  directly) with the same adapters, to 1e-12 relative; they differ from the full-precision
  model's. The storage is the paper's 4.127 bits per weight (4 + 8/64 + 32/(64 x 256)) for
  64-value blocks and 256-scale groups.
- The layouts: a pretrained folder (`meta_model`), filled by `Accelerator.prepare`,
  trained 4 AdamW steps under DDP, ZeRO-2 and ZeRO-3 on 2 ranks (fp64) gives the one-process
  losses and adapters. The layouts differ in the order of sums only (~1e-16 relative per
  operation, ~1e-13 after Adam's steps); the tolerance is 1e-9, while a rank that quantized
  other weights or lost a shard misses by > 1e-4.
- The checkpoint: `save_state` after 2 steps holds the adapters and their optimizer state,
  not the 4-bit base (rebuilt from the folder); `load_state` into a fresh model resumes
  bit for bit. `get_state_dict` gives the dequantized base (loads into a plain model).
- Bad input: one line each, before anything is built or launched.
"""

from __future__ import annotations

import pytest
import torch

from conftest import case_result, run_cases

RTOL = 1e-9  # fp64 across layouts (see the module docstring)
STEPS, SAVE_AT = 4, 2
LAYOUTS = {"ddp": ({}, {}), "zero1": ({"dp_shard": 2, "dp_replicate": 1}, {"zero_stage": 1}),
           "zero2": ({"dp_shard": 2, "dp_replicate": 1}, {"zero_stage": 2}),
           "zero3": ({"dp_shard": 2, "dp_replicate": 1}, {"zero_stage": 3})}


def _llama_config():
    import transformers

    return transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                    num_attention_heads=4, num_key_value_heads=2,
                                    num_hidden_layers=2, vocab_size=96,
                                    max_position_embeddings=32)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    import transformers

    out = tmp_path_factory.mktemp("qlora") / "llama"
    torch.manual_seed(3)
    transformers.LlamaForCausalLM(_llama_config()).save_pretrained(out)
    return out


def _rounded(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with every linear weight but the head's replaced by torchao's NF4 round trip."""
    from torchao.quantization import to_nf4

    from meshfit.peft import nf4_blocks

    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head"):
                block, scaler = nf4_blocks(module.weight.numel())
                module.weight.copy_(to_nf4(module.weight.contiguous(), block,
                                           scaler).get_original_weight())
    return model


def _batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 96, (4, 16), generator=g), torch.randint(0, 96, (4, 16), generator=g)


def _loss(model, x, y):
    logits = model(input_ids=x).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def test_forward_and_adapter_gradients_use_the_4_bit_weights():
    import transformers

    from meshfit.peft import is_quantized, lora, qlora, quantized_linears

    def build():
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(_llama_config()).double()

    full = build()
    torch.manual_seed(1)
    q = qlora(build(), r=4, alpha=8)
    torch.manual_seed(1)
    ref = lora(_rounded(build()), r=4, alpha=8)
    torch.manual_seed(1)
    plain = lora(full, r=4, alpha=8)
    # every block linear (7 per layer), LoRA's base layers included; not the head nor adapters
    names = list(quantized_linears(q))
    assert len(names) == 14 and not any("lora_" in n or "lm_head" in n for n in names)
    assert all(is_quantized(m.weight) and not m.weight.requires_grad
               for m in quantized_linears(q).values())
    with torch.no_grad():  # the adapters' B is zero at init: move it so that they count
        for model in (q, ref, plain):
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.linspace(-0.1, 0.1, p.numel(), dtype=p.dtype).view_as(p))
    x, y = _batch()
    losses = {}
    grads = {}
    for key, model in (("q", q), ("ref", ref), ("plain", plain)):
        loss = _loss(model, x, y)
        loss.backward()
        losses[key] = loss.item()
        grads[key] = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert losses["q"] == pytest.approx(losses["ref"], rel=1e-12)
    assert grads["q"].keys() == grads["ref"].keys() and len(grads["q"]) == 28  # A, B x 14
    for name, g in grads["q"].items():
        torch.testing.assert_close(g, grads["ref"][name], rtol=1e-12, atol=1e-14)
    # and 4 bits are not the full-precision model
    assert abs(losses["plain"] - losses["q"]) > 1e-6
    worst = max((grads["plain"][n] - g).abs().max().item() for n, g in grads["q"].items())
    assert worst > 1e-6


def test_4_bit_storage_is_the_papers_4_127_bits_per_weight():
    from meshfit.peft import nf4_blocks, qlora

    w = torch.nn.Linear(512, 1024, bias=False)  # 8,192 blocks of 64: 32 groups of 256
    assert nf4_blocks(w.weight.numel()) == (64, 256)
    model = torch.nn.Sequential(w, torch.nn.Linear(1024, 8))
    q = qlora(model, r=2, target_modules=["0"])
    weight = q.base_model.model[0].base_layer.weight
    stored = sum(t.numel() * t.element_size() for t in (
        weight.quantized_data, weight.quantized_scalers, weight.quantization_factor))
    assert stored * 8 / weight.numel() == pytest.approx(4 + 8 / 64 + 32 / (64 * 256), rel=1e-12)
    # a small weight's groups are made finer, never coarser, to split over 8 ranks
    assert nf4_blocks(32 * 32) == (64, 2) and nf4_blocks(256 * 256) == (64, 128)
    assert nf4_blocks(100) is None


# ------------------------------------------------------------------ layouts, checkpoints
def _train(rank, world_size, folder, name: str, ckpt) -> dict:
    from meshfit import Accelerator, ParallelDims
    from meshfit.checkpoint.pretrained import meta_model
    from meshfit.peft import qlora

    def fresh():
        acc = Accelerator(parallel=ParallelDims(**dims), mixed_precision="no", **options)
        torch.manual_seed(1)
        model = acc.prepare(qlora(meta_model(folder, dtype=torch.float64), r=4, alpha=8))
        opt = acc.prepare(torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=1e-2))
        return acc, model, opt

    dims, options = LAYOUTS.get(name, ({}, {}))
    if world_size == 1:
        dims, options = {}, {}
    acc, model, opt = fresh()
    x, y = _batch()
    dp, r = acc.num_processes, acc.process_index
    share = slice(r * len(x) // dp, (r + 1) * len(x) // dp)

    def step():
        loss = _loss(model, x[share], y[share])
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        return acc.reduce(loss.detach(), "mean").item()

    losses = [step() for _ in range(SAVE_AT)]
    acc.save_state(ckpt)
    losses += [step() for _ in range(STEPS - SAVE_AT)]
    state = acc.get_state_dict(model)
    # a fresh job resumes from the checkpoint
    acc, model, opt = fresh()
    acc.load_state(ckpt)
    resumed = [step() for _ in range(STEPS - SAVE_AT)]
    return {"losses": losses, "resumed": resumed,
            "state": {k: v.clone() for k, v in state.items()}}


@pytest.fixture(scope="module")
def layouts(folder, tmp_path_factory):
    root = tmp_path_factory.mktemp("qlora-runs")
    one = _train(0, 1, folder, "one", root / "one")
    runs = run_cases({name: (_train, folder, name, root / name) for name in LAYOUTS}, 2,
                     timeout=300)
    return one, runs


@pytest.mark.parametrize("name", LAYOUTS)
def test_layouts_train_like_one_process_and_resume_exactly(layouts, name):
    one, runs = layouts
    got = case_result(runs, name)[0]
    assert got["losses"] == pytest.approx(one["losses"], rel=RTOL)
    assert got["losses"][-1] < got["losses"][0]  # the adapters trained
    assert got["resumed"] == got["losses"][SAVE_AT:]  # bit for bit
    # the whole model, dequantized: the one-process weights (adapters trained alike)
    assert got["state"].keys() == one["state"].keys()
    for key, value in one["state"].items():
        assert type(got["state"][key]) is torch.Tensor, key
        torch.testing.assert_close(got["state"][key], value, rtol=RTOL, atol=1e-12)


def test_the_checkpoint_holds_the_adapters_not_the_4_bit_base(layouts, folder):
    """The dequantized state loads into a plain transformers model whose block weights are
    the NF4 round trip of the folder's; the checkpoint's model part has adapter keys only."""
    import transformers

    from meshfit.checkpoint.state import model_state

    one, _ = layouts
    state = one["state"]
    base = transformers.LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float64)
    rounded = _rounded(transformers.LlamaForCausalLM.from_pretrained(
        folder, torch_dtype=torch.float64))
    key = "base_model.model.model.layers.1.mlp.down_proj.base_layer.weight"  # (adapted)
    assert torch.equal(state[key], rounded.model.layers[1].mlp.down_proj.weight)
    assert not torch.equal(state[key], base.model.layers[1].mlp.down_proj.weight)
    from meshfit.peft import qlora

    q = qlora(_rounded(base), r=4, alpha=8)
    kept = model_state([q])
    assert kept and all("lora_" in k for k in kept), sorted(kept)[:4]


# ------------------------------------------------------------------ bad input
def _cfg(folder, **sections):
    from meshfit.train.configfile import build_config

    return build_config({"model": {"hf_model": str(folder)}, "peft": {"method": "qlora"},
                         "data": {"tokenizer": "bytes"},
                         "train": {"global_batch_size": 16, "micro_batch_size": 1}, **sections})


def test_bad_input_is_one_line_before_launch(folder, monkeypatch):
    import importlib.util

    from meshfit.train.configfile import build_config
    from meshfit.train.preflight import check_layout

    cases = [
        (build_config({"peft": {"method": "qlora"}}), 1,
         "peft.method='qlora' keeps pretrained weights in 4 bits: set model.hf_model"),
        (_cfg(folder, parallel={"tp": 2, "dp_replicate": 1}), 2,
         "peft.method='qlora' with parallel.tp=2 is not available yet"),
        # q_proj: 64 rows x 64, 64 blocks of 64 in 8 groups of 8: 16 ranks cannot split them
        (_cfg(folder, parallel={"dp_shard": 16, "dp_replicate": 1, "zero_stage": 3}), 16,
         "peft.method='qlora' with parallel.dp_shard=16: model.layers.0.self_attn.q_proj.weight "
         "(64 rows, 8 group(s) of 64x8 4-bit values) does not split evenly over 16 ranks"),
    ]
    for cfg, world, message in cases:
        with pytest.raises(ValueError) as err:
            check_layout(cfg, world)
        assert str(err.value).startswith(message), str(err.value)
        assert "\n" not in str(err.value)
    # ZeRO-1 keeps whole weights on every rank: any number of ranks
    check_layout(_cfg(folder, parallel={"dp_shard": 16, "dp_replicate": 1,
                                        "zero_stage": 1}), 16)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(ValueError, match=r"^peft\.method='qlora': the 4-bit \(NF4\) base needs "
                                         r"torchao; pip install 'meshfit\[qlora\]'"):
        check_layout(_cfg(folder), 1)
