"""Activation offload on CUDA (`meshfit.parallel.activation_offload.StreamTransfers`): the
side-stream path that runs only on a GPU. For the reference GPT (GPT-2-small shape by
default) in fp32 and in bf16 autocast, with and without full checkpointing: the loss and every
gradient after the same steps against the run without offload (bitwise), the peak device
memory of a step, and the median step time of each (the copies overlap the compute where the
offloaded step costs little more than the plain one). Prints a table and saves
benchmarks/results/activation_offload_cuda.json. GPU only.

    python benchmarks/activation_offload_cuda.py [--layers 12] [--batch 8] [--seq 1024]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch

from meshfit.models.gpt import GPT, GPTConfig
from meshfit.parallel.activation import apply_activation_checkpointing
from meshfit.parallel.activation_offload import StreamTransfers, apply_activation_offload


def _step(model, x, y, dtype):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == "bf16"):
        out = model(x, y)
    loss = out if isinstance(out, torch.Tensor) else out.loss
    loss.backward()
    return loss.detach()


def _measure(model, x, y, dtype, steps):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for _ in range(steps):
        start = time.perf_counter()
        losses.append(_step(model, x, y, dtype))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "median_s": statistics.median(times[1:]),
            "peak_gib": torch.cuda.max_memory_allocated() / 2 ** 30}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    assert torch.cuda.is_available(), "GPU only"
    device = torch.device("cuda")
    cfg = GPTConfig(vocab_size=50304, n_layer=args.layers, n_head=12, d_model=768, d_ff=3072,
                    max_seq_len=args.seq)
    base = GPT(cfg)
    base.init_weights(torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g).to(device)
    y = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g).to(device)
    rows = []
    for dtype in ("fp32", "bf16"):
        for checkpointing in ("none", "full"):
            results = {}
            for offload in (False, True):
                model = copy.deepcopy(base).to(device)
                if checkpointing != "none":
                    apply_activation_checkpointing(model, checkpointing)
                offloader = apply_activation_offload(model, device=device) if offload else None
                if offloader is not None:
                    assert isinstance(offloader.transfers, StreamTransfers), offloader.transfers
                results[offload] = _measure(model, x, y, dtype, args.steps)
                results[offload]["moved"] = dict(offloader.stats) if offloader else None
                del model
                torch.cuda.empty_cache()
            plain, off = results[False], results[True]
            same_losses = all(torch.equal(a, b) for a, b in zip(plain["losses"], off["losses"]))
            same_grads = all(torch.equal(plain["grads"][n], off["grads"][n])
                             for n in plain["grads"])
            rows.append({"dtype": dtype, "checkpointing": checkpointing,
                         "bitwise_losses": same_losses, "bitwise_grads": same_grads,
                         "step_s": [plain["median_s"], off["median_s"]],
                         "time_ratio": off["median_s"] / plain["median_s"],
                         "peak_gib": [plain["peak_gib"], off["peak_gib"]],
                         "moved": off["moved"]})
            r = rows[-1]
            print(f"{dtype:4} ckpt={checkpointing:4}  bitwise loss/grads {same_losses}/"
                  f"{same_grads}  step {r['step_s'][0] * 1e3:.1f} -> "
                  f"{r['step_s'][1] * 1e3:.1f} ms (x{r['time_ratio']:.2f})  peak "
                  f"{r['peak_gib'][0]:.2f} -> {r['peak_gib'][1]:.2f} GiB  moved "
                  f"{r['moved']['bytes'] / 2 ** 30:.2f} GiB in {r['moved']['tensors']} tensors",
                  flush=True)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "shape": vars(args), "rows": rows}
    path = Path(__file__).resolve().parent / "results" / "activation_offload_cuda.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"saved {path}")


if __name__ == "__main__":
    main()
