"""Training throughput and MFU of `meshfit train` itself, on one device.

For each model (``--models``: gpt2, llama-1b; tiny for a CPU smoke run) and micro-batch
(``--micro``), runs ``meshfit train --nproc 1`` on the built-in corpus with the fast path
(bf16 autocast, TF32, ``torch.compile`` per block, fused AdamW; the chunked cross-entropy
switches itself on for these vocabularies) and reads its ``metrics.jsonl``: tokens/s, MFU
(PaLM's 6N + 12·L·d·T per token over the device's data-sheet peak, as the run reports it),
peak memory and the share of each step spent waiting for data; medians over the logged
steps after the first (which holds the compilation). The models keep their published
vocabularies (`throughput_models.py`), the byte tokenizer's ids being a subset.

Then, for the best configuration, a step-time breakdown (forward, backward, optimizer;
CUDA events, or the clock on a CPU) measured in this process with the same model, precision,
compilation and optimizer through `meshfit.Accelerator` — the breakdown only: the headline
figures are the runs' own — and a profiler trace of three steps
(``results/throughput_trace.json.gz``, open it in Perfetto or chrome://tracing).

``--loss-check STEPS`` also trains GPT-2 for STEPS steps in fp32 (no compile, foreach AdamW)
and with the fast path on the same data order, and reports both validation losses.

    python benchmarks/throughput.py                               # a GPU: gpt2 + llama-1b
    python benchmarks/throughput.py --models tiny --micro 2 --seq-len 64 --steps 6   # CPU
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _common  # noqa: E402
import torch  # noqa: E402

FACTORIES = {"gpt2": "gpt2", "llama-1b": "llama_1b", "tiny": "tiny"}
FAST = ["--train.mixed_precision=bf16", "--train.tf32=true", "--train.compile=true",
        "--optim.optimizer=adamw_fused"]
PLAIN = ["--train.mixed_precision=no", "--train.tf32=false", "--train.compile=false",
         "--optim.optimizer=adamw"]


def train_run(out: Path, model: str, micro: int, seq_len: int, steps: int, log_every: int,
              flags: list[str], *, eval_batches: int = 1) -> dict:
    """One `meshfit train` run; its logged training lines and final validation loss."""
    if out.exists():
        shutil.rmtree(out)
    cmd = [sys.executable, "-m", "meshfit", "train", "--nproc", "1", "--out",
           str(out), f"--model.factory=throughput_models:{FACTORIES[model]}",
           f"--train.steps={steps}", f"--train.global_batch_size={micro}",
           f"--train.micro_batch_size={micro}", f"--train.seq_len={seq_len}",
           f"--train.log_every={log_every}", "--train.eval_every=0",
           f"--train.eval_batches={eval_batches}", f"--train.warmup_steps={min(20, steps)}",
           *flags]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(HERE), str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")])}
    began = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - began
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        return {"error": f"exit {proc.returncode}: " + " | ".join(tail), "wall_s": wall}
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    train = [r for r in lines if "loss" in r and "tokens_per_s" in r]
    val = [r["val_loss"] for r in lines if "val_loss" in r]
    measured = train[1:] or train  # the first logged window holds the compilation
    pick = lambda key: [r[key] for r in measured if r.get(key) is not None]  # noqa: E731
    med = lambda key: statistics.median(pick(key)) if pick(key) else None  # noqa: E731
    return {"cmd": " ".join(cmd[1:]), "wall_s": round(wall, 1), "logged": len(train),
            "tokens_per_s": med("tokens_per_s"), "mfu": med("mfu"),
            "step_time_s": med("step_time_s"), "data_wait_share": med("data_wait_share"),
            "peak_memory_gib": max(pick("peak_memory_bytes") or [0]) / 2**30,
            "final_loss": train[-1]["loss"] if train else None,
            "val_loss": val[-1] if val else None}


def breakdown(model: str, micro: int, seq_len: int, steps: int, trace: Path | None) -> dict:
    """Median forward / backward / optimizer seconds of a step, fast path, this process."""
    import throughput_models

    from meshfit import Accelerator
    from meshfit import optim as moptim

    acc = Accelerator(mixed_precision="bf16", tf32=True, compile=True)
    torch.manual_seed(0)
    net = getattr(throughput_models, FACTORIES[model])(seq_len)
    opt = moptim.build("adamw_fused", net, lr=1e-4, weight_decay=0.1)
    net, opt = acc.prepare(net, opt)
    vocab = 256  # the byte tokenizer's ids
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, vocab, (micro, seq_len + 1), generator=gen).to(acc.device)
               for _ in range(4)]
    cuda = acc.device.type == "cuda"

    def mark():
        if cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def span(a, b) -> float:
        return a.elapsed_time(b) / 1e3 if cuda else b - a

    parts: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}

    def step(i: int, record: bool) -> None:
        x = batches[i % len(batches)]
        t0 = mark()
        loss = net(x[:, :-1], x[:, 1:])
        t1 = mark()
        acc.backward(loss)
        t2 = mark()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = mark()
        if cuda:
            torch.cuda.synchronize()
        if record:
            for name, a, b in (("forward", t0, t1), ("backward", t1, t2),
                               ("optimizer", t2, t3)):
                parts[name].append(span(a, b))

    for i in range(3):  # compilation and allocator warm-up
        step(i, False)
    for i in range(steps):
        step(i, True)
    out = {k: statistics.median(v) for k, v in parts.items()}
    if trace is not None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            for i in range(3):
                step(i, False)
        prof.export_chrome_trace(str(trace))
        key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        out["top_ops"] = prof.key_averages().table(sort_by=key, row_limit=12)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2,llama-1b", help="comma-separated: "
                    + ", ".join(FACTORIES))
    ap.add_argument("--micro", default="8,16", help="micro-batch sizes (sequences)")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--breakdown-steps", type=int, default=5,
                    help="measured steps of the breakdown (0: no breakdown nor trace)")
    ap.add_argument("--loss-check", type=int, default=0, metavar="STEPS",
                    help="also train GPT-2 STEPS steps fp32 vs fast path, same data")
    ap.add_argument("--float8", action="store_true",
                    help="also run each model's best micro-batch with [train] float8 = true")
    ap.add_argument("--runs", default="runs/throughput", help="where the runs go")
    ap.add_argument("--name", default=None, help="results name (default: throughput_<device>)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in models:
        if m not in FACTORIES:
            ap.error(f"--models: {m!r} is not one of {', '.join(FACTORIES)}")
    micros = [int(x) for x in args.micro.split(",")]
    runs = Path(args.runs)
    info = _common.machine_info()
    cuda = torch.cuda.is_available()
    info["device"] = torch.cuda.get_device_name(0) if cuda else "cpu"
    results = []
    for model in models:
        for micro in micros:
            r = train_run(runs / f"{model}-b{micro}", model, micro, args.seq_len, args.steps,
                          args.log_every, FAST)
            r.update(model=model, micro=micro, seq_len=args.seq_len)
            results.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "cmd"}), flush=True)
    ok = [r for r in results if "error" not in r and r.get("tokens_per_s")]
    best = {}
    for r in ok:  # per model: the micro-batch with the highest MFU (tokens/s without a peak)
        score = r["mfu"] if r["mfu"] is not None else r["tokens_per_s"]
        if r["model"] not in best or score > best[r["model"]][0]:
            best[r["model"]] = (score, r)
    if args.float8:  # the same run with float8 linears: tokens/s and loss beside bf16
        for model, (_, r) in list(best.items()):
            f8 = train_run(runs / f"{model}-b{r['micro']}-float8", model, r["micro"],
                           args.seq_len, args.steps, args.log_every,
                           FAST + ["--train.float8=true"])
            f8.update(model=model + "+float8", micro=r["micro"], seq_len=args.seq_len)
            if f8.get("tokens_per_s"):
                f8["speedup_vs_bf16"] = f8["tokens_per_s"] / r["tokens_per_s"]
            results.append(f8)
            print(json.dumps({k: v for k, v in f8.items() if k != "cmd"}), flush=True)
    breakdowns = {}
    if args.breakdown_steps > 0:
        for model, (_, r) in best.items():
            trace = runs / f"throughput_trace_{model}.json.gz"
            runs.mkdir(parents=True, exist_ok=True)
            try:
                breakdowns[model] = breakdown(model, r["micro"], args.seq_len,
                                              args.breakdown_steps, trace)
                breakdowns[model]["trace"] = str(trace)
            except Exception as err:  # report and go on: the headline figures stand
                breakdowns[model] = {"error": f"{type(err).__name__}: {err}"}
            print(json.dumps({k: v for k, v in breakdowns[model].items()
                              if k != "top_ops"}), flush=True)
    loss_check = None
    if args.loss_check:
        micro = best.get("gpt2", (0, {"micro": micros[0]}))[1]["micro"]
        plain = train_run(runs / "loss-fp32", "gpt2", micro, args.seq_len, args.loss_check,
                          max(1, args.loss_check // 10), PLAIN, eval_batches=8)
        fast = train_run(runs / "loss-fast", "gpt2", micro, args.seq_len, args.loss_check,
                         max(1, args.loss_check // 10), FAST, eval_batches=8)
        loss_check = {"steps": args.loss_check, "micro": micro,
                      "fp32_val_loss": plain.get("val_loss"),
                      "fast_val_loss": fast.get("val_loss"),
                      "fp32_error": plain.get("error"), "fast_error": fast.get("error")}
        print(json.dumps(loss_check), flush=True)
    info["loadavg_at_end"] = list(os.getloadavg())

    md = ["# Throughput of `meshfit train` on one device", "",
          f"Command: `{_common.launch_command()}`", "", _common.machine_markdown(info), "",
          f"Fast path: {' '.join(FAST)}; seq_len {args.seq_len}; {args.steps} steps, "
          f"medians over the logged windows after the first (log every {args.log_every}).",
          "", "| model | micro-batch | tokens/s | MFU | step (s) | data wait | peak memory "
          "(GiB) | loss |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if "error" in r:
            md.append(f"| {r['model']} | {r['micro']} | failed: {r['error'][:120]} |||||| ")
            continue
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        md.append(f"| {r['model']} | {r['micro']} | {r['tokens_per_s']:.0f} | {mfu} | "
                  f"{r['step_time_s']:.3f} | {100 * (r['data_wait_share'] or 0):.1f}% | "
                  f"{r['peak_memory_gib']:.2f} | {r['final_loss']:.3f} |")
    for r in results:
        if r.get("speedup_vs_bf16"):
            md.append(f"\n{r['model']}: {r['speedup_vs_bf16']:.3f}x the tokens/s of bf16 at "
                      f"micro-batch {r['micro']} (its MFU counts float8 products at the bf16 "
                      "peak)")
    for model, b in breakdowns.items():
        md += ["", f"## Step breakdown, {model} (micro-batch {best[model][1]['micro']})", ""]
        if "error" in b:
            md.append(f"failed: {b['error']}")
            continue
        total = b["forward"] + b["backward"] + b["optimizer"]
        for name in ("forward", "backward", "optimizer"):
            md.append(f"- {name}: {1e3 * b[name]:.1f} ms ({100 * b[name] / total:.0f}%)")
        md += ["", f"Trace: `{b['trace']}`", "", "```", b.get("top_ops", ""), "```"]
    if loss_check:
        md += ["", "## Loss check (GPT-2)", "", json.dumps(loss_check)]
    text = "\n".join(md) + "\n"
    print(text)
    if not args.no_write:
        name = args.name or ("throughput_cuda" if cuda else "throughput_cpu")
        payload = {"machine": info, "results": results, "loss_check": loss_check,
                   "breakdown": {m: {k: v for k, v in b.items() if k != "top_ops"}
                                 for m, b in breakdowns.items()}}
        for path in _common.write_results(name, text, payload):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
