"""The commands that use what a run wrote: ``meshfit export`` (a checkpoint's model as
safetensors or a Hugging Face folder, offline: `meshfit.checkpoint.export`), ``meshfit
generate`` (sample text from a trained model) and ``meshfit eval`` (its loss and perplexity
on held-out text: `meshfit.generate`), ``meshfit plot`` (runs' metrics drawn:
`meshfit.charts.plot`) and ``meshfit pipeline-chart`` (a pipeline run's schedule as a Gantt
chart with its measured bubble: `meshfit.charts.pipeline`). Their arguments, checked
before torch is imported, and what they print. The modules that do the work load when their
command runs (`meshfit` loads every command's module at start).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from meshfit.cli import OneLineParser


def cmd_export(argv: list[str]) -> int:
    p = OneLineParser("meshfit export", "Write a checkpoint's model as one safetensors file (or "
                      "a Hugging Face folder), offline, in one process, whatever layout and "
                      "number of processes saved it.")
    p.add_argument("source", metavar="CKPT_OR_RUN",
                   help="a checkpoint folder, or a run folder (its newest complete checkpoint)")
    p.add_argument("out", metavar="OUTDIR", help="where model.safetensors (and config.json) go")
    p.add_argument("--to", choices=("safetensors", "hf"), default="safetensors",
                   help="safetensors: model.safetensors; hf: also config.json, for "
                        "transformers' from_pretrained (transformers models only)")
    ns = p.parse_args(argv)
    from meshfit.checkpoint.export import export

    print(f"meshfit export: wrote {export(ns.source, ns.to, ns.out)}")
    return 0


def _parser(prog: str, description: str) -> argparse.ArgumentParser:
    """`meshfit generate`'s or `eval`'s parser, with the arguments they share."""
    p = OneLineParser(prog, description)
    p.add_argument("source", metavar="RUN_OR_MODEL",
                   help="a meshfit train run folder (uses RUN/model/) or a model folder")
    p.add_argument("--device", default=None,
                   help="cpu, cuda or cuda:N (default: cuda when available, unless MESHFIT_CPU=1)")
    p.add_argument("--trust-code", action="store_true",
                   help="run the code the model folder's config.json names (a meshfit factory, "
                        "transformers' remote code): only for a folder whose writer you trust")
    return p


def cmd_generate(argv: list[str]) -> int:
    p = _parser("meshfit generate", "Print a prompt and the model's continuation of it.")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200, metavar="N",
                   help="tokens to add at most (default 200; fewer if the model writes EOS)")
    p.add_argument("--temperature", type=float, default=0.8, metavar="T",
                   help="sampling temperature; 0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="sample among the K most likely tokens only; 0 = all (default)")
    p.add_argument("--seed", type=int, default=0, metavar="S",
                   help="the sampling seed: same seed, same text (default 0)")
    p.add_argument("--chat", action="store_true",
                   help="the prompt is the user's message: put it through the tokenizer's chat "
                        "template and print the assistant's answer")
    ns = p.parse_args(argv)
    from meshfit.train.preflight import check_sampling

    if not ns.prompt:
        raise ValueError("--prompt='' is empty; give the text to continue, e.g. "
                         "--prompt 'def main('")
    check_sampling(ns.max_new_tokens, ns.temperature, ns.top_k)
    from meshfit.generate import generate, load_model  # torch: after the refusals

    model, tokenizer, _, _ = load_model(ns.source, ns.device, trust_code=ns.trust_code)
    text = generate(model, tokenizer, ns.prompt, max_new_tokens=ns.max_new_tokens,
                    temperature=ns.temperature, top_k=ns.top_k, seed=ns.seed, chat=ns.chat)
    print(f"user: {ns.prompt}\nassistant: {text}" if ns.chat else ns.prompt + text)
    return 0


def _eval_args(argv: list[str]) -> argparse.Namespace:
    p = _parser("meshfit eval", "Print the model's loss and perplexity on held-out text: by "
                "default the validation split of the run's own data (the built-in corpus's for "
                "a model folder outside a run).")
    p.add_argument("--data", default=None, metavar="PATH",
                   help="a text file or folder to evaluate on instead, all of it, tokenized "
                        "with the model folder's tokenizer")
    p.add_argument("--seq-len", type=int, default=None, metavar="N",
                   help="window length (default: the run's train.seq_len; for a model folder "
                        "the model's context, at most 1024)")
    p.add_argument("--batches", type=int, default=None, metavar="N",
                   help="batches to evaluate (default: the run's train.eval_windows windows, "
                        "so that a run's model gives the val_loss the run logged; else 8); 0 = "
                        "every window of the data")
    p.add_argument("--batch-size", type=int, default=None, metavar="B",
                   help="windows per batch (default: the run's train.micro_batch_size, else 8)")
    ns = p.parse_args(argv)
    if ns.seq_len is not None and ns.seq_len < 1:
        raise ValueError(f"--seq-len={ns.seq_len} must be >= 1")
    if ns.batches is not None and ns.batches < 0:
        raise ValueError(f"--batches={ns.batches} must be >= 0 (0: every window)")
    if ns.batch_size is not None and ns.batch_size < 1:
        raise ValueError(f"--batch-size={ns.batch_size} must be >= 1")
    return ns


def cmd_eval(argv: list[str]) -> int:
    ns = _eval_args(argv)  # refusals before torch is imported
    from meshfit.generate import context_length, evaluate_loss, load_model, resolve_model

    if ns.data is not None and not Path(ns.data).expanduser().exists():
        raise ValueError(f"--data={ns.data!r} does not exist; give a text file or a folder of "
                         "text files")
    _, run = resolve_model(ns.source)  # fail on a bad folder before loading anything
    cfg = _run_config(run, ns.data)
    model, tokenizer, _, _ = load_model(ns.source, ns.device, trust_code=ns.trust_code)
    seq_len = _seq_len(ns.seq_len, cfg, context_length(model))
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)  # any model's
    if vocab is not None and tokenizer.vocab_size > vocab:
        raise ValueError(f"RUN_OR_MODEL={ns.source!r}: the tokenizer has {tokenizer.vocab_size} "
                         f"ids but the model only {vocab}; save the model with its own tokenizer")
    tokens, where = _held_out(ns.data, cfg, tokenizer)
    rows = getattr(tokens, "seq_len", None)  # fine-tuning examples: rows of the run's length
    if rows is not None and seq_len != rows:
        raise ValueError(f"--seq-len={seq_len}: the run's examples are rows of train.seq_len="
                         f"{rows} tokens; leave --seq-len out")
    if rows is None and tokens.size < seq_len + 1:
        raise ValueError(f"--seq-len={seq_len}: {where} only {tokens.size} tokens, fewer than "
                         "one window of seq_len + 1; lower --seq-len or give more --data")
    # A run's own validation split, by default as the run evaluated it (`RunConfig.eval_windows`).
    run_eval = cfg is not None and ns.data is None
    batch_size = ns.batch_size if ns.batch_size is not None else \
        math.gcd(cfg.eval_windows(), cfg.train.micro_batch_size) if run_eval else 8
    # by default exactly the run's train.eval_windows windows (batched so that they divide)
    batches = ns.batches if ns.batches is not None else \
        -(-cfg.eval_windows() // batch_size) if run_eval else 8
    loss, n = evaluate_loss(model, tokens, seq_len, batches=batches, batch_size=batch_size)
    print(f"loss {loss:.6f} perplexity {math.exp(min(loss, 700.0)):.4f} on {n} tokens")
    return 0


def _run_config(run: Path | None, data: str | None):
    """The run's config (None outside a run); a config that no longer loads is refused
    unless --data makes it unneeded."""
    if run is None:
        return None
    from meshfit.train.configfile import load_config

    try:
        return load_config(run / "config.toml")
    except ValueError as err:
        if data is None:
            raise ValueError(f"{run / 'config.toml'}: {err}; or give --data PATH") from None
    return None


def _seq_len(seq_len: int | None, cfg, context: int | None) -> int:
    """--seq-len, else the run's train.seq_len, else the model's context (at most 1024)."""
    if seq_len is None:
        seq_len = cfg.train.seq_len if cfg is not None else min(context or 1024, 1024)
    if context is not None and seq_len > context:
        raise ValueError(f"--seq-len={seq_len} exceeds the model's context of {context} tokens; "
                         f"use --seq-len {context} or less")
    return seq_len


def _held_out(data: str | None, cfg, tokenizer):
    """The tokens to evaluate on and how an error names them: all of --data; else the run's
    own validation split (its source, tokenizer and fraction); else the built-in corpus's."""
    from meshfit.data import load_tokens
    from meshfit.train import tokens

    if data is not None:
        cache_dir = (cfg.data.cache_dir or None) if cfg is not None else None
        ids = load_tokens(data, tokenizer=tokenizer, cache_dir=cache_dir, val_fraction=0.0).train
        return ids, f"--data={data!r} holds"
    if cfg is not None:
        return tokens.load_tokens(cfg).val, "the validation split holds"
    return load_tokens(tokenizer=tokenizer).val, "the validation split holds"


def cmd_pipeline_chart(argv: list[str]) -> int:
    from meshfit.charts.pipeline import describe, draw

    p = OneLineParser("meshfit pipeline-chart", "Draw a pipeline-parallel run's schedule (one "
                      "row per pp rank) and print its measured bubble beside the theoretical "
                      "one.")
    p.add_argument("run", metavar="RUN", help="the run folder of a `meshfit train` with pp > 1")
    p.add_argument("--out", metavar="PNG", default=None,
                   help="the chart's path (default: RUN/pipeline_chart.png)")
    p.add_argument("--step", metavar="N", type=int, default=None,
                   help="the step to draw (default: the last recorded)")
    ns = p.parse_args(argv)
    png, summary = draw(ns.run, ns.out, step=ns.step)
    for line in describe(summary):
        print(line)
    print(f"chart of step {summary['step']}: {png}")
    return 0


def cmd_plot(argv: list[str]) -> int:
    from meshfit.charts.plot import DPI, FIGSIZE, describe, draw

    p = OneLineParser(
        "meshfit plot", "Draw runs of `meshfit train` from their metrics.jsonl, overlaid and "
        "labelled with their folder names: loss and validation loss, learning rate, "
        "throughput and peak memory against training tokens (step x global batch x seq_len "
        f"from each run's config.toml); a {FIGSIZE[0] * DPI:.0f} x {FIGSIZE[1] * DPI:.0f} PNG "
        '(or .pdf/.svg). Needs matplotlib: pip install "meshfit[chart]".')
    p.add_argument("runs", metavar="RUN", nargs="+", help="run folders (meshfit train --out)")
    p.add_argument("-o", "--out", metavar="FILE", default=None,
                   help="where the plot goes (default: RUN/metrics.png for one run, "
                        "meshfit-plot.png here for several)")
    ns = p.parse_args(argv)
    out, runs = draw(ns.runs, ns.out)
    for run in runs:
        print(describe(run))
    print(f"meshfit plot: wrote {out}")
    return 0
