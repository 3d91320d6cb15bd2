"""Full fine-tuning vs LoRA vs QLoRA of one pretrained model: bytes per rank, measured and
estimated, and step time.

A Llama-shaped folder is written once (random weights, fp32 safetensors; `--hidden`,
`--layers`, ...); each method then loads it through `meta_model` + `Accelerator.prepare`
under each layout (DDP, ZeRO-3), trains `--steps` AdamW steps, and `meshfit.memory.
rank_report` counts the bytes this rank holds in parameters (QLoRA's 4-bit tensors by
their codes and scales), gradients and optimizer state after the last step. Beside each:
`meshfit.memory.estimate` of the same layout with the run's `Adapters` (what `meshfit train`
checks before launch).

    meshfit launch --nproc 2 benchmarks/qlora_memory.py
    meshfit launch --nproc 2 benchmarks/qlora_memory.py --hidden 2048 --layers 4

Nothing here asserts; run on a quiet machine.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

from meshfit import Accelerator, ParallelDims  # noqa: E402
from meshfit.checkpoint.pretrained import meta_model  # noqa: E402
from meshfit.memory import LayoutSpec, ModelShape, estimate, rank_report  # noqa: E402
from meshfit.peft import lora, qlora  # noqa: E402
from meshfit.train.fits import adapters_of  # noqa: E402

METHODS = ("full", "lora", "qlora")
LAYOUTS = {"DDP": ({}, {}), "ZeRO-3": ({"dp_replicate": 1, "dp_shard": -1}, {"zero_stage": 3})}
MIB = 2**20


def write_folder(folder: Path, args) -> None:
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate or int(args.hidden * 2.75),
        num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 256),
        num_hidden_layers=args.layers, vocab_size=args.vocab, max_position_embeddings=1024)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)


def run(method: str, layout: str, folder: Path, args, world: int) -> dict:
    dims, options = LAYOUTS[layout]
    dims = {k: (world if v == -1 else v) for k, v in dims.items()}
    acc = Accelerator(parallel=ParallelDims(**dims), mixed_precision="no", **options)
    torch.manual_seed(1)
    model = meta_model(folder)
    base = ModelShape.from_module(model)
    if method != "full":
        model = (qlora if method == "qlora" else lora)(model, r=args.r, alpha=2 * args.r,
                                                        target_modules="all-linear")
    adapters = adapters_of(model) if method != "full" else None
    model = acc.prepare(model)
    opt = acc.prepare(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                        lr=1e-4))
    g = torch.Generator().manual_seed(acc.process_index)
    x = torch.randint(0, args.vocab, (args.batch_size, args.seq_len + 1), generator=g)
    times, losses = [], []
    for step in range(args.steps):
        t0 = time.perf_counter()
        logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        acc.backward(loss)
        opt.step()
        if step == args.steps - 1:
            report = rank_report(model, opt)
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    spec = LayoutSpec(**{k: v for k, v in dims.items()}, zero_stage=options.get("zero_stage", 0),
                      micro_batch_size=args.batch_size)
    est = estimate(base, spec, seq_len=args.seq_len, dtype="fp32", optimizer="adamw",
                   adapters=adapters)
    out = {"method": method, "layout": layout, "params": base.params,
           "trainable": adapters.trainable if adapters else base.params,
           "quantized": adapters.quantized if adapters else 0,
           "param_bytes": report.param_bytes, "grad_bytes": report.grad_bytes,
           "optimizer_bytes": report.optimizer_bytes,
           "states_bytes": report.param_bytes + report.grad_bytes + report.optimizer_bytes,
           "est_param_bytes": est.params, "est_grad_bytes": est.grads,
           "est_optimizer_bytes": est.optimizer,
           "est_states_bytes": est.params + est.grads + est.optimizer,
           "step_s": statistics.median(times[1:] or times), "losses": losses}
    del model, opt
    gc.collect()
    dist.barrier()
    return out


def markdown(rows: list[dict], args, info: dict, world: int) -> str:
    lines = [f"# QLoRA vs LoRA vs full fine-tuning: model states per rank ({world} ranks)", "",
             f"Llama-shaped folder: hidden {args.hidden}, {args.layers} layers, vocab "
             f"{args.vocab}; {rows[0]['params']:,} parameters; LoRA r={args.r} on every block "
             f"linear; fp32, AdamW; micro-batch {args.batch_size} x {args.seq_len} tokens.", "",
             "| layout | method | trainable | in 4 bits | params MiB | grads MiB | optim MiB "
             "| states MiB (measured) | states MiB (estimate) | est/meas | s/step |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['layout']} | {r['method']} | {r['trainable']:,} | {r['quantized']:,} | "
            f"{r['param_bytes'] / MIB:.1f} | {r['grad_bytes'] / MIB:.1f} | "
            f"{r['optimizer_bytes'] / MIB:.1f} | {r['states_bytes'] / MIB:.1f} | "
            f"{r['est_states_bytes'] / MIB:.1f} | "
            f"{r['est_states_bytes'] / r['states_bytes']:.3f} | {r['step_s']:.3f} |")
    lines += ["", _common.machine_markdown(info)]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=0, help="default: 2.75 x hidden")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--r", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--folder", default="", help="where to write the model (default: a "
                   "folder under /tmp)")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    probe = Accelerator()
    world, main_rank = probe.num_processes, probe.is_main_process
    folder = Path(args.folder or f"/tmp/meshfit-qlora-bench-{args.hidden}x{args.layers}")
    if main_rank and not (folder / "config.json").exists():
        write_folder(folder, args)
    probe.wait_for_everyone()
    info = _common.machine_info(probe)
    rows = []
    for layout in LAYOUTS:
        for method in METHODS:
            r = run(method, layout, folder, args, world)
            rows.append(r)
            if main_rank:
                print(f"{layout:7} {method:6} states {r['states_bytes'] / MIB:9.1f} MiB/rank "
                      f"(estimate {r['est_states_bytes'] / MIB:9.1f})  step {r['step_s']:.3f} s"
                      f"  loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}", flush=True)
    info["loadavg_at_end"] = list(os.getloadavg())
    if main_rank:
        md = markdown(rows, args, info, world)
        print(md)
        if not args.no_write:
            paths = _common.write_results(f"qlora_memory_{world}ranks", md,
                                          {"args": vars(args), "rows": rows, "machine": info})
            print(f"wrote {', '.join(str(p) for p in paths)}")


if __name__ == "__main__":
    main()
