"""The general tensor-parallel plan (read from transformers' own plan) against the
hand-written Llama plan it replaced: step time of the same Llama model, tp=2 on 2 CPU ranks.

The hand-written plan is kept here, as it was in `meshfit.models.plans.hf` before the general
path (`meshfit.models.plans.transformers_tp`) replaced it. Both plans run the same module
splits; they differ in how the inputs of attention and MLP are gathered under sequence
parallel (torch's PrepareModuleInput with the calling convention fixed by hand, against
meshfit's GatherInput, which finds the hidden-state input at each call), which is what this
measures. Each step: forward, float64-free cross-entropy (`tp_cross_entropy`), backward,
AdamW(fused) step, zero_grad; the slowest rank's time; the two plans alternate in rounds
(order rotated), median over the measured steps after warm-up. Also checked: both plans give
the same losses (bit for bit: the same collective calls in the same order). Nothing asserts on
time; the ratio general / hand-written is printed and saved (target <= 1.02).

    python benchmarks/tp_plan_speed.py            # results/tp_plan_speed.{md,json}
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

from meshfit.models.plans import (REPLICATE, SHARD_LAST, TPPlan, colwise,  # noqa: E402
                                  prepare_input, replicate, rowwise, sequence)

SHARD_SEQ = "shard(1)"


def hand_written_llama_plan(model, *, sequence_parallel=False, loss_parallel=False) -> TPPlan:
    """meshfit's hand-written `hf_llama_plan` (Llama, Qwen2, Mistral) before the general path."""
    sp = sequence_parallel
    seq = SHARD_SEQ if sp else REPLICATE
    styles = {"model.embed_tokens": rowwise(input=REPLICATE, output=seq, local_output=not sp)}
    layer = "model.layers.*"
    for norm in ("input_layernorm", "post_attention_layernorm"):
        styles[f"{layer}.{norm}"] = sequence() if sp else replicate()
    if sp:
        styles[f"{layer}.self_attn"] = prepare_input(input_kwargs={"hidden_states": SHARD_SEQ},
                                                     desired_kwargs={"hidden_states": REPLICATE})
        styles[f"{layer}.mlp"] = prepare_input(input=(SHARD_SEQ,), desired=(REPLICATE,))
    linears = {f"self_attn.{n}": colwise() for n in ("q_proj", "k_proj", "v_proj")}
    linears |= {"self_attn.o_proj": rowwise(), "mlp.gate_proj": colwise(),
                "mlp.up_proj": colwise(), "mlp.down_proj": rowwise()}
    for name, style in linears.items():
        if style.kind == "rowwise" and sp:
            style = dataclasses.replace(style, output=SHARD_SEQ, local_output=False)
        styles[f"{layer}.{name}"] = style
    styles["model.norm"] = sequence() if sp else replicate()
    styles["lm_head"] = colwise(input=seq, output=SHARD_LAST if loss_parallel else REPLICATE,
                                local_output=not loss_parallel)
    cfg = model.config
    return TPPlan(styles=styles, labels_kwarg="labels",
                  local_attrs={"model.layers.*.self_attn": ("num_heads", "num_key_value_heads")},
                  divisible=(("LlamaConfig.num_attention_heads", cfg.num_attention_heads, "heads"),
                             ("LlamaConfig.vocab_size", cfg.vocab_size, "vocab")))


def _model(args):
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.hidden * 3, num_hidden_layers=args.layers,
        num_attention_heads=8, num_key_value_heads=4, vocab_size=512, max_position_embeddings=512,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _worker(rank, world_size, args):
    from torch.distributed.device_mesh import init_device_mesh

    from meshfit.models.plans import transformers_tp_plan
    from meshfit.parallel.tp import apply_tp, tp_cross_entropy

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 512, (args.batch, args.seq + 1), generator=g)
    x, y = x[:, :-1], x[:, 1:]
    arms = {}
    for name, build in (("general", transformers_tp_plan), ("hand-written", hand_written_llama_plan)):
        model = _model(args)
        plan = build(model, sequence_parallel=args.sp, loss_parallel=args.sp)
        apply_tp(model, mesh, plan=plan, sequence_parallel=args.sp, loss_parallel=args.sp)
        arms[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True))
    times = {n: [] for n in arms}
    losses = {n: [] for n in arms}
    for r in range(args.warmup + args.steps):
        order = list(arms) if r % 2 == 0 else list(arms)[::-1]
        for name in order:
            model, opt = arms[name]
            torch.distributed.barrier()
            t0 = time.perf_counter()
            loss = tp_cross_entropy(model(input_ids=x, use_cache=False).logits, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            dt = time.perf_counter() - t0
            slowest = torch.tensor([dt])
            torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)
            if r >= args.warmup:
                times[name].append(slowest.item())
            losses[name].append(loss.item())
    return dict(times=times, losses=losses,
                params=sum(p.numel() for p in _model(args).parameters()))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=96)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--no-sp", dest="sp", action="store_false",
                   help="plain tp (default: sequence and loss parallel on)")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    from meshfit.distributed.spawn import spawn

    torch.set_num_threads(1)  # what each rank runs with (recorded by machine_info)
    res = spawn(_worker, 2, args, timeout=1800, cpu=True)[0]
    med = {n: _common.median(t) for n, t in res["times"].items()}
    ratio = med["general"] / med["hand-written"]
    same = res["losses"]["general"] == res["losses"]["hand-written"]
    lines = [f"# tp plan speed: general vs hand-written Llama plan (tp=2, 2 CPU ranks, "
             f"sequence+loss parallel: {args.sp})", "",
             f"Llama, {res['params']:,} parameters, hidden {args.hidden}, {args.layers} layers, "
             f"batch {args.batch} x {args.seq} tokens; median of {args.steps} steps after "
             f"{args.warmup} warm-up, slowest rank, arms alternated.", "",
             "| plan | median step (ms) |", "|---|---|",
             *[f"| {n} | {v * 1e3:.2f} |" for n, v in med.items()], "",
             f"ratio general / hand-written: **{ratio:.3f}** (target <= 1.02); identical "
             f"losses: {same}", "", _common.machine_markdown(_common.machine_info())]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        _common.write_results("tp_plan_speed", text, dict(
            args=vars(args), median_s=med, ratio=ratio, identical_losses=same, **res,
            machine=_common.machine_info()))


if __name__ == "__main__":
    main()
