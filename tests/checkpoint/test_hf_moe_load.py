"""`meshfit.checkpoint.pretrained` (the ``[model] hf_model`` path) reading Hugging Face
mixture-of-experts folders: transformers 5 holds the routed experts fused
(``mlp.experts.gate_up_proj`` [E, 2F, d], ``mlp.experts.down_proj`` [E, d, F]) while
``save_pretrained`` writes one tensor per expert (Mixtral: ``block_sparse_moe.experts.{e}.
w1/w2/w3.weight`` and ``block_sparse_moe.gate.weight``; Qwen2-MoE: ``mlp.experts.{e}.
gate_proj/up_proj/down_proj.weight``).

Tiny models (2 layers, 4 experts, hidden 32, fp32; Qwen2-MoE's second layer dense) are saved
with ``save_pretrained``, built with `meta_model` and filled by `load_into`: every parameter
must equal the saved model's bit for bit, and so must the logits. Also: a folder already in
the fused layout (``save_model_folder``, what ``meshfit train`` writes to OUT/model), a region
read touching only its experts' tensors, a missing expert named in the error, and rank 1 of an
FSDP2 layout (torch's fake process group, in this process) reading only its own experts'
tensors (its shard of dim 0) and files from a sharded folder.
"""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ("mixtral", "qwen2moe")
EXPERTS = 4


def _build(family: str, seed: int = 0) -> torch.nn.Module:
    import transformers

    common = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=2, vocab_size=64, max_position_embeddings=32,
                  num_experts_per_tok=2)
    torch.manual_seed(seed)
    if family == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=48, num_local_experts=EXPERTS,
                                            **common)
        return transformers.MixtralForCausalLM(config).eval()
    config = transformers.Qwen2MoeConfig(intermediate_size=64, moe_intermediate_size=24,
                                         shared_expert_intermediate_size=40,
                                         num_experts=EXPERTS, mlp_only_layers=[1], **common)
    return transformers.Qwen2MoeForCausalLM(config).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> (the model, its save_pretrained folder); "mixtral-sharded": the same Mixtral
    in several safetensors files (save_pretrained's: one kind of expert tensor per file),
    "mixtral-by-expert": one file per expert index."""
    tmp = tmp_path_factory.mktemp("moe")
    out = {}
    for family in FAMILIES:
        model = _build(family)
        model.save_pretrained(tmp / family)
        out[family] = (model, tmp / family)
    model = out["mixtral"][0]
    model.save_pretrained(tmp / "mixtral-sharded", max_shard_size="20KB")
    out["mixtral-sharded"] = (model, tmp / "mixtral-sharded")
    out["mixtral-by-expert"] = (model, _by_expert(tmp / "mixtral", tmp / "mixtral-by-expert"))
    return out


def _by_expert(src, dst):
    """`src`'s weights as a sharded folder with one file per expert index (its tensors of
    every layer) and one for the rest: what a rank that needs some experts need not open."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    files: dict[str, dict] = {}
    for key, tensor in load_file(str(src / "model.safetensors")).items():
        part = key.split(".experts.")[1].split(".")[0] if ".experts." in key else "rest"
        files.setdefault(f"model-{part}.safetensors", {})[key] = tensor
    for file, state in files.items():
        save_file(state, str(dst / file), metadata={"format": "pt"})
    weight_map = {key: file for file, state in files.items() for key in state}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return dst


def _load(folder) -> torch.nn.Module:
    """What `Accelerator.prepare` does with a `meta_model` on one process."""
    from meshfit.checkpoint.pretrained import load_into, meta_model, to_empty

    model = meta_model(folder)
    buffers = {n: b.detach().clone() for n, b in model.named_buffers() if not b.is_meta}
    to_empty(model, "cpu")
    load_into(model, folder, buffers=buffers)
    return model.eval()


def _keys(folder) -> set[str]:
    from meshfit.checkpoint.pretrained import _Files

    return set(_Files(folder).weight_map)


def _assert_same(model, original):
    ref = dict(original.named_parameters())
    got = dict(model.named_parameters())
    assert got.keys() == ref.keys()
    for name, p in got.items():
        assert torch.equal(p, ref[name]), name
    x = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(x).logits, original(x).logits)


@pytest.mark.parametrize("family", [*FAMILIES, "mixtral-sharded", "mixtral-by-expert"])
def test_per_expert_folder_loads_exactly(saved, family):
    original, folder = saved[family]
    keys = _keys(folder)
    # The folder really is in the per-expert layout (and, for Mixtral, block_sparse_moe).
    assert not any(k.endswith("gate_up_proj") for k in keys)
    if family.startswith("mixtral"):
        assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in keys
    else:
        assert "model.layers.0.mlp.experts.3.up_proj.weight" in keys
        assert "model.layers.1.mlp.gate_proj.weight" in keys  # the dense layer
    if family.startswith("mixtral-"):
        assert len(set(json.loads((folder / "model.safetensors.index.json").read_text())
                       ["weight_map"].values())) > 2
    _assert_same(_load(folder), original)


def test_fused_layout_folder_loads_exactly(saved, tmp_path):
    from meshfit.checkpoint.saved import save_model_folder

    original, _ = saved["mixtral"]
    save_model_folder(tmp_path / "model", original.state_dict(), original)
    assert "model.layers.0.mlp.experts.gate_up_proj" in _keys(tmp_path / "model")
    _assert_same(_load(tmp_path / "model"), original)


def test_region_reads_only_its_experts(saved):
    """The read of one FSDP2 shard (experts [2, 4)) and of an arbitrary block across the gate
    | up boundary: the right values, from those experts' tensors only."""
    from meshfit.checkpoint import pretrained

    original, folder = saved["mixtral"]
    files = pretrained._Files(folder)
    read = []
    slice_ = files.slice
    files.slice = lambda key: (read.append(key), slice_(key))[1]
    model = pretrained.meta_model(folder)
    name = "model.layers.1.mlp.experts.gate_up_proj"
    fused = original.get_parameter(name).detach()
    stack = pretrained._experts_source(files, model, name, "model", fused.shape)
    assert stack.shape == tuple(fused.shape) == (EXPERTS, 96, 32)
    for index in ((slice(2, 4), slice(0, 96), slice(0, 32)),
                  (slice(1, 2), slice(40, 60), slice(5, 9))):
        read.clear()
        out = torch.empty(fused[index].shape, dtype=torch.float64)
        stack.read_into(out, index)
        assert torch.equal(out, fused[index].double())
        experts = {int(k.split(".experts.")[1].split(".")[0]) for k in read}
        assert experts == set(range(index[0].start, index[0].stop)), read
        assert {k.rsplit(".", 2)[1] for k in read} == {"w1", "w3"}


def test_missing_expert_is_named(saved, tmp_path):
    from safetensors.torch import load_file, save_file

    _, folder = saved["mixtral"]
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    state = load_file(str(folder / "model.safetensors"))
    del state["model.layers.0.block_sparse_moe.experts.2.w3.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"experts\.2\.w3\.weight"):
        _load(tmp_path)


# ---------------------------------------------------------------------------- a shard
def test_fsdp2_rank_reads_its_experts_only(saved, monkeypatch):
    """Rank 1 of 2 under FSDP2 (torch's fake process group: one process playing rank 1, no
    communication needed to load), each decoder layer and the model `fully_shard`-ed on the
    meta device, then `to_empty` + `load_into`, as `Accelerator.prepare` does under ZeRO-3:
    every local shard equals its block of the saved model; of the routed experts only 2 and 3
    were read, and the files holding nothing else of this rank's were never opened."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshfit.checkpoint import pretrained

    original, folder = saved["mixtral-by-expert"]
    read, opened = [], set()
    slice_ = pretrained._Files.slice

    def spy(self, key):
        read.append(key)
        out = slice_(self, key)
        opened.update(self._open)
        return out

    monkeypatch.setattr(pretrained._Files, "slice", spy)
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        model = pretrained.meta_model(folder)
        buffers = {n: b.detach().clone() for n, b in model.named_buffers() if not b.is_meta}
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        pretrained.to_empty(model, "cpu")
        pretrained.load_into(model, folder, buffers=buffers)
        for name, p in model.named_parameters():
            shape, offset = pretrained._local_region(p)
            block = tuple(slice(o, o + n) for o, n in zip(offset, shape))
            assert torch.equal(p.to_local(), original.get_parameter(name)[block]), name
            if name.endswith("experts.gate_up_proj"):
                assert str(p.placements) == "(Shard(dim=0),)" and offset[0] == 2
    finally:
        dist.destroy_process_group()
    experts = {int(k.split(".experts.")[1].split(".")[0]) for k in read if ".experts." in k}
    assert experts == {2, 3}, read
    weight_map = pretrained._Files(folder).weight_map
    others = set(weight_map.values()) - {weight_map[k] for k in read}
    assert others == {"model-0.safetensors", "model-1.safetensors"}
    assert not opened & others, opened
