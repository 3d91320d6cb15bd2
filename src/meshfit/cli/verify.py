"""``meshfit verify CONFIG [--layouts L ...] [--steps N] [--dtype float64|float32] [--nproc N]
[--json] [--section.key=value ...]``: a `meshfit train` configuration's first steps on one
process and under each layout, compared (`meshfit.verify`). Prints the table (or, with
--json, one JSON object) on stdout, progress and notes on stderr; exit status 0 when every
layout passes, 1 when one fails, 2 for a bad input (one line, before any process starts).
"""

from __future__ import annotations

import os
import sys

from meshfit.cli import OneLineParser, collect_overrides
from meshfit.cli.launch import RANK_VARIABLES


def _parser() -> OneLineParser:
    p = OneLineParser("meshfit verify", "Run a meshfit train configuration for a few steps on "
                      "one process and under each layout on the same global batches (float64 "
                      "by default, dropout off) and compare the losses and the final "
                      "parameters against a stated tolerance. Options --section.key=value "
                      "override the config, as for meshfit train.")
    p.add_argument("config", nargs="?", default=None,
                   help="a TOML run configuration (default: meshfit train's defaults)")
    p.add_argument("--layouts", nargs="+", default=None, metavar="LAYOUT",
                   help="layouts to check, each a [parallel] section as key=value pairs, e.g. "
                        "\"dp_shard=2\" \"tp=2,sequence_parallel=true\" \"pp=2,schedule=1f1b\" "
                        "(default: the configuration's own [parallel])")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps (default 3)")
    p.add_argument("--dtype", default="float64", help="float64 (default) or float32")
    p.add_argument("--nproc", type=int, default=None,
                   help="processes for every layout (default: the product of its axes)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds each layout's run may take (default 900)")
    p.add_argument("--trust-code", action="store_true",
                   help="run the code the config's model folder names (transformers' remote "
                        "code), as --model.trust_code=true: only for a folder whose writer you "
                        "trust")
    return p


def _overrides(rest: list[str]) -> list[str]:
    """``--a.b=v`` and ``--a.b v``; anything else is an error naming it."""
    return collect_overrides(rest, "--layouts, --steps, --dtype, --nproc, --json, --timeout, "
                             "--trust-code",
                             "--train.micro_batch_size=4")


def cmd_verify(argv: list[str]) -> int:
    ns, rest = _parser().parse_known_args(argv)
    overrides = _overrides(rest) + (["--model.trust_code=true"] if ns.trust_code else [])
    if ns.config is None and ns.layouts and "=" not in ns.layouts[-1]:
        ns.config = ns.layouts.pop()  # `--layouts A B run.toml`: the config after the layouts
    if ns.layouts is not None and any(a.startswith("--") for a in ns.layouts):
        bad = next(a for a in ns.layouts if a.startswith("--"))
        raise ValueError(f"--layouts takes layouts such as \"dp_shard=2\", not {bad!r}; put "
                         "options before --layouts or the config overrides after CONFIG")
    found = [n for n in RANK_VARIABLES if n in os.environ]
    if found:
        raise ValueError(f"{', '.join(found)} set in the environment: meshfit verify starts its "
                         f"own processes; unset {' '.join(found)}")
    # (loaded when the command runs, ~0.2 s: `meshfit` loads every command's module at start)
    from meshfit.train.configfile import load_config
    from meshfit.verify.layouts import parse_layout, verify_config

    for text in ns.layouts or ():
        parse_layout(text)  # a malformed layout before the config is read
    cfg = load_config(ns.config, overrides)

    def say(line: str) -> None:
        print(f"meshfit verify: {line}", file=sys.stderr, flush=True)

    # every layout is checked before any process starts (one line, exit 2)
    report = verify_config(cfg, ns.layouts, steps=ns.steps, dtype=ns.dtype, nproc=ns.nproc,
                           timeout_s=ns.timeout, say=say)
    print(report.dumps() if ns.json else report.table(), flush=True)
    return 0 if report.passed else 1
