"""An `hf_model` folder whose weights are not this model's is refused before launch, from the
safetensors headers alone (`meshfit.checkpoint.pretrained.check_weights`): integer weights
(which used to load silently as zeros), a tensor of the wrong shape, a truncated file, a
missing tensor; a good folder passes."""

from __future__ import annotations

import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-weights")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                   num_key_value_heads=2, num_hidden_layers=2, vocab_size=256,
                                   max_position_embeddings=128)
    transformers.LlamaForCausalLM(cfg).save_pretrained(root / "good")
    weights = load_file(root / "good" / "model.safetensors")
    variants = {
        "integers": {k: (v.long() if "q_proj" in k else v) for k, v in weights.items()},
        "shape": {k: (v[:16] if "up_proj" in k else v) for k, v in weights.items()},
        "missing": {k: v for k, v in weights.items() if "layers.1.mlp.down_proj" not in k},
    }
    for name, tensors in variants.items():
        shutil.copytree(root / "good", root / name)
        save_file(tensors, str(root / name / "model.safetensors"), metadata={"format": "pt"})
    shutil.copytree(root / "good", root / "truncated")
    data = (root / "good" / "model.safetensors").read_bytes()
    (root / "truncated" / "model.safetensors").write_bytes(data[:-1000])
    return root


@pytest.mark.parametrize("variant, wanted", [
    ("integers", r"model.layers.0.self_attn.q_proj.weight is stored as I64, not a "
                 r"floating-point type"),
    ("shape", r"model.layers.0.mlp.up_proj.weight has shape \[16, 32\] in the safetensors, the "
              r"model its config.json describes needs \[64, 32\]"),
    ("missing", r"the safetensors hold no model.layers.1.mlp.down_proj.weight"),
    ("truncated", r"model.safetensors is truncated: \d+ bytes, its header describes \d+"),
])
def test_weights_that_are_not_the_models_are_refused_before_launch(folders, variant, wanted,
                                                                   tmp_path, capsys):
    from meshfit.checkpoint.pretrained import check_weights, meta_model
    from meshfit.cli.main import main

    check_weights(meta_model(folders / "good"), folders / "good")  # the good one passes
    with pytest.raises(ValueError, match=wanted):
        check_weights(meta_model(folders / variant), folders / variant)
    out = tmp_path / "run"
    assert main(["train", "--nproc", "1", "--out", str(out),
                 f"--model.hf_model={folders / variant}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"meshfit train: error: model.hf_model='{folders / variant}': "), err
    assert not out.exists()


def test_generate_from_a_truncated_model_is_one_line(folders, capsys):
    from meshfit.cli.main import main

    assert main(["generate", str(folders / "truncated"), "--prompt", "hi",
                 "--max-new-tokens", "2", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot be read" in err[0] and "incomplete" in err[0], err
