"""LoRA through peft (`meshfit.peft`): trainable counts against the closed form r * (in + out)
per adapted linear, a frozen base under AdamW, adapter-only optimizer state and checkpoints,
and input validation. Tiny models on CPU: meshfit's GPT and a Hugging Face Llama built from a
config (no download)."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402

from meshfit.models import GPT, GPTConfig  # noqa: E402
from meshfit.peft import load_adapter, lora, merge, save_adapter, trainable_parameters  # noqa: E402

R = 4
LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)


def _gpt_lora_count(cfg: GPTConfig, r: int) -> int:
    """Closed form for GPT_TARGET_MODULES: q/o are d->d, k/v are d->kv, the MLP is d<->ff."""
    d, kv, ff = cfg.d_model, cfg.kv_heads * cfg.head_dim, cfg.d_ff
    mlp = 2 * (d + ff) if cfg.mlp == "gelu" else 3 * (d + ff)
    return cfg.n_layer * r * (2 * (d + d) + 2 * (d + kv) + mlp)


def _llama_lora_count(r: int) -> int:
    """q_proj is h->h, v_proj is h->kv_heads*head_dim."""
    h = LLAMA["hidden_size"]
    kv = LLAMA["num_key_value_heads"] * h // LLAMA["num_attention_heads"]
    return LLAMA["num_hidden_layers"] * r * ((h + h) + (h + kv))


@dataclasses.dataclass(frozen=True)
class Case:
    build: Callable[[], nn.Module]  # same weights on every call (seeded)
    targets: list[str] | None
    expected: Callable[[int], int]  # trainable elements for rank r
    loss: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    logits: Callable[[nn.Module, torch.Tensor], torch.Tensor]


def _seeded(factory):
    def build():
        torch.manual_seed(0)
        return factory()
    return build


_TINY = GPTConfig.preset("tiny")
_TINY_LLAMA_STYLE = GPTConfig.preset("tiny", norm="rmsnorm", mlp="swiglu", pos="rope", bias=False,
                                     tie_embeddings=False, n_kv_head=2)
CASES = {
    "gpt": Case(_seeded(lambda: GPT(_TINY)), None, lambda r: _gpt_lora_count(_TINY, r),
                lambda m, x: m(x, x), lambda m, x: m(x)),
    "gpt-swiglu-gqa": Case(_seeded(lambda: GPT(_TINY_LLAMA_STYLE)), None,
                           lambda r: _gpt_lora_count(_TINY_LLAMA_STYLE, r),
                           lambda m, x: m(x, x), lambda m, x: m(x)),
    "hf-llama": Case(
        _seeded(lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))),
        ["q_proj", "v_proj"], _llama_lora_count,
        lambda m, x: m(input_ids=x, labels=x).loss, lambda m, x: m(input_ids=x).logits,
    ),
}
TRAIN_CASES = ["gpt", "hf-llama"]


pytestmark = pytest.mark.usefixtures("one_thread")


def _batch() -> torch.Tensor:
    return torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))


def _train(case: Case, model: nn.Module, steps: int) -> tuple[torch.optim.AdamW, list[float]]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    idx, losses = _batch(), []
    for _ in range(steps):
        loss = case.loss(model, idx)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return opt, losses


@pytest.mark.parametrize("name", list(CASES))
def test_trainable_count_matches_closed_form(name):
    case = CASES[name]
    base_total = sum(p.numel() for p in case.build().parameters())
    model = lora(case.build(), r=R, target_modules=case.targets)
    trainable, total = trainable_parameters(model)
    assert trainable == case.expected(R)
    assert total == base_total + trainable
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    assert model.get_nb_trainable_parameters() == (trainable, total)  # peft agrees


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_default_targets_are_every_block_linear_in_training_and_the_estimate(family, tmp_path):
    """One rule for `[peft] target_modules = []`: every linear inside the blocks (q, k, v, o
    and the MLP's; GPT-2's fused Conv1D projections as they are), not peft's Llama default
    (q_proj, v_proj). What `meshfit train` builds (`build_model`: trainable counted on the
    model) equals what `meshfit estimate --peft lora` counts (`Adapters.lora` of the
    config's `ModelShape`) and the closed form r * (in + out) per projection."""
    from meshfit.memory import Adapters, ModelShape
    from meshfit.train.configfile import build_config
    from meshfit.train.fits import adapters_of
    from meshfit.train.models import build_model

    h, layers, kv = LLAMA["hidden_size"], LLAMA["num_hidden_layers"], 2 * 64 // 4
    if family == "llama":
        transformers.LlamaConfig(**LLAMA).save_pretrained(tmp_path)
        ff = LLAMA["intermediate_size"]  # q, o: h->h; k, v: h->kv; gate, up: h->ff; down
        closed = layers * R * (2 * (h + h) + 2 * (h + kv) + 3 * (h + ff))
        short = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    else:
        transformers.GPT2Config(n_embd=h, n_layer=layers, n_head=4, vocab_size=256,
                                n_positions=64, bos_token_id=0,
                                eos_token_id=0).save_pretrained(tmp_path)
        closed = layers * R * ((h + 3 * h) + (h + h) + (h + 4 * h) + (4 * h + h))
        short = {"c_attn", "c_proj", "c_fc"}
    cfg = build_config({"model": {"hf_config": str(tmp_path)},
                        "peft": {"method": "lora", "r": R}})
    model = build_model(cfg, 256, meta=True)
    assert set(model.peft_config["default"].target_modules) == short
    trained = adapters_of(model)
    estimated = Adapters.lora(ModelShape.of(str(tmp_path), vocab_size=256), R)
    assert trained == estimated == Adapters(trainable=closed)


@pytest.mark.parametrize("name", TRAIN_CASES)
def test_training_moves_only_adapters(name):
    case = CASES[name]
    model = lora(case.build(), r=R, target_modules=case.targets)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    opt, losses = _train(case, model, steps=5)

    assert losses[-1] < losses[0], losses
    params = dict(model.named_parameters())
    for n, before in frozen.items():
        assert torch.equal(params[n], before), f"frozen {n} changed"
    for n, before in adapters.items():
        assert not torch.equal(params[n], before), f"adapter {n} did not move"
    # AdamW keeps two moments per trainable element and nothing for the frozen base.
    trainable = trainable_parameters(model)[0]
    assert len(opt.state) == len(adapters)
    assert {id(p) for p in opt.state} == {id(params[n]) for n in adapters}
    moments = sum(s["exp_avg"].numel() + s["exp_avg_sq"].numel() for s in opt.state.values())
    assert moments == 2 * trainable


@pytest.mark.parametrize("name", TRAIN_CASES)
def test_adapter_round_trip(name, tmp_path):
    case = CASES[name]
    model = lora(case.build(), r=R, target_modules=case.targets)
    _train(case, model, steps=3)  # lora_B starts at zero: train so the adapter matters
    model.eval()
    directory = save_adapter(model, tmp_path / "adapter")

    with safe_open(str(directory / "adapter_model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
        saved = sum(f.get_tensor(k).numel() for k in keys)
    assert keys and all("lora_" in k for k in keys)
    assert saved == trainable_parameters(model)[0]
    base_bytes = sum(p.numel() * p.element_size() for p in case.build().parameters())
    assert (directory / "adapter_model.safetensors").stat().st_size < base_bytes / 10

    idx = _batch()
    with torch.no_grad():
        want = case.logits(model, idx)
        assert not torch.equal(case.logits(case.build().eval(), idx), want)
        # Same weights, same ops, same CPU: bit-identical, no tolerance needed.
        for fresh in (lora(case.build(), r=R, target_modules=case.targets), case.build()):
            loaded = load_adapter(fresh, directory).eval()
            assert torch.equal(case.logits(loaded, idx), want)
            assert trainable_parameters(loaded) == trainable_parameters(model)

    # the adapter's weights carry digests (meshfit-digests.json, which peft ignores): one flipped
    # byte is refused by name, never loaded
    weights = directory / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x40
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"adapter_model.safetensors: bytes \d+-\d+ .*differ"):
        load_adapter(case.build(), directory)


def test_failed_save_keeps_previous_adapter(tmp_path, monkeypatch):
    case = CASES["gpt"]
    model = lora(case.build(), r=R)
    _train(case, model, steps=2)
    directory = save_adapter(model, tmp_path / "adapter")
    before = (directory / "adapter_model.safetensors").read_bytes()

    def broken_save(save_directory, **kwargs):
        (Path(save_directory) / "adapter_model.safetensors").write_bytes(b"partial")
        raise OSError("disk full")

    _train(case, model, steps=1)
    monkeypatch.setattr(model, "save_pretrained", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save_adapter(model, directory)
    assert (directory / "adapter_model.safetensors").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["adapter"]  # no temp folders left

    monkeypatch.undo()
    save_adapter(model, directory)  # a working save replaces the old adapter
    assert (directory / "adapter_model.safetensors").read_bytes() != before
    assert [p.name for p in tmp_path.iterdir()] == ["adapter"]


def test_load_rejects_other_settings(tmp_path):
    case = CASES["gpt"]
    save_adapter(lora(case.build(), r=R), tmp_path / "adapter")
    with pytest.raises(ValueError, match=r"different LoRA settings.*'r'"):
        load_adapter(lora(case.build(), r=2 * R), tmp_path / "adapter")


def test_merge_returns_plain_model():
    case = CASES["gpt"]
    model = lora(case.build(), r=R)
    _train(case, model, steps=3)
    model.eval()
    idx = _batch()
    with torch.no_grad():
        want = case.logits(model, idx)
        merged = merge(model)
        assert type(merged) is GPT
        # Merged W + s*B@A rounds differently from W x + s*B(A x) in float32.
        torch.testing.assert_close(case.logits(merged, idx), want, rtol=1e-4, atol=1e-5)


def test_ddp_wrapped_lora_trains_and_saves(tmp_path):
    """DDP registers only requires_grad parameters; the helpers see through the wrapper."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    case = CASES["gpt"]
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = DDP(lora(case.build(), r=R))
        _, losses = _train(case, model, steps=3)
        assert losses[-1] < losses[0]
        assert trainable_parameters(model)[0] == case.expected(R)
        directory = save_adapter(model, tmp_path / "adapter")
    finally:
        dist.destroy_process_group()
    with torch.no_grad():
        idx = _batch()
        loaded = load_adapter(case.build(), directory).eval()
        assert torch.equal(case.logits(loaded, idx), case.logits(model.module.eval(), idx))


@pytest.mark.parametrize("kwargs, field", [
    (dict(r=0), "r=0"),
    (dict(r=2.5), "r=2.5"),
    (dict(alpha=0), "alpha=0"),
    (dict(dropout=1.0), "dropout=1.0"),
    (dict(target_modules=["nope"]), "target_modules=['nope']"),
])
def test_bad_arguments(kwargs, field):
    with pytest.raises(ValueError) as err:
        lora(CASES["gpt"].build(), **kwargs)
    message = str(err.value)
    assert field in message and "\n" not in message
    if "target_modules" in kwargs:
        assert "'wq'" in message  # lists names that do exist


def test_plain_module_needs_target_modules():
    with pytest.raises(ValueError, match=r"target_modules=None .*\['0'\]"):
        lora(nn.Sequential(nn.Linear(4, 4)))


def test_wrapping_a_transformers_model_warns_nothing(recwarn):
    """peft reads transformers' deprecated `is_gradient_checkpointing` when it wraps a model:
    a FutureWarning about code neither the user nor meshfit wrote, which `lora` keeps quiet
    for library users too (the commands hide it as well)."""
    warnings.simplefilter("always")
    lora(_seeded(lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)))())
    assert [str(w.message) for w in recwarn if "is_gradient_checkpointing" in str(w.message)] == []
