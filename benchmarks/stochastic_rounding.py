"""The optimizer step's cost of meshfit's layout-independent stochastic rounding of bf16
weights (`meshfit.optim.rounding`) against torchao's own and against round to nearest.

One process, the reference GPT in bf16 (every weight bf16, as a model loaded in bf16 and
trained without fp32 masters). Per optimizer (adamw_8bit, adamw_4bit: torchao's; and
adamw_bf16_states), the optimizer step alone (``opt.step()`` after the same backward), for:

    meshfit sr   `optim.build(name, ...)`: torchao's update on an fp32 copy, then meshfit's
                 rounding with counter-based bits (the default)
    torchao sr   torchao's AdamW8bit / AdamW4bit as torchao builds them
                 (``bf16_stochastic_round=True``: `torch.randint` bits in its compiled step);
                 adamw_bf16_states has no such variant
    nearest      ``bf16_stochastic_round=False`` (round to nearest)

with the steps compiled (the default: torchao's whole step per shape; adamw_bf16_states
compiles its rounding only, once for every shape); ``--eager`` runs them uncompiled, as the
tests do. Median over the measured steps after warm-up (the first steps compile), variants
interleaved in rounds so machine drift hits all of them; one thread. Nothing here asserts.

    python benchmarks/stochastic_rounding.py    # results/stochastic_rounding.{md,json}
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

from meshfit import optim  # noqa: E402

NAMES = ("adamw_8bit", "adamw_4bit", "adamw_bf16_states")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--warmup", type=int, default=3, help="unmeasured steps per variant")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    p.add_argument("--steps-per-round", type=int, default=3)
    p.add_argument("--eager", action="store_true", help="compile=False")
    p.add_argument("--tag", default="", help="suffix of the results files")
    p.add_argument("--no-write", action="store_true", help="print only; write no results files")
    _common.add_model_args(p, d_model=256, n_layer=4, n_head=8, d_ff=1024, seq_len=64,
                           batch_size=4)
    return p.parse_args(argv)


def _optimizer(name: str, variant: str, model, compile: bool):
    kwargs = {"compile": compile}
    if variant == "torchao sr":
        from torchao.optim import AdamW4bit, AdamW8bit

        cls = AdamW8bit if name == "adamw_8bit" else AdamW4bit
        return cls(optim.param_groups(model, 0.1), lr=1e-4, bf16_stochastic_round=True)
    return optim.build(name, model, lr=1e-4, weight_decay=0.1,
                       bf16_stochastic_round=variant == "meshfit sr", **kwargs)


def _variants(name: str, eager: bool) -> list[str]:
    # torchao's own optimizers always compile their step: no eager variant to compare
    return (["meshfit sr", "nearest"] if name == "adamw_bf16_states" or eager
            else ["meshfit sr", "torchao sr", "nearest"])


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    cfg = _common.model_config(args)
    x = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len),
                      generator=torch.Generator().manual_seed(1))
    rows, raw = [], {}
    for name in NAMES:
        runs = {}
        for variant in _variants(name, args.eager):
            model = _common.build_model(cfg, args.seed).to(torch.bfloat16)
            runs[variant] = (model, _optimizer(name, variant, model, not args.eager), [])
        for i in range(args.warmup + args.rounds * args.steps_per_round):
            for variant, (model, opt, times) in runs.items():
                model(x, x).backward()
                t0 = time.perf_counter()
                opt.step()
                seconds = time.perf_counter() - t0
                opt.zero_grad()
                if i >= args.warmup:
                    times.append(seconds)
        base = _common.median(runs["nearest"][2])
        for variant, (_, _, times) in runs.items():
            med = _common.median(times)
            rows.append(f"| {name} | {variant} | {1e3 * med:.2f} | {med / base:.2f} |")
            raw[f"{name} / {variant}"] = times
    params = sum(p.numel() for p in _common.build_model(cfg, args.seed).parameters())
    table = "\n".join([f"Optimizer step of the reference GPT in bf16 ({params / 1e6:.2f}M "
                       f"parameters), one process, one thread, "
                       f"{'eager' if args.eager else 'compiled'}.", "",
                       "| optimizer | rounding | step (ms, median) | vs nearest |",
                       "|---|---|---|---|", *rows])
    print(table)
    if not args.no_write:
        info = _common.machine_info()
        _common.write_results(f"stochastic_rounding{args.tag}",
                              table + "\n\n" + _common.machine_markdown(info),
                              {"machine": info, "args": vars(args), "seconds": raw})


if __name__ == "__main__":
    main()
