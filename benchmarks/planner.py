"""The layout planner (`meshfit plan`) against measurements here, and at scale beside the
layouts torchtitan publishes.

(a) On this machine, 4 CPU processes (gloo): the `tiny` preset (0.86M parameters), 256
    tokens per sequence, global batch 16, fp32, AdamW. The planner's best plan of each of
    13 layout families (`search` on a 4-process cluster, no activation checkpointing) runs
    through `meshfit.plan_validate.validate` (all in one start of 4 ranks: per-plan
    step time = median of the steps after the first, barriers at both ends; bytes = the
    worst rank's model states + the profiler's largest net allocation of a forward and
    backward). Predicted with a `meshfit calibrate --nproc 4` profile of this machine
    (`--calibration`, or measured first) and, for comparison, with the "cpu" device table.
    Reported: each error, the Spearman rank correlation of predicted and measured step
    times, and whether the predicted best is within 10% of the measured best.
(b) At scale (nothing runs): `search` as `meshfit plan` runs it for GPT-2, Llama-2-7B and
    Llama-2-70B on 1x8, 2x8 and 16x8 H100s of 80 GiB, NVLink and PCIe inside the node,
    InfiniBand between nodes, bf16, 8 sequences per GPU (the CLI's default), 1024 / 4096
    tokens: the top layout of each. Then Llama 3.1 8B / 70B / 405B (transformers configs
    written here) at torchtitan's published settings (docs/performance.md: 8 GPUs, FSDP 8,
    global batch 16; 256 GPUs, FSDP 32 x TP 8, global 512; 512 GPUs, FSDP 8 x TP 8 x PP 8,
    global 256, interleaved 1F1B; 8192 tokens; selective / full activation checkpointing),
    on 80 GiB (torchtitan's H100s have 96 GB): our top layout, and torchtitan's layout as
    our estimate and cost model see it.
(c) ZeRO-3 per-rank bytes at world sizes 8-512 against a dry run: the model on fake
    tensors (FakeTensorMode), `fully_shard` on a fake process group (torch's "fake"
    backend from torch.testing._internal: private APIs, so only here), `rank_report` of
    the sharded model and an AdamW state built on it.

    python benchmarks/planner.py [--parts a b c] [--calibration calibration.json]

Writes benchmarks/results/planner.{md,json}; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, machine_markdown, write_results  # noqa: E402

GiB = 2**30


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rho: Pearson's correlation of the ranks (ties share their mean rank)."""
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    a, b = ranks(xs), ranks(ys)
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    var = (sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b)) ** 0.5
    return cov / var if var else float("nan")


# ---------------------------------------------------------------------------- (a)
FAMILIES = [  # (label, pp, dp_replicate, dp_shard, tp, zero_stage, offload, sp)
    ("DDP 4", 1, 4, 1, 1, 0, "none", False),
    ("ZeRO-1 4", 1, 1, 4, 1, 1, "none", False),
    ("ZeRO-2 4", 1, 1, 4, 1, 2, "none", False),
    ("ZeRO-3 4", 1, 1, 4, 1, 3, "none", False),
    ("ZeRO-3 4 + offload", 1, 1, 4, 1, 3, "cpu", False),
    ("HSDP 2 x 2", 1, 2, 2, 1, 3, "none", False),
    ("TP 4", 1, 1, 1, 4, 0, "none", False),
    ("TP 4 + SP", 1, 1, 1, 4, 0, "none", True),
    ("DP 2 x TP 2", 1, 2, 1, 2, 0, "none", False),
    ("ZeRO-3 2 x TP 2", 1, 1, 2, 2, 3, "none", False),
    ("PP 4", 4, 1, 1, 1, 0, "none", False),
    ("PP 2 x DP 2", 2, 2, 1, 1, 0, "none", False),
    ("PP 2 x TP 2", 2, 1, 1, 2, 0, "none", False),
]


def part_a(args) -> tuple[str, dict]:
    from meshfit.plan import DEVICES, Cluster, predict, search
    from meshfit.plan.calibrate import load_calibration
    from meshfit.plan_validate import validate

    cal_path = args.calibration
    if cal_path is None:
        cal_path = str(Path(tempfile.mkdtemp()) / "calibration.json")
        env = dict(os.environ, MESHFIT_CPU="1")
        subprocess.run([sys.executable, "-m", "meshfit", "calibrate", "--nproc",
                        str(args.nproc), "--out", cal_path], check=True, env=env)
    calibration = load_calibration(cal_path)
    model, seq, batch, dtype = "tiny", 256, 16, "fp32"
    calibrated = Cluster(gpus_per_node=args.nproc, device=DEVICES["cpu"],
                         calibration=calibration)
    table = Cluster(gpus_per_node=args.nproc, device=DEVICES["cpu"])
    result = search(model, calibrated, seq_len=seq, global_batch_size=batch, dtype=dtype,
                    checkpointing=("none",))
    chosen = []
    for label, pp, r, s, t, z, off, sp in FAMILIES:
        for plan in result.plans:  # best predicted first
            lay = plan.layout
            if (lay.pp, lay.dp_replicate, lay.dp_shard, lay.tp, lay.zero_stage, lay.offload,
                    lay.sequence_parallel) == (pp, r, s, t, z, off, sp):
                chosen.append((label, plan))
                break
    started = time.time()
    rows = validate([p for _, p in chosen], model=model, seq_len=seq,
                    global_batch_size=batch, dtype=dtype, steps=args.steps, nproc=args.nproc)
    elapsed = time.time() - started
    out = []
    for (label, plan), row in zip(chosen, rows):
        t_table, _ = predict(result.model, plan.layout, table, seq_len=seq,
                             global_batch_size=batch, dtype=dtype)
        out.append({"family": label, **row, "predicted_step_s_table": t_table,
                    "time_error_table": (t_table - row["measured_step_s"])
                    / row["measured_step_s"], "breakdown": plan.breakdown})
    ran = [o for o in out if o["skipped"] is None]
    measured = [o["measured_step_s"] for o in ran]
    summary = {}
    for key in ("predicted_step_s", "predicted_step_s_table"):
        pred = [o[key] for o in ran]
        best_pred = min(range(len(ran)), key=lambda i: pred[i])
        summary[key] = {
            "spearman": spearman(pred, measured),
            "predicted_best": ran[best_pred]["family"],
            "its_measured_s": measured[best_pred], "measured_best": ran[min(
                range(len(ran)), key=lambda i: measured[i])]["family"],
            "measured_best_s": min(measured),
            "within_10pct": measured[best_pred] <= 1.10 * min(measured)}
    md = [f"### (a) Predicted vs measured, {args.nproc} CPU processes (gloo)", "",
          f"`tiny` preset, {seq} tokens, global batch {batch}, {dtype}, AdamW; each family's "
          f"best plan by the calibrated prediction; {args.steps} optimizer steps each "
          f"(median of the last {args.steps - 1}); validate() took {elapsed:.0f} s. "
          f"Calibration: `{cal_path}` (matmul fp32 "
          f"{calibration.matmul_flops['fp32'] / 1e9:.1f} GFLOP/s per process, all-reduce "
          f"{calibration.collectives['all_reduce'].bus_bandwidth / 1e9:.2f} GB/s, "
          f"{calibration.collectives['all_reduce'].latency * 1e3:.2f} ms).", "",
          "| family | plan | bytes pred / meas (MiB) | err | step pred / meas (s) | err | "
          "\"cpu\" table pred (s) | err |", "|---|---|---|---|---|---|---|---|"]
    for o in out:
        if o["skipped"]:
            md.append(f"| {o['family']} | {o['layout']} | skipped: {o['skipped']} |||||")
            continue
        md.append(f"| {o['family']} | {o['layout']} | {o['predicted_bytes'] / 2**20:.1f} / "
                  f"{o['measured_bytes'] / 2**20:.1f} | {o['bytes_error']:+.1%} | "
                  f"{o['predicted_step_s']:.3f} / {o['measured_step_s']:.3f} | "
                  f"{o['time_error']:+.0%} | {o['predicted_step_s_table']:.3f} | "
                  f"{o['time_error_table']:+.0%} |")
    md.append("")
    for key, name in (("predicted_step_s", "calibrated"), ("predicted_step_s_table",
                                                           "\"cpu\" device table")):
        s = summary[key]
        md.append(f"- {name}: Spearman rho = {s['spearman']:.2f}; predicted best "
                  f"{s['predicted_best']} measured {s['its_measured_s']:.3f} s vs measured "
                  f"best {s['measured_best']} {s['measured_best_s']:.3f} s: "
                  f"{'within' if s['within_10pct'] else 'NOT within'} 10%")
    return "\n".join(md), {"rows": out, "summary": summary, "calibration": cal_path,
                           "validate_s": elapsed}


# ---------------------------------------------------------------------------- (b)
LLAMA31 = {  # transformers LlamaConfig fields of Llama 3.1 (Meta's published configs)
    "llama3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8),
    "llama3.1-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                         num_attention_heads=64, num_key_value_heads=8),
    "llama3.1-405b": dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                          num_attention_heads=128, num_key_value_heads=8),
}
TORCHTITAN = {  # docs/performance.md (Llama 3.1, H100, 8192 tokens)
    "llama3.1-8b": dict(nodes=1, batch=16, spec=dict(dp_shard=8, zero_stage=3,
                                                      activation_checkpointing="selective",
                                                      micro_batch_size=2),
                        text="FSDP 8, local batch 2, selective AC"),
    "llama3.1-70b": dict(nodes=32, batch=512, spec=dict(
        dp_shard=32, tp=8, zero_stage=3, sequence_parallel=True, loss_parallel=True,
        activation_checkpointing="full", micro_batch_size=16),
        text="FSDP 32 x TP 8 (+ SP, loss parallel), local batch 16, full AC"),
    "llama3.1-405b": dict(nodes=64, batch=256, spec=dict(
        dp_shard=8, tp=8, pp=8, zero_stage=3, sequence_parallel=True,
        schedule="interleaved_1f1b", microbatches=32, virtual_stages=2,
        activation_checkpointing="full", micro_batch_size=1),
        text="FSDP 8 x TP 8 (+ SP) x PP 8, interleaved 1F1B, local batch 32, full AC"),
}


def _cluster(nodes: int, interconnect: str):
    from meshfit.plan import DEVICES, INTERCONNECTS, NETWORKS, Cluster

    return Cluster(gpus_per_node=8, nodes=nodes, device=DEVICES["h100"],
                   interconnect=INTERCONNECTS[interconnect], interconnect_name=interconnect,
                   network=NETWORKS["infiniband"], network_name="infiniband")


def _plan_row(plan) -> dict:
    b = plan.estimate.per_rank_bytes
    return {"layout": plan.layout.describe(), "layout_json": plan.layout.to_json(),
            "gib_per_rank": b["total"] / GiB, "step_s": plan.step_time_s, "mfu": plan.mfu,
            "tokens_per_s": plan.tokens_per_s, "breakdown": plan.breakdown}


def part_b(args) -> tuple[str, dict]:
    import transformers

    from meshfit.memory import LayoutSpec, ModelShape, estimate
    from meshfit.plan import predict, search

    rows = []
    for model in ("gpt2", "llama-7b", "llama-70b"):
        seq = 1024 if model == "gpt2" else 4096
        for nodes in (1, 2, 16):
            for link in ("nvlink", "pcie"):
                cluster = _cluster(nodes, link)
                try:
                    result = search(model, cluster, seq_len=seq,
                                    global_batch_size=8 * cluster.world_size, dtype="bf16")
                    rows.append({"model": model, "gpus": f"{nodes}x8", "link": link,
                                 "scenario": result.scenario, **_plan_row(result.plans[0])})
                except ValueError as err:
                    rows.append({"model": model, "gpus": f"{nodes}x8", "link": link,
                                 "refused": str(err)})
    md = ["### (b) At scale: `meshfit plan`'s top layout (H100 80 GiB, bf16, InfiniBand "
          "between nodes, 8 sequences per GPU)", "",
          "| model | GPUs | node link | top layout | GiB/rank | step (s) | MFU |",
          "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "refused" in r:
            md.append(f"| {r['model']} | {r['gpus']} | {r['link']} | {r['refused']} |||")
        else:
            md.append(f"| {r['model']} | {r['gpus']} | {r['link']} | {r['layout']} | "
                      f"{r['gib_per_rank']:.1f} | {r['step_s']:.3g} | {r['mfu']:.0%} |")
    titan = []
    folder = Path(tempfile.mkdtemp())
    for name, fields in LLAMA31.items():
        path = folder / name
        transformers.LlamaConfig(vocab_size=128256, max_position_embeddings=131072,
                                 rope_theta=500000.0, **fields).save_pretrained(path)
        shape = ModelShape.of(str(path))
        ref = TORCHTITAN[name]
        cluster = _cluster(ref["nodes"], "nvlink")
        seq = 8192
        result = search(shape, cluster, seq_len=seq, global_batch_size=ref["batch"],
                        dtype="bf16")
        spec = LayoutSpec(**ref["spec"])
        est = estimate(shape, spec, seq_len=seq, dtype="bf16")
        step, terms = predict(shape, spec, cluster, seq_len=seq,
                              global_batch_size=ref["batch"], dtype="bf16", est=est)
        titan.append({"model": name, "params": shape.params, "gpus": cluster.world_size,
                      "global_batch": ref["batch"], "ours": _plan_row(result.plans[0]),
                      "torchtitan": {"layout": ref["text"], "spec": spec.to_json(),
                                     "gib_per_rank": est.total / GiB,
                                     "fits_80gib_margin_10pct": est.total <= 0.9 * 80 * GiB,
                                     "step_s": step, "breakdown": terms}})
    md += ["", "Llama 3.1 at torchtitan's published settings (docs/performance.md; 8192 "
           "tokens; our device: H100 80 GiB, NVLink, InfiniBand), torchtitan's layout as "
           "our estimate and cost model see it:", "",
           "| model | GPUs, batch | our top layout | GiB | step (s) | torchtitan's layout | "
           "GiB (ours) | step (ours, s) |", "|---|---|---|---|---|---|---|---|"]
    for t in titan:
        o, tt = t["ours"], t["torchtitan"]
        md.append(f"| {t['model']} ({t['params'] / 1e9:.1f}B) | {t['gpus']}, {t['global_batch']} "
                  f"| {o['layout']} | {o['gib_per_rank']:.1f} | {o['step_s']:.3g} | "
                  f"{tt['layout']} | {tt['gib_per_rank']:.1f}"
                  f"{'' if tt['fits_80gib_margin_10pct'] else ' (does not fit 72)'} | "
                  f"{tt['step_s']:.3g} |")
    return "\n".join(md), {"plans": rows, "torchtitan": titan}


# ---------------------------------------------------------------------------- (c)
def _fake_rank(model: str, world: int) -> dict:
    """ZeRO-3 of `model` on `world` fake ranks: rank 0's bytes (FSDP2 on a fake group)."""
    import warnings

    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshfit.memory import rank_report
    from meshfit.models import GPT, GPTConfig

    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        with torch.device("meta"):  # no init (it draws a seed: data-dependent under fake)
            net = GPT(GPTConfig.preset(model))
        mesh = init_device_mesh("cpu", (world,))
        for block in net.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(net, mesh=mesh)
        with FakeTensorMode(allow_non_fake_inputs=True), warnings.catch_warnings():
            # rank_report tells storages apart by data_ptr, which fake tensors still give
            warnings.simplefilter("ignore", UserWarning)
            net.to_empty(device="cpu")  # the shards become fake CPU tensors: sizes, no data
            opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
            for p in net.parameters():  # AdamW's state on the shards, without a step
                opt.state[p] = {"step": torch.zeros(()), "exp_avg": torch.zeros_like(p),
                                "exp_avg_sq": torch.zeros_like(p)}
                p.grad = torch.zeros_like(p)
            r = rank_report(net, opt)
        return {"params": r.param_bytes, "grads": r.grad_bytes, "optimizer": r.optimizer_bytes}
    finally:
        dist.destroy_process_group()


def part_c(args) -> tuple[str, dict]:
    from meshfit.memory import LayoutSpec, estimate

    rows = []
    for model in ("gpt2", "llama-7b"):
        for world in (8, 64, 512):
            started = time.time()
            try:
                got = _fake_rank(model, world)
            except Exception as err:  # private APIs: report, do not fail the benchmark
                rows.append({"model": model, "world": world, "error": repr(err)[:300]})
                continue
            est = estimate(model, LayoutSpec(dp_shard=world, zero_stage=3), seq_len=128)
            rows.append({"model": model, "world": world, "dry_run": got,
                         "estimate": {"params": est.params, "grads": est.grads,
                                      "optimizer": est.optimizer},
                         "seconds": time.time() - started})
    md = ["### (c) ZeRO-3 per-rank bytes vs a dry run on fake tensors and a fake process "
          "group (rank 0)", "", "| model | ranks | params est / dry (MiB) | grads | "
          "optimizer | worst error |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            md.append(f"| {r['model']} | {r['world']} | failed: {r['error']} ||||")
            continue
        e, d = r["estimate"], r["dry_run"]
        err = max(abs(e[k] - d[k]) / d[k] for k in e)
        md.append(f"| {r['model']} | {r['world']} | " + " | ".join(
            f"{e[k] / 2**20:.2f} / {d[k] / 2**20:.2f}" for k in ("params", "grads",
                                                                 "optimizer"))
                  + f" | {err:.2%} |")
    return "\n".join(md), {"rows": rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", nargs="+", default=["a", "b", "c"], choices=["a", "b", "c"])
    p.add_argument("--calibration", default=None,
                   help="a meshfit calibrate --nproc N profile (default: measure one first)")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    info = machine_info()
    sections, payload = [], {"command": " ".join([sys.executable, *sys.argv]),
                             "machine": info}
    for part, fn in (("a", part_a), ("b", part_b), ("c", part_c)):
        if part in args.parts:
            started = time.time()
            md, data = fn(args)
            payload[part] = {**data, "seconds": time.time() - started}
            sections.append(md)
            print(md, flush=True)
    info["loadavg_at_end"] = list(os.getloadavg())
    markdown = "\n\n".join(["# Layout planner: predicted vs measured, and at scale",
                            f"Command: `python benchmarks/planner.py --parts "
                            f"{' '.join(args.parts)}`", machine_markdown(info), *sections])
    if not args.no_write:
        md_path, js_path = write_results("planner", markdown, json.loads(json.dumps(
            payload, default=str)))
        print(f"wrote {md_path} and {js_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
