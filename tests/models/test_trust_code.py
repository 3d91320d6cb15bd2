"""Code a model folder names runs only when the user says so (`meshfit.models.factory.
check_folder_code`): a meshfit-factory folder's ``factory`` and transformers' remote code
(``auto_map``) are refused in one line naming the code and the way to allow it, by every
command that opens a folder someone else may have written (eval, generate, train and verify
through ``model.hf_config`` / ``hf_model``, estimate, plan), before anything of the folder
runs; with ``--trust-code`` (or ``model.trust_code = true``) it runs. Each folder's code
writes a marker file when it runs, so the test sees whether it ran."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from meshfit.checkpoint.saved import save_model_folder
from meshfit.cli.main import main
from meshfit.data import ByteTokenizer
from meshfit.models.factory import check_folder_code, folder_code
from meshfit.train.configfile import build_config

FACTORY = '''
import pathlib
import torch
from torch import nn

class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(256, 8), nn.Linear(8, 256)

    def forward(self, x):
        return self.head(self.emb(x))

def build():
    pathlib.Path(__file__).with_name("factory-ran").write_text("ran")
    return Tiny()
'''
REMOTE = '''
import pathlib
pathlib.Path(MARKER).write_text("ran")  # (transformers runs a copy in its module cache)
from transformers import LlamaConfig

class ProbeConfig(LlamaConfig):
    model_type = "meshfit_trust_probe"
'''
MODELING = '''
from transformers import LlamaForCausalLM

from .configuration_probe import ProbeConfig

class ProbeForCausalLM(LlamaForCausalLM):
    config_class = ProbeConfig
'''


@pytest.fixture
def folders(tmp_path, monkeypatch):
    """(a meshfit-factory model folder, a transformers folder with remote code)."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "meshfit_trust_factory.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(code))
    monkeypatch.chdir(tmp_path)
    import meshfit_trust_factory

    model = meshfit_trust_factory.Tiny()
    (code / "factory-ran").unlink(missing_ok=True)
    factory = save_model_folder(tmp_path / "factory", model.state_dict(), model,
                                tokenizer=ByteTokenizer(), factory="meshfit_trust_factory:build")
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "configuration_probe.py").write_text(
        REMOTE.replace("MARKER", repr(str(remote / "remote-ran"))))
    (remote / "modeling_probe.py").write_text(MODELING)
    (remote / "config.json").write_text(json.dumps({
        "model_type": "meshfit_trust_probe", "vocab_size": 300, "hidden_size": 16,
        "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "auto_map": {"AutoConfig": "configuration_probe.ProbeConfig",
                     "AutoModelForCausalLM": "modeling_probe.ProbeForCausalLM"}}))
    return factory, remote


def _refused(capsys, argv: list[str], code: str, flag: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and code in err and f"add {flag}" in err, err


def test_a_folders_code_runs_only_when_the_user_says_so(folders, capsys, tmp_path):
    factory, remote = folders
    ran = tmp_path / "code" / "factory-ran"
    for command in (["eval", str(factory)], ["generate", str(factory), "--prompt", "ab"]):
        _refused(capsys, command + ["--device", "cpu"],
                 "factory 'meshfit_trust_factory:build'", "--trust-code")
    assert not ran.exists()
    assert main(["generate", str(factory), "--prompt", "ab", "--max-new-tokens", "2",
                 "--temperature", "0", "--device", "cpu", "--trust-code"]) == 0
    assert ran.exists()  # said so: the factory built the model

    probe = remote / "remote-ran"
    named = "transformers remote code (auto_map: AutoConfig -> configuration_probe.ProbeConfig,"
    for command in (["estimate", str(remote)], ["plan", str(remote), "--gpus-per-node", "2"],
                    ["verify", f"--model.hf_config={remote}"],
                    ["train", f"--model.hf_config={remote}", "--out", str(tmp_path / "run")]):
        flag = "--trust-code" if command[0] in ("estimate", "plan") else \
            "model.trust_code = true"
        _refused(capsys, command, named, flag)
    assert not probe.exists() and not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match=r"^model.hf_model=.*names code to run"):
        build_config({"model": {"hf_model": str(remote)}})
    cfg = build_config({"model": {"hf_config": str(remote), "trust_code": True}})
    assert cfg.model.trust_code and not probe.exists()  # allowed; nothing run yet


def test_what_a_folder_names_and_what_it_does_not(tmp_path):
    """An ``auto_map`` beside a model type (or tokenizer class) transformers holds is not
    code transformers runs (it builds its own class); a folder without config.json, or with a damaged one, names
    nothing here (its reader says what is wrong); a factory folder's code is not run by
    transformers' readers (``factories=False``)."""
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "llama", "auto_map": {"AutoModelForCausalLM": "modeling_x.X"}}))
    assert folder_code(tmp_path) is None
    assert folder_code(tmp_path / "missing") is None
    (tmp_path / "config.json").write_text("{not json")
    assert folder_code(tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "meshfit-factory", "factory": "os:system"}))
    assert folder_code(tmp_path / "config.json").endswith(": factory 'os:system'")
    assert folder_code(tmp_path, factories=False) is None
    check_folder_code(tmp_path, trust_code=True, field="RUN_OR_MODEL", how="--trust-code")
    tokenizer = tmp_path / "tokenizer"  # a tokenizer's remote code: meshfit eval loads it too
    tokenizer.mkdir()
    for name, named in (("LlamaTokenizerFast", False), ("ProbeTokenizer", True)):
        (tokenizer / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": name, "auto_map": {"AutoTokenizer": [None, "tok_x.Probe"]}}))
        code = folder_code(tokenizer)
        assert (code == "its tokenizer_config.json names code to run when the tokenizer "
                "loads: transformers remote code (auto_map: AutoTokenizer -> "
                "[None, 'tok_x.Probe'])") if named else code is None
    with pytest.raises(ValueError, match=r"^RUN_OR_MODEL='.*': its config.json names code to "
                                         r"run when the model is built: factory 'os:system'"):
        check_folder_code(tmp_path, trust_code=False, field="RUN_OR_MODEL", how="--trust-code")


def test_trust_code_lets_transformers_run_the_remote_code(folders, monkeypatch, tmp_path):
    """With model.trust_code = true the hf_config folder's remote code builds the model
    (meshfit passes trust_remote_code; transformers copies the module to its cache, here a
    temporary folder)."""
    import transformers.dynamic_module_utils as dynamic

    from meshfit.train.models import build_model

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    _, remote = folders
    cfg = build_config({"model": {"hf_config": str(remote), "trust_code": True},
                        "train": {"seq_len": 16}})
    model = build_model(cfg, 256, meta=True)
    assert type(model).__name__ == "ProbeForCausalLM" and (remote / "remote-ran").exists()
    assert isinstance(model, nn.Module) and next(model.parameters()).device == torch.device("meta")


def test_a_tokenizer_folders_code_runs_only_when_the_user_says_so(tmp_path, capsys):
    """``[data] tokenizer`` naming a folder whose tokenizer_config.json maps to its own code:
    `meshfit train` refuses it before anything is launched or written (not transformers'
    [y/N] prompt mid-run); ``model.trust_code = true`` is the way to allow it."""
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "ProbeTokenizer", "auto_map": {"AutoTokenizer": [None, "tok_x.Probe"]}}))
    _refused(capsys, ["train", f"--data.tokenizer={tokenizer}", "--out", str(tmp_path / "run"),
                      "--train.steps=1"],
             "data.tokenizer=", "model.trust_code = true")
    assert not (tmp_path / "run").exists()
