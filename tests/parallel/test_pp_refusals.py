"""Which models pipeline parallel takes, said before anything starts (no process group).

`meshfit.parallel.pp.pp_problem` answers for a model or a configuration: every family of
`meshfit.models.families` (their plans read from transformers' ``base_model_pp_plan``) is
taken; more stages than layers, a decoder whose family ships no pp plan (BLOOM), a
linear-attention hybrid (Qwen3-Next), an encoder-decoder (T5) and layers sharing earlier
layers' keys and values (Gemma 3n) are refused in one line
naming the family and what works instead. `meshfit train` refuses the same before launch.
"""

from __future__ import annotations

import pytest
import torch

from meshfit.models.families import FAMILIES, tiny_config, tiny_model

VOCAB = 512  # holds the byte tokenizer's ids


def _refused():
    import transformers

    return {"bloom": transformers.BloomConfig(n_layer=2, hidden_size=64, n_head=4,
                                              vocab_size=VOCAB),
            "qwen3_next": transformers.Qwen3NextConfig(num_hidden_layers=4, vocab_size=VOCAB),
            "t5": transformers.T5Config(num_layers=2, vocab_size=VOCAB),
            "gemma3n_text": transformers.Gemma3nTextConfig(vocab_size=VOCAB)}


def test_pp_problem_takes_every_family_and_refuses_what_it_cannot_cut():
    from meshfit.models import GPTConfig
    from meshfit.parallel.pp import pp_problem

    for family in FAMILIES:
        config = tiny_config(family)  # 2 layers
        assert pp_problem(config, 2) is None, family
        assert "exceeds the 2 layers" in pp_problem(config, 2, virtual_stages=2), family
    with torch.device("meta"):
        model = tiny_model("gemma3_text", layers=4)
    assert pp_problem(model, 2, virtual_stages=2) is None
    assert pp_problem(model, 5) == ("pp=5 exceeds the 4 layers of Gemma3ForCausalLM (each "
                                    "stage holds at least one); use pp*virtual_stages <= 4")
    assert pp_problem(GPTConfig(n_layer=2), 2) is None
    assert "exceeds the 2 layers" in pp_problem(GPTConfig(n_layer=2), 3)
    expected = {"bloom": "model_type 'bloom' ships no base_model_pp_plan",
                "qwen3_next": "model_type 'qwen3_next' has layers of type ['linear_attention']",
                "t5": "model_type 't5' is an encoder-decoder",
                "gemma3n_text": "num_kv_shared_layers=15 layers attend with the keys and values "
                                "of earlier layers"}
    for kind, config in _refused().items():
        line = pp_problem(config, 2)
        assert expected[kind] in line and "parallel.dp_shard" in line, line
        assert "\n" not in line


@pytest.fixture
def hf_files(tmp_path):
    for family in ("qwen3", "gemma3_text"):
        tiny_config(family, vocab_size=VOCAB).save_pretrained(tmp_path / family)
    _refused()["bloom"].save_pretrained(tmp_path / "bloom")
    return tmp_path


def _train(tmp_path, family, pp, *extra):
    return ("train", "--nproc", str(pp), "--out", str(tmp_path / "run"),
            f"--model.hf_config={tmp_path / family}", f"--parallel.pp={pp}",
            "--parallel.dp_replicate=1", *extra)


def test_meshfit_train_refuses_pp_it_cannot_cut_before_launch(cli_refusal, hf_files):
    line = cli_refusal(*_train(hf_files, "qwen3", 4))
    assert "parallel.pp=4 exceeds the model's 2 blocks" in line
    line = cli_refusal(*_train(hf_files, "bloom", 2))
    assert ("parallel.pp=2: no built-in pipeline plan for BloomForCausalLM: model_type 'bloom' "
            "ships no base_model_pp_plan") in line
    assert "parallel.dp_shard" in line
    assert not (hf_files / "run").exists()


def test_meshfit_train_takes_pp_for_a_family_with_a_pp_plan(hf_files, monkeypatch, capsys):
    """Gemma 3 (alternating layer types, tied embeddings) passes every check and reaches
    the launch (replaced here)."""
    import meshfit.cli.main as cli
    from meshfit import launch

    class Launched(Exception):
        pass

    def run(*args, **kwargs):
        raise Launched

    monkeypatch.setattr(launch, "run", run)
    monkeypatch.setenv("MESHFIT_CPU", "1")
    with pytest.raises(Launched):
        cli.main(list(_train(hf_files, "gemma3_text", 2, "--train.seq_len=16")))
