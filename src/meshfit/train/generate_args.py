"""`meshfit generate` / `meshfit eval` arguments, parsed and checked without torch, so that
a bad argument is refused at once; `meshfit.train.generate` runs them."""

from __future__ import annotations

import argparse
import math

from meshfit.train.args import OneLineParser


def _check_sampling(max_new_tokens: int, temperature: float, top_k: int | None) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens={max_new_tokens!r} must be an integer >= 0")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature)
            and temperature >= 0):
        raise ValueError(f"--temperature={temperature!r} must be a number >= 0 (0: greedy)")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise ValueError(f"--top-k={top_k!r} must be an integer >= 0 (0: no top-k cut)")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", metavar="RUN_OR_MODEL",
                   help="a meshfit train run folder (uses RUN/model/) or a model folder")
    p.add_argument("--device", default=None,
                   help="cpu, cuda or cuda:N (default: cuda when available, unless MESHFIT_CPU=1)")


def _generate_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="meshfit generate", allow_abbrev=False,
        description="Print a prompt and the model's continuation of it.")
    _common(p)
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200, metavar="N",
                   help="tokens to add at most (default 200; fewer if the model writes EOS)")
    p.add_argument("--temperature", type=float, default=0.8, metavar="T",
                   help="sampling temperature; 0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="sample among the K most likely tokens only; 0 = all (default)")
    p.add_argument("--seed", type=int, default=0, metavar="S",
                   help="the sampling seed: same seed, same text (default 0)")
    return p


def _eval_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="meshfit eval", allow_abbrev=False,
        description="Print the model's loss and perplexity on held-out text: by default the "
                    "validation split of the run's own data (the built-in corpus's for a "
                    "model folder outside a run).")
    _common(p)
    p.add_argument("--data", default=None, metavar="PATH",
                   help="a text file or folder to evaluate on instead, all of it, tokenized "
                        "with the model folder's tokenizer")
    p.add_argument("--seq-len", type=int, default=None, metavar="N",
                   help="window length (default: the run's train.seq_len; for a model folder "
                        "the model's context, at most 1024)")
    p.add_argument("--batches", type=int, default=8, metavar="N",
                   help="batches to evaluate (default 8); 0 = every window of the data")
    p.add_argument("--batch-size", type=int, default=8, metavar="B",
                   help="windows per batch (default 8)")
    return p


def check_generate_args(argv: list[str]) -> argparse.Namespace:
    """`meshfit generate`'s arguments, checked (one-line ValueError or argparse's exit)."""
    ns = _generate_parser().parse_args(argv)
    if not ns.prompt:
        raise ValueError("--prompt='' is empty; give the text to continue, e.g. "
                         "--prompt 'def main('")
    _check_sampling(ns.max_new_tokens, ns.temperature, ns.top_k)
    return ns


def check_eval_args(argv: list[str]) -> argparse.Namespace:
    """`meshfit eval`'s arguments, checked (one-line ValueError or argparse's exit)."""
    ns = _eval_parser().parse_args(argv)
    if ns.seq_len is not None and ns.seq_len < 1:
        raise ValueError(f"--seq-len={ns.seq_len} must be >= 1")
    if ns.batches < 0:
        raise ValueError(f"--batches={ns.batches} must be >= 0 (0: every window)")
    if ns.batch_size < 1:
        raise ValueError(f"--batch-size={ns.batch_size} must be >= 1")
    return ns
