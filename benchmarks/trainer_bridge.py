"""The Trainer bridge's cost: an optimizer step of transformers' Trainer on meshfit's
Accelerator (``meshfit.transformers.Trainer``) vs transformers' own Trainer (on Accelerate),
on one process, on the same model, data and arguments.

Both arms are the same script but for the import; each trains a Llama built from a config
(same seed, so the same weights; ``--hidden``, ``--layers``, ``--seq``, ``--batch``) with
AdamW for ``--steps`` steps. A callback reads the clock at each step's begin and end (the
whole step: forward, backward, clipping, optimizer, scheduler, logging bookkeeping; wall clock
and this process's CPU time, which other jobs on a shared machine disturb less); the first
``--warmup`` steps are left out. The arms alternate (A B B A ...) for ``--rounds`` rounds, each
round a fresh Trainer of each, so that drift of a shared machine hits both. Reported: the
median step time of each arm, their ratios (target <= 1.03), the wall clock's with a bootstrap
95% interval of the paired steps' ratio, and
whether the two arms' losses agreed (identical work gives identical losses).

    python benchmarks/trainer_bridge.py            # a few minutes on 2 (shared) cores

Writes benchmarks/results/trainer_bridge.{md,json}.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (bootstrap_ci, machine_info, machine_markdown, median,  # noqa: E402
                     write_results)


def _arm(name: str):
    if name == "meshfit":
        from meshfit.transformers import Trainer, TrainingArguments
    else:
        from transformers import Trainer, TrainingArguments
    return Trainer, TrainingArguments


def _run(arm: str, ns, out: str) -> tuple[list[float], list[float], list[float]]:
    """Step times (s: wall clock, and this process's CPU time, which another job on a shared
    machine disturbs less) after the warm-up, and the logged losses, of one Trainer of
    `arm`."""
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback

    Trainer, TrainingArguments = _arm(arm)
    times: list[float] = []
    cpu: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.began, self.cpu = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.began)
            cpu.append(time.process_time() - self.cpu)

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=ns.vocab, hidden_size=ns.hidden,
                         intermediate_size=4 * ns.hidden, num_hidden_layers=ns.layers,
                         num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=ns.seq)
    model = LlamaForCausalLM(config)
    tokens = torch.randint(0, ns.vocab, (ns.batch * ns.steps, ns.seq),
                           generator=torch.Generator().manual_seed(1))
    rows = [{"input_ids": t, "labels": t} for t in tokens]
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=ns.batch,
                             max_steps=ns.steps, logging_steps=1, report_to="none",
                             use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True,
                             optim="adamw_torch")
    trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[Clock()])
    trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    return times[ns.warmup:], cpu[ns.warmup:], losses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", default="/tmp/meshfit_trainer_bridge")
    ns = p.parse_args()
    times = {"transformers": [], "meshfit": []}
    cpu = {"transformers": [], "meshfit": []}
    losses = {"transformers": [], "meshfit": []}
    for r in range(ns.rounds):
        order = ("transformers", "meshfit") if r % 2 == 0 else ("meshfit", "transformers")
        for arm in order:
            t, c, l_ = _run(arm, ns, f"{ns.out}/{arm}-{r}")
            times[arm] += t
            cpu[arm] += c
            losses[arm].append(l_)
    theirs, ours = median(times["transformers"]), median(times["meshfit"])
    cpu_theirs, cpu_ours = median(cpu["transformers"]), median(cpu["meshfit"])
    ratios = [m / t for m, t in zip(times["meshfit"], times["transformers"])]
    low, high = bootstrap_ci(ratios)
    same = all(a == b for a, b in zip(losses["transformers"], losses["meshfit"]))
    model = f"Llama {ns.layers} layers, hidden {ns.hidden}, seq {ns.seq}, batch {ns.batch}"
    table = (f"# Trainer bridge: step time, 1 process ({model})\n\n"
             "| arm | median step, wall (ms) | median step, CPU time (ms) | steps |\n"
             "|---|---:|---:|---:|\n"
             f"| transformers.Trainer (Accelerate) | {theirs * 1e3:.1f} | "
             f"{cpu_theirs * 1e3:.1f} | {len(times['transformers'])} |\n"
             f"| meshfit.transformers.Trainer | {ours * 1e3:.1f} | {cpu_ours * 1e3:.1f} | "
             f"{len(times['meshfit'])} |\n\n"
             f"Ratio meshfit / transformers, CPU time: **{cpu_ours / cpu_theirs:.3f}**; wall "
             f"clock: **{ours / theirs:.3f}** (median of paired steps "
             f"{median(ratios):.3f}, bootstrap 95% [{low:.3f}, {high:.3f}]; target <= 1.03). "
             f"Losses identical in every round: {same}.\n\n"
             "Command: `python benchmarks/trainer_bridge.py`\n\n"
             + machine_markdown(machine_info()))
    print(table)
    write_results("trainer_bridge", table, {
        "args": vars(ns), "times": times, "cpu_times": cpu, "losses": losses,
        "ratio": ours / theirs, "cpu_ratio": cpu_ours / cpu_theirs, "ci": [low, high],
        "losses_identical": same})


if __name__ == "__main__":
    main()
