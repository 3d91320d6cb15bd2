"""Every CUDA path of `meshfit train` run once, each beside the same run on the CPU.

Short fp32 runs (TF32 off, no compile) of the tiny presets: the plain run, activation
checkpointing, the MoE preset (on CUDA its experts go through
``torch._grouped_mm`` where it works, a loop of matmuls on the CPU), an asynchronous
checkpoint at step 10 resumed to the end, chat fine-tuning of a small Llama folder with
packed examples (a boolean attention mask) and LoRA, and ``meshfit generate`` (greedy, KV cache) of each
device's model. In-process: ZeRO-3 with CPU offload (meshfit's `apply_fsdp` on a one-rank
NCCL group: `meshfit train` shards over two or more ranks, which one GPU cannot hold) against
the same model unsharded, the MoE block's grouped-GEMM path against its per-expert loop, and
the chunked cross-entropy against the plain one, on CUDA in fp32 and bf16.

Each run's final training loss and val_loss on CUDA and CPU are printed with their relative
difference (fp32 on both; the summation orders of cuBLAS and the CPU kernels differ, which
AdamW amplifies over 60 steps to about 1e-4 relative). The CPU runs go in parallel with the
CUDA ones (2 threads each). Results: ``benchmarks/results/cuda_paths.{md,json}``.

    python benchmarks/cuda_paths.py        # on a CUDA machine, about 2-3 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _common  # noqa: E402
import torch  # noqa: E402

BASE = ["--nproc", "1", "--model.preset=tiny", "--train.steps=60", "--train.log_every=10",
        "--train.eval_every=0", "--train.eval_batches=2", "--train.seed=0",
        "--train.mixed_precision=no", "--train.tf32=false", "--train.compile=false",
        "--optim.optimizer=adamw", "--train.warmup_steps=5"]
VARIANTS = {
    "plain": [],
    "activation_checkpointing": ["--train.activation_checkpointing=full"],
    "moe": ["--model.preset=moe-tiny"],
    "async_checkpoint": ["--checkpoint.every=10", "--checkpoint.async=true"],
    "async_checkpoint_process": ["--checkpoint.every=10", "--checkpoint.async=true",
                                 "--checkpoint.async_mode=process"],
    # fine-tuning: a Llama folder, chat data packed with per-example attention masks (a
    # boolean SDPA mask on CUDA), LoRA adapters (examples/chat_data.py writes the data)
    "chat_packed_lora": ["--model.hf_model={chat}/model", "--data.tokenizer={chat}/tokenizer",
                         "--data.format=chat", "--data.hf_dataset={chat}/chats.jsonl",
                         "--data.packing=true", "--train.seq_len=256",
                         "--peft.method=lora", "--peft.r=16", "--optim.lr=1e-2"],
}
CHAT_DATA = Path("runs/chat-data")  # set in main() under --runs


SMOKE = False


def _env(cpu: bool) -> dict:
    cpu = cpu or SMOKE
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "2"}
    if cpu:
        env["MESHFIT_CPU"] = "1"
        env["CUDA_VISIBLE_DEVICES"] = ""
    else:
        env.pop("MESHFIT_CPU", None)
    return env


def start(out: Path, flags: list[str], cpu: bool, resume: bool = False) -> subprocess.Popen:
    if out.exists() and not resume:
        shutil.rmtree(out)
    cmd = [sys.executable, "-m", "meshfit", "train", "--out", str(out)]
    flags = [f.format(chat=CHAT_DATA) for f in flags]
    base = [b for b in BASE if not (b.startswith("--model.preset") and any(
        f.startswith("--model.hf_model") for f in flags))]  # one model source
    cmd += ["--resume"] if resume else [*base, *flags]
    return subprocess.Popen(cmd, env=_env(cpu), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, out: Path) -> dict:
    text, _ = proc.communicate(timeout=600)
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}: "
                + " | ".join(text.strip().splitlines()[-4:])}
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    train = [r for r in lines if "loss" in r and "step" in r and "val_loss" not in r]
    val = [r["val_loss"] for r in lines if "val_loss" in r]
    return {"loss": train[-1]["loss"] if train else None, "val_loss": val[-1] if val else None,
            "steps": train[-1]["step"] if train else None}


def generate(run: Path, cpu: bool) -> str:
    cmd = [sys.executable, "-m", "meshfit", "generate", str(run), "--prompt", "The ",
           "--max-new-tokens", "24", "--temperature", "0", "--device", "cpu" if cpu or SMOKE else "cuda"]
    proc = subprocess.run(cmd, env=_env(cpu), capture_output=True, text=True, timeout=300)
    return proc.stdout.strip() if proc.returncode == 0 else f"error: {proc.stderr[-300:]}"


def zero3_offload() -> dict:
    """ZeRO-3 + CPU offload (FSDP2 with CPUOffloadPolicy through `apply_fsdp`) on CUDA, on a
    one-rank NCCL group, against the plain model: 5 AdamW steps, losses side by side."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from meshfit.models import GPT, GPTConfig
    from meshfit.parallel.fsdp import apply_fsdp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        torch.manual_seed(0)
        plain = GPT(GPTConfig.preset("tiny", vocab_size=256))
        sharded = copy.deepcopy(plain)
        plain = plain.cuda()
        mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("dp_shard",))
        apply_fsdp(sharded, mesh, reshard_after_forward=True, offload=True)
        where = {p.device.type for p in sharded.parameters()}
        x = torch.randint(0, 256, (8, 65), device="cuda")
        losses = {}
        for name, model in (("plain", plain), ("zero3_offload", sharded)):
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            trace = []
            for _ in range(5):
                loss = model(x[:, :-1], x[:, 1:])
                loss.backward()
                opt.step()
                opt.zero_grad()
                trace.append(loss.item())
            losses[name] = trace
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses["zero3_offload"], losses["plain"]))
        return {"losses": losses, "max_rel_diff": rel, "sharded_params_on": sorted(where)}
    finally:
        dist.destroy_process_group()


def moe_paths() -> dict:
    """The MoE block on CUDA: grouped GEMM against the per-expert loop, fp32 and bf16."""
    from meshfit.models import GPT, GPTConfig

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = GPT(GPTConfig.preset("moe-tiny", vocab_size=256)).cuda().to(dtype)
        x = torch.randint(0, 256, (4, 64), device="cuda")
        results = []
        try:
            for grouped in (True, False):
                for m in model.moe_layers().values():
                    m.experts.use_grouped_mm = grouped  # the switch lives on the Experts
                model.zero_grad()
                loss = model(x[:, :-1], x[:, 1:])
                loss.backward()
                grads = torch.cat([p.grad.flatten().float() for p in model.parameters()
                                   if p.grad is not None])
                results.append((loss.float().item(), grads))
        except Exception as err:  # e.g. a dtype the grouped kernel does not take
            out[str(dtype).replace("torch.", "")] = {"error": f"{type(err).__name__}: {err}"}
            continue
        (l1, g1), (l2, g2) = results
        out[str(dtype).replace("torch.", "")] = {
            "grouped_loss": l1, "loop_loss": l2,
            "grad_max_rel": ((g1 - g2).abs().max() / g2.abs().max()).item(),
            "grouped_mm_available": hasattr(torch, "_grouped_mm")}
    return out


def chunked_loss() -> dict:
    """GPT's chunked cross-entropy ("on") against logits + cross-entropy ("off") on CUDA."""
    from meshfit.models import GPT, GPTConfig

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = GPT(GPTConfig.preset("tiny", vocab_size=50304)).cuda()
        x = torch.randint(0, 50304, (4, 129), device="cuda")
        results = []
        for mode in ("on", "off"):
            model.fused_loss = mode
            model.zero_grad()
            with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
                loss = model(x[:, :-1], x[:, 1:])
            loss.backward()
            grads = torch.cat([p.grad.flatten() for p in model.parameters()])
            torch.cuda.synchronize()
            results.append((loss.item(), grads, torch.cuda.max_memory_allocated()))
        (l1, g1, _), (l2, g2, _) = results
        out[str(dtype).replace("torch.", "")] = {
            "chunked_loss": l1, "plain_loss": l2,
            "grad_max_rel": ((g1 - g2).abs().max() / g2.abs().max()).item()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="runs/cuda_paths")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--smoke", action="store_true",
                    help="no GPU: both arms on the CPU, no in-process checks (the script's test)")
    args = ap.parse_args()
    global SMOKE
    SMOKE = args.smoke
    runs = Path(args.runs)
    began = time.perf_counter()
    info = _common.machine_info()
    info["device"] = "cpu (smoke)" if SMOKE else torch.cuda.get_device_name(0)
    global CHAT_DATA
    CHAT_DATA = runs / "chat-data"
    subprocess.run([sys.executable, str(HERE.parent / "examples" / "chat_data.py"),
                    str(CHAT_DATA)], env=_env(True), check=True, capture_output=True)
    # The CPU runs all at once in the background; the CUDA runs one after another.
    cpu_procs = {n: start(runs / f"cpu-{n}", f, cpu=True) for n, f in VARIANTS.items()}
    results: dict = {}
    for name, flags in VARIANTS.items():
        out = runs / f"cuda-{name}"
        results[name] = {"cuda": finish(start(out, flags, cpu=False), out)}
        print(name, json.dumps(results[name]), flush=True)
    for name, proc in cpu_procs.items():
        results[name]["cpu"] = finish(proc, runs / f"cpu-{name}")
    # Resume: drop the final checkpoint, resume from step 10 and finish; same figures.
    for device in ("cuda", "cpu"):
        out = runs / f"{device}-async_checkpoint"
        finals = sorted((out / "checkpoints").glob("step-*"))
        kept = [p.name for p in finals]
        if finals and finals[-1].name != "step-10":
            shutil.rmtree(finals[-1])
        metrics = out / "metrics.jsonl"
        if metrics.exists():
            metrics.rename(out / "metrics_first.jsonl")
        r = finish(start(out, [], cpu=device == "cpu", resume=True), out)
        r["checkpoints_before"] = kept
        results.setdefault("resume_from_step10", {})[device] = r
    print("resume", json.dumps(results["resume_from_step10"]), flush=True)
    for name, r in results.items():
        a, b = r.get("cuda", {}), r.get("cpu", {})
        for key in ("loss", "val_loss"):
            if a.get(key) is not None and b.get(key) is not None:
                r[f"{key}_rel_diff"] = abs(a[key] - b[key]) / abs(b[key])
    gen = {d: generate(runs / f"{d}-plain", cpu=d == "cpu") for d in ("cuda", "cpu")}
    gen["same"] = gen["cuda"] == gen["cpu"]
    print("generate", json.dumps(gen), flush=True)
    extra = {}
    for name, fn in (() if SMOKE else (("zero3_offload", zero3_offload),
                                       ("moe_grouped_vs_loop", moe_paths),
                                       ("chunked_loss", chunked_loss))):
        try:
            extra[name] = fn()
        except Exception as err:  # report and go on
            extra[name] = {"error": f"{type(err).__name__}: {err}"}
        print(name, json.dumps(extra[name]), flush=True)
    md = ["# CUDA paths of `meshfit train`, each beside the CPU", "",
          f"Command: `{_common.launch_command()}`", "", _common.machine_markdown(info), "",
          "fp32, TF32 off, tiny presets, 60 steps: " + " ".join(BASE), "",
          "| run | CUDA loss | CPU loss | rel. diff | CUDA val_loss | CPU val_loss | rel. diff |",
          "|---|---:|---:|---:|---:|---:|---:|"]
    fmt = lambda v: "-" if v is None else (f"{v:.3e}" if abs(v) < 1e-2 else f"{v:.5f}")  # noqa
    for name, r in results.items():
        a, b = r.get("cuda", {}), r.get("cpu", {})
        if "error" in a or "error" in b:
            md.append(f"| {name} | {a.get('error', '')[:150]} | {b.get('error', '')[:150]} "
                      "||||| ")
            continue
        md.append(f"| {name} | {fmt(a.get('loss'))} | {fmt(b.get('loss'))} | "
                  f"{fmt(r.get('loss_rel_diff'))} | {fmt(a.get('val_loss'))} | "
                  f"{fmt(b.get('val_loss'))} | {fmt(r.get('val_loss_rel_diff'))} |")
    md += ["", f"generate (greedy, 24 tokens): same text on both: {gen['same']}",
           f"- CUDA: {gen['cuda']!r}", f"- CPU: {gen['cpu']!r}", ""]
    for name, r in extra.items():
        md.append(f"{name}: `{json.dumps(r)}`")
    md.append(f"\nWall time: {time.perf_counter() - began:.0f} s")
    text = "\n".join(md) + "\n"
    print(text)
    if not args.no_write:
        for path in _common.write_results("cuda_paths", text, {
                "machine": info, "runs": results, "generate": gen, **extra}):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
