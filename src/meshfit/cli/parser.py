"""The `meshfit` commands' argument parser: argparse whose errors are one line."""

from __future__ import annotations

import argparse

__all__ = ["OneLineParser"]


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line: a ValueError that `meshfit` prints as
    ``meshfit CMD: error: ...`` and exits 2 (argparse itself prints the whole usage block
    first)."""

    def error(self, message: str):
        raise ValueError(f"{message} (`{self.prog} --help` lists the options)")
