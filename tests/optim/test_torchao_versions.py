"""Which torchao goes with which torch (`meshfit._torchao`), and the one line meshfit gives
for a torchao that does not import with the installed torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from meshfit import _torchao


@pytest.mark.parametrize("version, want", [
    ("2.6.0", "0.12.0"), ("2.7.1", "0.12.0"), ("2.8.0+cu128", "0.13.0"), ("2.9.0", "0.14.1"),
    ("2.9.1+cu128", "0.15.0"), ("2.10.0", "0.16.0"), ("2.11.0", None), ("2.13.0+cpu", None),
    ("2.15.0", None), ("2.9", "0.14.1")])
def test_torchao_for(version, want):
    assert _torchao.torchao_for(version) == want


def test_script_form_prints_the_release():
    # scripts/torch-suite runs the file before meshfit is installed
    run = lambda v: subprocess.run([sys.executable, _torchao.__file__, v], capture_output=True,
                                   text=True, check=True).stdout.strip()
    assert run("2.9.1+cu128") == "0.15.0"
    assert run("2.13.0") == ""


def test_torchao_error_is_one_line(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.9.1+cu128")
    err = _torchao.torchao_error("float8=True", ImportError(
        "cannot import name 'ScalingType' from 'torch.nn.functional'\nmore"))
    msg = str(err)
    assert "\n" not in msg
    assert msg.startswith("float8=True: torchao ")
    assert "torch 2.9.1+cu128" in msg and "ScalingType" in msg
    assert msg.endswith("pip install torchao==0.15.0 (the release built for torch 2.9.1)")
