"""User code run by `meshfit train` (a model factory, a module it imports, a config of
another library) that fails, in any way, is one line naming the setting, what was being
done, the error and the user's line, before any process starts or file is written
(`meshfit.train.models.user_code`)."""

from __future__ import annotations

import json

import pytest

FACTORIES = '''
import sys
import torch

def raises(vocab_size=256):
    raise RuntimeError("my factory broke")

def exits(vocab_size=256):
    sys.exit(0)

def keyerror(vocab_size=256):
    return {}["missing"]

def multiline(vocab_size=256):
    raise ValueError("first line\\nsecond line")


class _Model(torch.nn.Module):
    def __init__(self, ids, vocab_size, grad=True):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(ids, 16), torch.nn.Linear(16, vocab_size)
        self.grad = grad

    def forward(self, x, y=None):
        out = self.head(self.emb(x))
        return out if self.grad else out.detach()


def small_embedding(vocab_size=256):
    return _Model(100, vocab_size)


def no_gradient(vocab_size=256):
    return _Model(vocab_size, vocab_size, grad=False)
'''


@pytest.mark.parametrize("source, wanted", [
    ("--model.factory=userfacts:raises",
     "model.factory='userfacts:raises': building the model raised RuntimeError: my factory "
     "broke (at userfacts.py:6)"),
    ("--model.factory=userfacts:exits",
     "model.factory='userfacts:exits': building the model called sys.exit(0); a model source "
     "must return (or raise), not end the process"),
    ("--model.factory=userfacts:multiline",
     "model.factory='userfacts:multiline': building the model raised ValueError: first line "
     "second line (at userfacts.py:15)"),
    ("--model.factory=userbroken:build",
     "model.factory='userbroken:build': importing 'userbroken' raised OSError: no such device "
     "at import"),
    ("--model.hf_config={t}/negative.json",
     "building the model raised RuntimeError: Trying to create tensor with negative dimension"),
    ("--model.hf_config={t}/stringlayers.json", "num_hidden_layers' expected int, got str"),
    ("--model.factory=userfacts:small_embedding",
     "model.factory: the model's input embedding holds 100 ids but the tokenizer "
     "(data.tokenizer='bytes') gives up to 256"),
])
def test_failing_user_code_is_one_line_before_anything_starts(source, wanted, tmp_path,
                                                              monkeypatch, capsys):
    from meshfit.cli.main import main

    (tmp_path / "userfacts.py").write_text(FACTORIES)
    (tmp_path / "userbroken.py").write_text("raise OSError('no such device at import')\n")
    base = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
            "num_attention_heads": 2, "num_hidden_layers": 2, "vocab_size": 256}
    (tmp_path / "negative.json").write_text(json.dumps({**base, "hidden_size": -32}))
    (tmp_path / "stringlayers.json").write_text(json.dumps({**base, "num_hidden_layers": "2"}))
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    assert main(["train", "--nproc", "1", "--out", str(out), source.format(t=tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("meshfit train: error: "), err
    assert wanted in err[0], err[0]
    assert not out.exists()


def test_an_unwritable_default_cache_blames_data_cache_dir(monkeypatch, tmp_path):
    """A read-only HOME: the token cache's default folder cannot be made; the line names
    data.cache_dir (the setting that moves it), not data.path."""
    import errno

    from meshfit.train import preflight, tokens
    from meshfit.train.configfile import load_config

    monkeypatch.setenv("HOME", str(tmp_path))

    def load(cfg):
        raise OSError(errno.EROFS, "Read-only file system", str(tmp_path / ".cache"))

    monkeypatch.setattr(tokens, "load_tokens", load)
    with pytest.raises(ValueError) as err:
        preflight._readable_tokens(load_config(None, []), "the built-in corpus")
    assert str(err.value).startswith(
        f"data.cache_dir='~/.cache/meshfit/tokens' (the default): cannot use {tmp_path}/.cache "
        "(Read-only file system)")


def test_a_transformers_run_prints_only_meshfits_lines(tmp_path, subprocess_env):
    """With torchao installed beside a torch its compiled extensions were not built for,
    importing transformers logs "Failed to load ..._C_mxfp8...so" and torch's pytree notes;
    and peft, wrapping a transformers model with LoRA, reads an attribute transformers 5
    deprecates (a FutureWarning per process: the launcher's check, then each rank): a meshfit
    command shows none of them (its output is its own)."""
    import subprocess
    import sys

    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                   num_hidden_layers=1, vocab_size=256,
                                   max_position_embeddings=64)
    cfg.save_pretrained(tmp_path / "cfg")
    proc = subprocess.run([sys.executable, "-m", "meshfit", "train", "--nproc", "1", "--out",
                           str(tmp_path / "run"), f"--model.hf_config={tmp_path / 'cfg'}",
                           "--train.steps=1", "--train.eval_every=0", "--train.seq_len=32",
                           "--peft.method=lora", f"--data.cache_dir={tmp_path / 'cache'}"],
                          env=subprocess_env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    foreign = [line for line in (proc.stdout + proc.stderr).splitlines()
               if "Failed to load" in line or "_pytree" in line or "torchao" in line
               or "Warning" in line]
    assert foreign == []


def test_a_model_whose_loss_has_no_gradient_is_one_line(tmp_path, monkeypatch, capsys):
    """A factory whose forward detaches its output: the first step says so in one line
    (instead of autograd's "element 0 of tensors does not require grad")."""
    from meshfit.cli.main import main

    (tmp_path / "userfacts.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["train", "--nproc", "1", "--out", str(tmp_path / "run"),
                 "--model.factory=userfacts:no_gradient", "--train.steps=1",
                 "--train.eval_every=0", f"--data.cache_dir={tmp_path / 'cache'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("meshfit train: error: the model's loss does not depend on any trainable "
                       "parameter (requires_grad is False): its forward returns values computed "
                       "without gradient (under torch.no_grad, detached, or new tensors); return "
                       "the output of its layers"), err


def test_a_meta_build_skips_initialisation_and_never_imports_dynamo(tmp_path):
    """Before launch, `meshfit train` builds the model on the meta device (sizes, plans):
    `torch.nn.init` does nothing there, so that torch's meta kernels do not import
    torch._dynamo (0.8 s of every start). The structure is the real model's."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from meshfit.train.config import RunConfig as Config\n"
            "from meshfit.train.models import build_model\n"
            "m = build_model(Config(), 256, meta=True)\n"
            "assert all(p.is_meta for p in m.parameters())\n"
            "print(sorted((n, tuple(p.shape)) for n, p in m.named_parameters()))\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out[-1] == "False"
    from meshfit.train.config import RunConfig as Config
    from meshfit.train.models import build_model

    real = build_model(Config(), 256)
    assert out[-2] == str(sorted((n, tuple(p.shape)) for n, p in real.named_parameters()))


ENDERS = '''
import os


def exits(vocab_size=256):
    os._exit(0)


def execs(vocab_size=256):
    os.execv("/bin/true", ["true"])
'''


@pytest.mark.parametrize("factory, call", [("exits", "os._exit(0)"),
                                           ("execs", "os.execv('/bin/true', ...)")])
def test_code_that_ends_the_process_is_refused_not_taken_for_success(factory, call, tmp_path,
                                                                     monkeypatch, cli_refusal):
    """A model factory that ends the process (here while it is built before launch, in the
    launching process) would leave `meshfit train` with exit code 0 having trained nothing:
    it is refused in one line naming the call and the user's line, exit code 2. (The test
    process's own os._exit and os.execv are replaced first, so that a meshfit that let the
    call through fails this test instead of ending pytest with exit code 0.)"""
    import os

    def reached(*args):
        raise AssertionError(f"the process would have ended: {args}")

    monkeypatch.setattr(os, "_exit", reached)
    monkeypatch.setattr(os, "execv", reached)
    (tmp_path / "enders.py").write_text(ENDERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    line = cli_refusal("train", "--out", str(tmp_path / "run"),
                       f"--model.factory=enders:{factory}")
    assert line.startswith(f"meshfit train: error: model.factory='enders:{factory}': building "
                           f"the model raised ProcessEndRefused: {call} at "), line
    assert "would end meshfit train's process before it finished" in line
    assert f"enders.py:{6 if factory == 'exits' else 10}" in line
    assert not (tmp_path / "run").exists()
