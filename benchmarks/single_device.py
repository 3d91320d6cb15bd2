"""The single-GPU guide's method table, measured: tokens/s and memory per method.

The single-GPU training guide (Hugging Face's "Methods and tools for efficient training on a
single GPU") marks each method "yes/no" for speed and memory. This
script trains the reference GPT with each method alone and with the guide's combinations
(accumulation + checkpointing + mixed precision + Adafactor / 8-bit AdamW) and reports, next to
the plain fp32 AdamW baseline:

* tokens/s: the median optimizer-step time over the measured steps (after warm-up, which
  includes compilation), divided into the step's tokens;
* memory: on CUDA the caching allocator's peak (``max_memory_allocated``) over the measured
  steps; on CPU (whose allocator keeps no such figure) the bytes this process holds for
  training, counted on the live objects: parameters + gradients + optimizer state
  (`meshfit.optim.state_bytes`) + tensors saved for backward in one micro-batch's forward
  (``saved_tensors_hooks``, parameters excluded, storages counted once).

Every method trains the same weights (same seed) on the same preloaded token batches for the
same effective batch. Run on a quiet machine; nothing here is a test.

    python benchmarks/single_device.py                      # CPU: tiny + small GPT
    python benchmarks/single_device.py --sizes gpt2,gpt2-medium   # a GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

from meshfit import Accelerator  # noqa: E402
from meshfit import optim as moptim  # noqa: E402
from meshfit.models import GPT, GPTConfig  # noqa: E402

SIZES = {
    # name: (preset, overrides)
    "tiny": ("tiny", {}),
    "small": ("tiny", dict(d_model=256, n_layer=6, n_head=8, d_ff=1024)),
    # GPT-2 small/medium shapes, vocabulary padded 50257 -> 50304 as the guide advises.
    "gpt2": ("gpt2", dict(vocab_size=50304)),
    "gpt2-medium": ("gpt2", dict(vocab_size=50304, n_layer=24, d_model=1024, n_head=16,
                                 d_ff=4096)),
}


@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    accumulation: int = 1
    mixed_precision: str = "no"
    tf32: bool = False
    checkpointing: str = "none"
    optimizer: str = "adamw"
    compile: bool = False
    lora: bool = False
    empty_cache_steps: int = 0
    gpu_only: bool = False


def methods(half: str) -> list[Method]:
    """The guide's rows (each alone) and its combinations; `half` is bf16 or fp16."""
    return [
        Method("baseline (fp32 AdamW)"),
        Method("gradient accumulation x4", accumulation=4),
        Method("gradient checkpointing", checkpointing="full"),
        Method(f"mixed precision {half}", mixed_precision=half),
        Method("tf32", tf32=True, gpu_only=True),
        Method("empty_cache_steps=1", empty_cache_steps=1, gpu_only=True),
        Method("AdamW fused", optimizer="adamw_fused"),
        Method("Adafactor", optimizer="adafactor"),
        Method("8-bit AdamW", optimizer="adamw_8bit"),
        Method("torch.compile (inductor)", compile=True),
        Method("LoRA r=8", lora=True),
        Method(f"guide combo: accum x4 + checkpointing + {half} + Adafactor", accumulation=4,
               checkpointing="full", mixed_precision=half, optimizer="adafactor"),
        Method(f"guide combo: accum x4 + checkpointing + {half} + 8-bit AdamW", accumulation=4,
               checkpointing="full", mixed_precision=half, optimizer="adamw_8bit"),
        Method(f"speed combo: {half} + tf32 + compile + fused AdamW", mixed_precision=half,
               tf32=True, compile=True, optimizer="adamw_fused"),
    ]


def _saved_activation_bytes(model, x, y, params: set[int]) -> int:
    """Bytes of the tensors autograd saves for backward in one forward (parameters and
    storages seen before excluded), i.e. what the micro-batch's activations keep alive."""
    seen: set[int] = set()
    total = 0

    def pack(t: torch.Tensor):
        nonlocal total
        try:
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in seen and key not in params:
                seen.add(key)
                total += storage.nbytes()
        except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage
            pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, y)
    del loss
    return total


def run_method(method: Method, cfg: GPTConfig, data: torch.Tensor, args, device) -> dict:
    """Train `method` for warm-up + measured steps; return its figures."""
    micro = args.batch_size // method.accumulation
    acc = Accelerator(gradient_accumulation_steps=method.accumulation,
                      mixed_precision=method.mixed_precision, tf32=method.tf32,
                      activation_checkpointing=method.checkpointing, compile=method.compile,
                      compile_backend="inductor", empty_cache_steps=method.empty_cache_steps,
                      cpu=device.type == "cpu")
    torch.manual_seed(args.seed)
    with device:  # initialise on the device (fast for the GPU sizes)
        model = GPT(cfg)
    if method.lora:
        from meshfit.peft import lora

        model = lora(model, r=8, alpha=16)
    model = acc.prepare(model)
    opt = acc.prepare(moptim.build(method.optimizer, model, lr=args.lr, weight_decay=0.1,
                                   betas=(0.9, 0.95)))
    cuda = device.type == "cuda"
    times: list[float] = []
    losses: list[float] = []
    steps = args.warmup + args.steps
    for step in range(steps):
        if cuda and step == args.warmup:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        _common.device_sync(device)
        t0 = time.perf_counter()
        batch = data[step % data.shape[0]]  # preloaded on the device (data preloading)
        for m in range(method.accumulation):
            tokens = batch[m * micro:(m + 1) * micro]
            with acc.accumulate(model):
                loss = model(tokens[:, :-1], tokens[:, 1:])
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
        _common.device_sync(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
    tokens_per_step = args.batch_size * args.seq_len
    out = {"method": method.name, "step_s": statistics.median(times),
           "tokens_per_s": tokens_per_step / statistics.median(times),
           "final_loss": losses[-1], "micro_batch": micro,
           "accumulation": method.accumulation}
    report = moptim.state_bytes(opt.optimizer)
    params = [p for p in model.parameters()]
    out["param_bytes"] = sum(p.numel() * p.element_size() for p in params)
    out["grad_bytes"] = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    out["optimizer_bytes"] = report.total_bytes
    out["optimizer_bytes_per_param"] = report.bytes_per_param
    if cuda:
        out["peak_bytes"] = torch.cuda.max_memory_allocated(device)
        out["memory_source"] = "CUDA allocator peak"
    else:
        # Saved activations of one micro-batch, measured on an uncompiled twin of the model
        # (saved-tensor hooks do not see inside compiled graphs; compile does not change what
        # eager would save for this model, and the guide lists no memory gain for it).
        twin = acc.unwrap_model(model)
        if method.compile:
            twin = _uncompiled_twin(method, cfg, args)
        tokens = data[0][:micro]
        ptrs = {p.untyped_storage().data_ptr() for p in twin.parameters()}
        with acc.autocast():
            out["activation_bytes"] = _saved_activation_bytes(twin, tokens[:, :-1],
                                                              tokens[:, 1:], ptrs)
        out["peak_bytes"] = (out["param_bytes"] + out["grad_bytes"] + out["optimizer_bytes"]
                             + out["activation_bytes"])
        out["memory_source"] = "params + grads + optimizer state + saved activations"
    del model, opt, acc
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    torch._dynamo.reset()
    return out


def _uncompiled_twin(method: Method, cfg: GPTConfig, args):
    twin_acc = Accelerator(activation_checkpointing=method.checkpointing, cpu=True,
                           mixed_precision=method.mixed_precision)
    torch.manual_seed(args.seed)
    return twin_acc.prepare(GPT(cfg))


def _restore_flags() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = True  # PyTorch's default for convolutions


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default=None,
                   help=f"comma-separated, from {', '.join(SIZES)} (default: tiny,small on CPU, "
                        "gpt2,gpt2-medium on CUDA)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="sequences per optimizer step (default 16 on CPU, 8 on CUDA)")
    p.add_argument("--seq-len", type=int, default=None, help="default 128 CPU, 1024 CUDA")
    p.add_argument("--steps", type=int, default=6, help="measured optimizer steps")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured first steps")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default="", help="comma-separated substrings of method names")
    p.add_argument("--name", default=None, help="results file name (default single_device_"
                                                "<cpu|cuda>)")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    device = torch.device("cuda", 0) if torch.cuda.is_available() and \
        os.environ.get("MESHFIT_CPU") != "1" else torch.device("cpu")
    cuda = device.type == "cuda"
    sizes = (args.sizes or ("gpt2,gpt2-medium" if cuda else "tiny,small")).split(",")
    args.batch_size = args.batch_size or (8 if cuda else 16)
    args.seq_len = args.seq_len or (1024 if cuda else 128)
    if args.batch_size % 4:
        raise SystemExit(f"--batch-size={args.batch_size} must be a multiple of 4 (accumulation "
                         "x4 rows split it)")
    half = "bf16"  # fp16 works too (with loss scaling); bf16 is what the guide recommends on
    # Ampere and newer and needs no scaler
    info = _common.machine_info()
    info["device"] = torch.cuda.get_device_name(device) if cuda else "cpu"
    rows = []
    for size in sizes:
        preset, overrides = SIZES[size]
        cfg = GPTConfig.preset(preset, max_seq_len=args.seq_len, **overrides)
        g = torch.Generator().manual_seed(args.seed)
        data = torch.randint(0, cfg.vocab_size, (4, args.batch_size, args.seq_len + 1),
                             generator=g).to(device)
        for method in methods(half):
            if method.gpu_only and not cuda:
                continue
            if args.only and not any(s in method.name for s in args.only.split(",")):
                continue
            try:
                r = run_method(method, cfg, data, args, device)
            except (ValueError, RuntimeError) as err:  # e.g. no 8-bit library installed
                r = {"method": method.name, "error": str(err).splitlines()[0][:160]}
                if cuda:
                    torch.cuda.empty_cache()
            finally:
                _restore_flags()
            r["size"] = size
            r["params"] = cfg.num_params()
            rows.append(r)
            print(_row_text(r, rows), flush=True)
    info["loadavg_at_end"] = list(os.getloadavg())
    md = _markdown(rows, args, info, cuda)
    print(md)
    if not args.no_write:
        name = args.name or f"single_device_{'cuda' if cuda else 'cpu'}"
        paths = _common.write_results(name, md, {"machine": info, "args": vars(args),
                                                 "rows": rows})
        print(f"wrote {paths[0]} and {paths[1]}")


def _baseline(rows, size):
    return next((r for r in rows if r["size"] == size and r["method"].startswith("baseline")
                 and "error" not in r), None)


def _row_text(r, rows) -> str:
    if "error" in r:
        return f"{r['size']:>12} {r['method']:<60} error: {r['error']}"
    base = _baseline(rows, r["size"])
    speed = r["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
    mem = r["peak_bytes"] / base["peak_bytes"] if base else float("nan")
    return (f"{r['size']:>12} {r['method']:<60} {r['tokens_per_s']:>10.0f} tok/s x{speed:4.2f}"
            f"  {r['peak_bytes'] / 2**20:>9.1f} MiB x{mem:4.2f}  loss {r['final_loss']:.3f}")


def _markdown(rows, args, info, cuda) -> str:
    out = ["# Single-device methods, measured", "",
           f"Command: `{_common.launch_command()}`", "",
           _common.machine_markdown(info), "",
           f"Batch {args.batch_size} sequences x {args.seq_len} tokens per optimizer step; "
           f"{args.warmup} warm-up + {args.steps} measured steps (median step time). Memory: "
           + ("CUDA allocator peak over the measured steps." if cuda else
              "parameters + gradients + optimizer state + activations saved for backward by "
              "one micro-batch (counted on the live objects; CPU has no allocator peak)."), ""]
    for size in dict.fromkeys(r["size"] for r in rows):
        n = next(r["params"] for r in rows if r["size"] == size)
        out += [f"## {size} ({n / 1e6:.1f}M parameters)", "",
                "| method | tokens/s | speed vs baseline | memory (MiB) | memory vs baseline "
                "| optimizer state B/param | final loss |",
                "|---|---:|---:|---:|---:|---:|---:|"]
        base = _baseline(rows, size)
        for r in (r for r in rows if r["size"] == size):
            if "error" in r:
                out.append(f"| {r['method']} | — | — | — | — | — | {r['error']} |")
                continue
            out.append(
                f"| {r['method']} | {r['tokens_per_s']:.0f} | "
                f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x | "
                f"{r['peak_bytes'] / 2**20:.1f} | {r['peak_bytes'] / base['peak_bytes']:.2f}x | "
                f"{r['optimizer_bytes_per_param']:.2f} | {r['final_loss']:.3f} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    main()
