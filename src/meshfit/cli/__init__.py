"""The ``meshfit`` command line: each command's arguments, checked before any process starts
or any file is written, and what it prints; `OneLineParser`, the argument parser they share.
The work itself is in the packages below (`meshfit.train`, `meshfit.launch`, `meshfit.plan`,
...), which never import this one.

    main.py       ``meshfit COMMAND`` (the console script, ``python -m meshfit``): the table
                  of commands, --help, --version, ``meshfit env``, how a command's error ends it
    launch.py     ``meshfit launch``, and ``meshfit train`` in this process or on workers
                  (``--worker``): the launch flags they share
    generate.py   ``meshfit export``, ``generate``, ``eval``, ``plot`` and ``pipeline-chart``
    plan.py       ``meshfit estimate`` and ``plan``
    calibrate.py  ``meshfit calibrate``: its arguments, its workers, its table

No module imports torch when it loads: a bad argument is refused before torch is imported
(tests/cli/test_fast_start.py). Each command imports its work when it runs: torch and what
imports it, and the torch-free modules only that command needs (the config, the layouts, the
charts: 3 to 230 ms each, which `meshfit --help` and every other command would pay if they
loaded with the command's module).
"""

import argparse


class OneLineParser(argparse.ArgumentParser):
    """A command's argument parser (no abbreviated options) whose errors are one line: a
    ValueError that `meshfit` prints as ``meshfit CMD: error: ...`` and exits 2 (argparse
    itself prints the whole usage block first)."""

    def __init__(self, prog: str, description: str):
        super().__init__(prog=prog, description=description, allow_abbrev=False)

    def error(self, message: str):
        raise ValueError(f"{message} (`{self.prog} --help` lists the options)")


def collect_overrides(rest: list[str], options: str, example: str) -> list[str]:
    """Config overrides in the ``--a.b=v`` and ``--a.b v`` forms; anything else is an error
    naming it, the command's `options` and an `example` override (``--train.steps=100``)."""
    out, i = [], 0
    while i < len(rest):
        item = rest[i]
        if not item.startswith("--") or "." not in item.split("=")[0]:
            raise ValueError(f"unknown argument {item!r}; options are {options} and config "
                             f"overrides such as {example}")
        if "=" not in item:
            if i + 1 >= len(rest):
                value = example.split("=", 1)[1]
                raise ValueError(f"override {item!r} needs a value, e.g. {item}={value}")
            item, i = f"{item}={rest[i + 1]}", i + 1
        out.append(item)
        i += 1
    return out
