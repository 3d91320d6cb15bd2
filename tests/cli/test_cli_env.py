"""`meshfit env`, `meshfit --help` and `--version`, in this process."""

from __future__ import annotations

from meshfit.cli.main import COMMANDS, SUMMARIES, main


def test_env_names_the_versions(capsys, monkeypatch):
    import platform

    import torch

    import meshfit

    monkeypatch.setenv("MESHFIT_CPU", "1")
    monkeypatch.setenv("SOME_TOKEN", "secret")  # not one of the variables meshfit reads
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    facts = dict(line.split(":", 1) for line in out.splitlines())
    facts = {k: v.strip() for k, v in facts.items()}
    assert facts["meshfit"].startswith(meshfit.__version__ + " (")
    assert facts["torch"].startswith(torch.__version__ + " (")
    assert facts["python"].startswith(platform.python_version())
    for key in ("torch CUDA build", "cuDNN", "NCCL", "CUDA available", "devices",
                "distributed backends", "transformers", "accelerate", "peft"):
        assert facts[key], key
    assert "gloo yes" in facts["distributed backends"]
    assert facts["devices"].startswith("cpu (")
    for name in ("transformers", "accelerate", "peft"):
        try:
            from importlib.metadata import version
            expected = version(name)
        except Exception:  # noqa: BLE001 - not installed
            expected = "not installed"
        assert facts[name] == expected
    assert "MESHFIT_CPU=1" in facts["environment"] and "secret" not in out


def test_help_lists_every_command_and_version(capsys):
    import meshfit

    assert set(SUMMARIES) == set(COMMANDS)
    assert main(["--help"]) == 0
    out = capsys.readouterr().out.splitlines()
    listed = [line.split()[0] for line in out if line.startswith("  ")]
    assert listed == list(COMMANDS)
    assert all(len(line.split(None, 1)) == 2 for line in out if line.startswith("  "))
    assert main([]) == 0 and capsys.readouterr().out.splitlines() == out
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"meshfit {meshfit.__version__}"
    assert main(["nosuch"]) == 2
    assert "unknown command 'nosuch'" in capsys.readouterr().err
