"""`meshfit train --print-config`: every key of every section, its value and one line of
meaning, generated from the config classes (`meshfit.train.configdoc`); the output is a TOML
config that reads back as the config it printed. Nothing is started or written."""

from __future__ import annotations

import re
from dataclasses import fields

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from meshfit.train.config import RunConfig, config_fields, toml_name
from meshfit.train.configfile import build_config, load_config

OVERRIDES = ["--train.steps=30", "--train.micro_batch_size=4", "--model.n_layer=3",
             "--optim.betas=[0.9, 0.99]", '--log.with=["csv"]']


def _printed(argv: list[str], capsys, tmp_path) -> str:
    from meshfit.cli.main import main

    capsys.readouterr()
    assert main(["train", "--print-config", *argv]) == 0
    out = capsys.readouterr()
    assert out.err == "" and list(tmp_path.iterdir()) == []  # nothing written, nothing said
    return out.out


@pytest.mark.parametrize("argv", [[], OVERRIDES], ids=["defaults", "overrides"])
def test_print_config_lists_every_key_with_its_value_and_meaning(argv, capsys, tmp_path,
                                                                  monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = _printed(argv, capsys, tmp_path)
    expected = load_config(None, argv)
    assert build_config(tomllib.loads(text)) == expected  # the printed values are the config
    sections = re.split(r"^\[(\w+)\]$", text, flags=re.M)[1:]
    printed = dict(zip(sections[::2], sections[1::2]))
    assert list(printed) == [s.name for s in fields(RunConfig)]
    for section in fields(RunConfig):
        values = getattr(expected, section.name)
        for f in config_fields(values):
            key = re.escape(toml_name(f))
            line = re.search(rf"^(# )?{key} = .*$", printed[section.name], flags=re.M)
            assert line, f"[{section.name}] {toml_name(f)} is not printed"
            meaning = line.group(0).split(" # ", 1)[1:] or [""]
            assert len(meaning[0].strip()) > 5, f"[{section.name}] {toml_name(f)} has no meaning"
    if argv:  # a changed value names its default
        assert re.search(r"^steps = 30 +# Optimizer steps \(default: 400\)$", text, flags=re.M)
        assert re.search(r"^warmup_steps = 3 +# .*a tenth of train\.steps", text, flags=re.M)
    assert re.search(r"^# n_layer = \(unset\)" if not argv else r"^n_layer = 3 ", text,
                     flags=re.M)
