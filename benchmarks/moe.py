"""Mixture of experts (issue #14): quality at equal compute, expert-parallel memory and step
time, and load balance with and without the auxiliary loss.

(a) Quality at equal compute: the `moe-tiny` preset (4 blocks, d 128, 8 SwiGLU experts of
    width 256, top-2, every block MoE) against the dense model with the same parameters
    per token: the same preset with n_experts=0 and the d_ff whose parameter count is
    closest to moe-tiny's active parameters (`GPTConfig.num_active_params`: router + the
    top-2 experts + everything else), so both cost the same FLOPs per token (6N + the
    attention term; routing is not a matmul). Each trains `meshfit train` on the built-in
    corpus (the Python standard library's source, bytes) for the same steps, batch and
    seed (the same tokens in the same order), one process; reported: validation loss at
    the end (and along the way), the last training loss, the token count.
(b) Per-rank bytes of expert parallelism on 4 processes, dp_shard 4, ep 1/2/4, ZeRO-1 and
    ZeRO-3, fp32 AdamW: moe-tiny through `Accelerator(parallel=ParallelDims(dp_shard=4,
    ep=E), zero_stage=Z)`, measured as tests/memory/test_estimate_measured.py measures (one
    optimizer step, one more forward and backward keeping the gradients, then
    `meshfit.memory.rank_report` for the model states and the profiler's largest net
    allocation of a forward and backward for the step's peak; on CUDA the allocator's peak)
    beside `meshfit.memory.estimate(..., LayoutSpec(dp_shard=4, ep=E, zero_stage=Z))`.
(c) Step time of ep 1/2/4 on 4 processes (`meshfit train --nproc 4`, dp_shard 4, ZeRO-3
    as meshfit train resolves it), with the share of each step spent in the expert
    all-to-alls (`moe_a2a_share` in metrics.jsonl: the slowest rank's exchange seconds /
    the step's wall time); medians over the logged steps after the warm-up ones.
(d) Load balance: the coefficient of variation of tokens per expert (std / mean over the 8
    experts, averaged over the 4 blocks: `moe_tokens_per_expert_cv`) over training, with the
    default load-balancing loss (aux_loss_coef 0.01: (a)'s moe-tiny run) and without it
    (aux_loss_coef 0, otherwise identical).

    python benchmarks/moe.py                     # all parts: 11-17 min on 2 shared cores
    python benchmarks/moe.py --parts b c --time-steps 20

Runs on CUDA when present: (a) and (d) on one GPU; (b) and (c) on 4 GPUs when there are 4,
otherwise on the CPU with gloo (MESHFIT_CPU=1); that path has not been run yet (no GPU was
lent when this was written). Writes benchmarks/results/moe.{md,json}; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, machine_markdown, write_results  # noqa: E402

MiB = 2**20
MESHFIT = [sys.executable, "-m", "meshfit"]
NPROC = 4
EPS = (1, 2, 4)


# ---------------------------------------------------------------------------- helpers
def dense_match(moe) -> tuple[int, object]:
    """The d_ff whose dense model (the same preset, n_experts=0) has the parameter count
    closest to `moe`'s active parameters, and its config."""
    import dataclasses

    target = moe.num_active_params()
    dense = dataclasses.replace(moe, n_experts=0)
    per_unit = dataclasses.replace(dense, d_ff=2).num_params() - \
        dataclasses.replace(dense, d_ff=1).num_params()  # parameters per unit of d_ff
    guess = max(1, round(moe.d_ff + (target - dataclasses.replace(
        dense, d_ff=moe.d_ff).num_params()) / per_unit))
    best = min(range(max(1, guess - 2), guess + 3), key=lambda f: (abs(
        dataclasses.replace(dense, d_ff=f).num_params() - target), f))
    return best, dataclasses.replace(dense, d_ff=best)


def tree_state() -> dict:
    """The repository's commit and the src/ files changed from it, read at the start (the
    runs import meshfit from this working tree)."""
    root = Path(__file__).resolve().parent.parent

    def git(*argv) -> str:
        return subprocess.run(["git", "-C", str(root), *argv], capture_output=True, text=True,
                              check=False).stdout

    changed = [line[3:] for line in git("status", "--porcelain", "--", "src").splitlines()
               if line.strip()]
    return {"commit": git("rev-parse", "--short", "HEAD").strip(), "src_changed": changed}


def cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _env(cpu: bool) -> dict:
    """On the CPU: gloo, and one thread per process (measured on the shared 2-core machine:
    a one-process moe-tiny step of 16 x 128 tokens takes 0.3-0.5 s with one thread and
    1.5-12 s with two while other jobs run)."""
    env = dict(os.environ)
    if cpu:
        env["MESHFIT_CPU"] = "1"
        env["OMP_NUM_THREADS"] = "1"
    return env


def train(out: Path, nproc: int, overrides: list[str], *, cpu: bool, timeout: float,
          may_fail: bool = False) -> dict:
    """One `meshfit train` run; its metrics.jsonl lines and wall time. `may_fail`: a failed
    run is returned with its one-line error ("failed") and the steps it logged."""
    cmd = [*MESHFIT, "train", "--nproc", str(nproc), "--out", str(out), *overrides]
    print("$ " + " ".join(cmd[2:]), flush=True)
    started = time.time()
    proc = subprocess.run(cmd, env=_env(cpu), capture_output=True, text=True, timeout=timeout)
    wall = time.time() - started
    failed = None
    if proc.returncode:
        if not may_fail:
            raise SystemExit(f"meshfit train failed ({proc.returncode}):\n"
                             f"{proc.stderr[-3000:]}")
        failed = next((x for x in proc.stderr.splitlines()
                       if x.startswith("meshfit train: error:")),
                      f"exit code {proc.returncode}")
        print(f"  failed: {failed}", flush=True)
    metrics = out / "metrics.jsonl"
    lines = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() \
        else []
    shown = [out.name if a == str(out) else a for a in cmd[3:]]  # the run folder's name only
    return {"command": "meshfit " + " ".join(shown), "wall_s": wall, "metrics": lines,
            "failed": failed, "banner": next((x for x in proc.stdout.splitlines()
                                              if x.startswith("meshfit train:")), "")}


def _train_lines(run: dict) -> list[dict]:
    return [m for m in run["metrics"] if "loss" in m]


def _val(run: dict) -> list[tuple[int, float]]:
    return [(m["step"], m["val_loss"]) for m in run["metrics"] if "val_loss" in m]


def _common_overrides(args) -> list[str]:
    return [f"--train.steps={args.steps}", f"--train.global_batch_size={args.batch}",
            f"--train.micro_batch_size={args.batch}", f"--train.seq_len={args.seq_len}",
            f"--train.seed={args.seed}", f"--train.eval_batches={args.eval_batches}",
            "--train.log_every=1", f"--train.warmup_steps={min(20, args.steps // 5)}"]


# ---------------------------------------------------------------------------- (a) + (d)
def part_a_d(args, work: Path, parts: set[str]) -> tuple[list[str], dict]:
    from meshfit.models import GPTConfig

    moe = GPTConfig.preset("moe-tiny", max_seq_len=args.seq_len)
    d_ff, dense = dense_match(moe)
    tokens = args.steps * args.batch * args.seq_len
    base = [*_common_overrides(args), f"--train.eval_every={max(1, args.steps // 4)}",
            "--model.preset=moe-tiny"]
    cpu = cuda_devices() == 0
    runs = {}
    arms = [("moe", [])]
    if "a" in parts:
        arms.append(("dense", ["--model.n_experts=0", f"--model.d_ff={d_ff}"]))
    if "d" in parts:
        arms.append(("moe_no_aux", ["--model.aux_loss_coef=0"]))
    for name, extra in arms:
        runs[name] = train(work / name, 1, [*base, *extra], cpu=cpu,
                           timeout=args.timeout)
        final = _val(runs[name])[-1]
        print(f"  {name}: val_loss {final[1]:.4f} after {tokens} tokens "
              f"({runs[name]['wall_s']:.0f} s)", flush=True)
    counts = {"moe_total": moe.num_params(), "moe_active": moe.num_active_params(),
              "dense_d_ff": d_ff, "dense_total": dense.num_params(),
              "moe_flops_per_token": moe.flops_per_token(args.seq_len),
              "dense_flops_per_token": dense.flops_per_token(args.seq_len)}
    md, data = [], {"counts": counts, "tokens": tokens, "runs": runs}
    if "a" in parts:
        md += _markdown_a(args, runs, counts, tokens)
    if "d" in parts:
        data["balance"] = {n: _balance(runs[n]) for n in ("moe", "moe_no_aux")}
        md += _markdown_d(args, runs, data["balance"])
    data["runs"] = {name: _compact(run) for name, run in runs.items()}
    return md, data


_SERIES = ("loss", "step_time_s", "moe_tokens_per_expert_min", "moe_tokens_per_expert_max",
           "moe_tokens_per_expert_cv", "moe_dropped_fraction", "moe_aux_loss", "moe_a2a_s",
           "moe_a2a_share")


def _compact(run: dict) -> dict:
    """A run for the JSON: its metrics as one list per figure (steps in order), not a
    dictionary per step."""
    lines = _train_lines(run)
    out = {k: v for k, v in run.items() if k != "metrics"}
    out["step"] = [m["step"] for m in lines]
    out.update({k: [m.get(k) for m in lines] for k in _SERIES if any(k in m for m in lines)})
    out["val_loss"] = _val(run)
    return out


def _markdown_a(args, runs, c, tokens) -> list[str]:
    moe, dense = runs["moe"], runs["dense"]
    steps = [s for s, _ in _val(moe)]
    out = ["## (a) Quality at equal compute: moe-tiny vs dense with the same active parameters",
           "",
           f"One process, {args.steps} steps x {args.batch} sequences x {args.seq_len} tokens = "
           f"**{tokens:,} training tokens** each, the same data order (seed {args.seed}), "
           "AdamW (meshfit train's defaults: lr 3e-3, warm-up then cosine); validation: "
           f"{args.eval_batches} batches of {args.batch} x {args.seq_len} tokens of the "
           "held-out split.", "",
           "| model | parameters (total) | active per token | FLOPs per token | "
           + " | ".join(f"val loss @ {s}" for s in steps) + " | last train loss | wall s |",
           "|---|---:|---:|---:|" + "---:|" * len(steps) + "---:|---:|"]
    for label, run, total, active, flops in (
            ("moe-tiny (8 experts, top-2, aux 0.01)", moe, c["moe_total"], c["moe_active"],
             c["moe_flops_per_token"]),
            (f"dense (moe-tiny, n_experts=0, d_ff={c['dense_d_ff']})", dense,
             c["dense_total"], c["dense_total"], c["dense_flops_per_token"])):
        vals = dict(_val(run))
        out.append(f"| {label} | {total:,} | {active:,} | {flops:,} | "
                   + " | ".join(f"{vals[s]:.4f}" for s in steps)
                   + f" | {_train_lines(run)[-1]['loss']:.4f} | {run['wall_s']:.0f} |")
    diff = _val(moe)[-1][1] - _val(dense)[-1][1]
    out += ["", f"Active parameters: {c['moe_active']:,} (MoE) vs {c['dense_total']:,} (dense, "
            f"{(c['dense_total'] - c['moe_active']) / c['moe_active']:+.3%}); the MoE holds "
            f"{c['moe_total'] / c['moe_active']:.2f}x as many parameters in all. Final "
            f"validation loss: MoE {_val(moe)[-1][1]:.4f}, dense {_val(dense)[-1][1]:.4f} "
            f"(MoE {diff:+.4f}). One seed each: how far another seed or data order would "
            "move these losses was not measured here.", "",
            f"Commands: `{moe['command']}` and `{dense['command']}`.", ""]
    return out


def _balance(run: dict) -> dict:
    lines = _train_lines(run)
    cv = [m["moe_tokens_per_expert_cv"] for m in lines]
    q = max(1, len(cv) // 4)
    return {"cv": cv, "cv_mean": statistics.fmean(cv), "cv_median": statistics.median(cv),
            "cv_first_quarter": statistics.fmean(cv[:q]), "cv_last_quarter":
            statistics.fmean(cv[-q:]), "cv_last": cv[-1],
            "min_last": lines[-1]["moe_tokens_per_expert_min"],
            "max_last": lines[-1]["moe_tokens_per_expert_max"],
            "aux_last": lines[-1]["moe_aux_loss"], "val_loss": _val(run)[-1][1],
            "dropped_max": max(m["moe_dropped_fraction"] for m in lines)}


def _markdown_d(args, runs, balance) -> list[str]:
    assigned = args.batch * args.seq_len * 2  # tokens x top-2 assignments per block
    out = ["## (d) Load balance with and without the auxiliary loss", "",
           "Coefficient of variation of tokens per expert (std / mean over the 8 experts of a "
           "block, mean over the 4 blocks; 0 = perfectly even) at every step "
           f"(`moe_tokens_per_expert_cv`; each step routes {args.batch * args.seq_len:,} "
           f"tokens x top-2 = {assigned:,} assignments per block, {assigned // 8:,} per "
           "expert if even). Same runs as (a) for the default; the other differs only in "
           "aux_loss_coef. Dropless routing (no capacity): nothing is dropped either way.", "",
           "| aux_loss_coef | CV mean over training | first quarter | last quarter | last step "
           "| tokens per expert at the last step (min-max) | aux loss (last) | final val "
           "loss |", "|---|---:|---:|---:|---:|---|---:|---:|"]
    for label, name in (("0.01 (default)", "moe"), ("0", "moe_no_aux")):
        b = balance[name]
        out.append(f"| {label} | {b['cv_mean']:.3f} | {b['cv_first_quarter']:.3f} | "
                   f"{b['cv_last_quarter']:.3f} | {b['cv_last']:.3f} | {b['min_last']}-"
                   f"{b['max_last']} | {b['aux_last']:.4f} | {b['val_loss']:.4f} |")
    series = ["", "CV every ~10% of training (step: default / without):", ""]
    a, b = balance["moe"]["cv"], balance["moe_no_aux"]["cv"]
    picks = sorted({min(len(a) - 1, round(i * (len(a) - 1) / 10)) for i in range(11)})
    series.append(", ".join(f"{i + 1}: {a[i]:.2f} / {b[i]:.2f}" for i in picks))
    series += ["", "(With aux_loss_coef 0 the reported aux loss is the router z-loss alone.) "
               f"Command of the second run: `{runs['moe_no_aux']['command']}`.", ""]
    return out + series


# ---------------------------------------------------------------------------- (b)
def part_b(args, work: Path) -> tuple[list[str], dict]:
    gpus = cuda_devices()
    cpu = gpus < NPROC
    out_json = work / "memory.json"
    cmd = [*MESHFIT, "launch", "--nproc", str(NPROC), str(Path(__file__).resolve()),
           "--memory-worker", str(out_json), "--seq-len", str(args.seq_len),
           "--batch", str(args.batch)]
    print("$ meshfit " + " ".join(cmd[3:]), flush=True)
    started = time.time()
    proc = subprocess.run(cmd, env=_env(cpu), capture_output=True, text=True,
                          timeout=args.timeout)
    if proc.returncode:
        raise SystemExit(f"the memory workers failed ({proc.returncode}):\n"
                         f"{proc.stderr[-3000:]}")
    rows = json.loads(out_json.read_text())
    wall = time.time() - started
    for r in rows:
        print(f"  ZeRO-{r['zero_stage']} ep {r['ep']}: states {r['states'] / MiB:.3f} MiB "
              f"(estimate {r['est_states'] / MiB:.3f}), peak {r['peak'] / MiB:.2f} MiB "
              f"(estimate {r['est_total'] / MiB:.2f})", flush=True)
    return _markdown_b(args, rows, cpu, wall), {"rows": rows, "wall_s": wall, "cpu": cpu}


def _markdown_b(args, rows, cpu, wall) -> list[str]:
    from meshfit.memory import ModelShape

    shape = ModelShape.of("moe-tiny")
    micro = args.batch // NPROC
    spread_states = max(max(r["per_rank_states"]) - min(r["per_rank_states"]) for r in rows)
    spread_peak = max(max(r["per_rank_peak"]) - min(r["per_rank_peak"]) for r in rows)
    out = ["## (b) Per-rank bytes of ep 1/2/4 on 4 processes (dp_shard 4): measured vs "
           "estimate", "",
           f"moe-tiny ({shape.params:,} parameters, of which routed experts "
           f"{shape.expert_params:,} = 4 blocks x 8 x 3 x 128 x 256), fp32 AdamW, "
           f"{micro} x {args.seq_len} tokens per rank, "
           f"{'CPU, gloo' if cpu else 'CUDA, NCCL'}; the worst of the 4 ranks (their states "
           f"agree within {spread_states:,.0f} bytes; their peaks differ by up to "
           f"{spread_peak / MiB:.1f} MiB under ep, each rank receiving the rows routed to its "
           "experts: the range is in brackets). States = parameters + gradients + optimizer "
           "state "
           "(`rank_report`, local shards, gradients held); estimate = `estimate(ModelShape."
           f"of('moe-tiny'), LayoutSpec(dp_shard=4, ep=E, zero_stage=Z, micro_batch_size="
           f"{micro}), seq_len={args.seq_len})`. Peak = states + the largest net allocation "
           "of one forward and backward (the profiler's allocation events; on CUDA the "
           "allocator's peak); its estimate adds activations (a dense MLP of width d_ff "
           "per block: the MoE's top-2 expert activations and routing tensors are not in "
           "the estimate yet) and buffers (gathered parameters: under ep only this rank's "
           f"experts). Took {wall:.0f} s.", "",
           "| layout | engine | params MiB | grads MiB | optimizer MiB | states MiB "
           "(estimate) | states error | step peak MiB [ranks] (estimate = states + activations + "
           "buffers) | "
           "peak error |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(
            f"| ZeRO-{r['zero_stage']}, ep {r['ep']} | {r['engine']} | "
            f"{r['params'] / MiB:.3f} | {r['grads'] / MiB:.3f} | {r['optimizer'] / MiB:.3f} | "
            f"{r['states'] / MiB:.3f} ({r['est_states'] / MiB:.3f}) | "
            f"{(r['est_states'] - r['states']) / r['states']:+.3%} | {r['peak'] / MiB:.2f} "
            f"[{min(r['per_rank_peak']) / MiB:.2f}-{max(r['per_rank_peak']) / MiB:.2f}] "
            f"({r['est_total'] / MiB:.2f}: {r['est_activations'] / MiB:.2f} + "
            f"{r['est_buffers'] / MiB:.2f}) | {(r['est_total'] - r['peak']) / r['peak']:+.1%} |")
    out += ["", "At rest a rank holds 1/4 of the experts' states for every ep under FSDP2 (ep "
            "splits them ep ways, FSDP2 shards each part over the 4/ep ranks holding the same "
            "experts), so ep does not change the states at ZeRO-3; at ZeRO-1 it changes the "
            "engine (ep > 1 runs on FSDP2, whose parameters and gradients are sharded at "
            "rest; ep 1 is DDP + ZeroRedundancyOptimizer with whole parameters and "
            "gradients). What ep saves in the estimate is in the step: the experts FSDP2 "
            "gathers (a block's n_experts / ep; none at ep = dp_shard, where FSDP2 leaves "
            "them out). The peak column's error is mostly the MoE activations the estimate "
            "does not count yet (the routed copies of the input rows, each assignment's four "
            "f-wide SwiGLU tensors, the expert outputs and their weighted copies: about 1,800 "
            "fp32 elements per token and block more than a dense MLP of width d_ff, ~14 MiB "
            "here by that count).", ""]
    z3 = {r["ep"]: r for r in rows if r["zero_stage"] == 3}
    if set(EPS) <= set(z3):
        mean = {ep: statistics.fmean(z3[ep]["per_rank_peak"]) / MiB for ep in EPS}
        est = {ep: z3[ep]["est_total"] / MiB for ep in EPS}
        out[-1:] = [f"At ZeRO-3 the estimate's peak falls by {est[1] - est[2]:.1f} and "
                    f"{est[2] - est[4]:.1f} MiB from ep 1 to 2 to 4; the ranks' mean measured "
                    f"peak by {mean[1] - mean[2]:.1f} and {mean[2] - mean[4]:.1f} MiB "
                    f"({mean[1]:.1f}, {mean[2]:.1f}, {mean[4]:.1f}).", ""]
    return out


def memory_worker(path: str, seq_len: int, batch: int) -> None:
    """Runs on each of the 4 ranks (meshfit launch): every (ZeRO stage, ep) of (b)."""
    from meshfit import Accelerator

    rows = [_measure_layout(stage, ep, seq_len, batch // NPROC)
            for stage in (1, 3) for ep in EPS]
    acc = Accelerator()
    if acc.is_main_process:
        Path(path).write_text(json.dumps(rows, indent=1))
    acc.end_training()


def _measure_layout(stage: int, ep: int, seq_len: int, micro: int) -> dict:
    """One layout of (b), measured as tests/memory/test_estimate_measured.py measures; the worst
    rank's figures beside the estimate."""
    import torch

    from meshfit import Accelerator, ParallelDims
    from meshfit.memory import LayoutSpec, ModelShape, estimate, net_peak_bytes, rank_report
    from meshfit.models import GPT, GPTConfig

    acc = Accelerator(parallel=ParallelDims(dp_shard=NPROC, ep=ep), zero_stage=stage)
    torch.manual_seed(0)
    model = acc.prepare(GPT(GPTConfig.preset("moe-tiny", max_seq_len=seq_len)))
    opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(acc.process_index)
    tokens = torch.randint(0, 256, (micro, seq_len + 1), generator=g).to(acc.device)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def forward_backward():
        with acc.accumulate():
            acc.backward(model(x, y))

    forward_backward()
    opt.step()
    forward_backward()  # gradients kept: the step's working set
    report = rank_report(model, opt)
    if acc.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        forward_backward()
        torch.cuda.synchronize()
        peak = report.total_bytes + torch.cuda.max_memory_allocated() - before
    else:
        peak = report.total_bytes + min(net_peak_bytes(forward_backward) for _ in range(2))
    est = estimate(ModelShape.of("moe-tiny"), LayoutSpec(
        dp_shard=NPROC, ep=ep, zero_stage=stage, micro_batch_size=micro),
        seq_len=seq_len, dtype="fp32", attention="flash")
    mine = torch.tensor([report.param_bytes, report.grad_bytes, report.optimizer_bytes,
                         report.total_bytes, peak], dtype=torch.float64, device=acc.device)
    everyone = acc.gather(mine.reshape(1, -1)).reshape(-1, 5).cpu()
    worst = everyone[everyone[:, 4].argmax()].tolist()
    opt.zero_grad()
    acc.wait_for_everyone()
    return {"zero_stage": stage, "ep": ep, "engine": acc.layout.describe(),
            "params": worst[0], "grads": worst[1], "optimizer": worst[2],
            "states": worst[0] + worst[1] + worst[2], "peak": worst[4],
            "per_rank_states": (everyone[:, 0] + everyone[:, 1] + everyone[:, 2]).tolist(),
            "per_rank_peak": everyone[:, 4].tolist(),
            "est_params": est.params, "est_grads": est.grads, "est_optimizer": est.optimizer,
            "est_states": est.params + est.grads + est.optimizer,
            "est_activations": est.activations, "est_buffers": est.buffers,
            "est_total": est.total}


# ---------------------------------------------------------------------------- (c)
def part_c(args, work: Path) -> tuple[list[str], dict]:
    cpu = cuda_devices() < NPROC
    base = [*_common_overrides(args), "--train.eval_every=0", "--model.preset=moe-tiny",
            "--parallel.dp_shard=4", "--parallel.dp_replicate=1"]
    base = [o for o in base if not o.startswith(("--train.steps=", "--train.micro_batch"))]
    # A stalled collective fails the run after 60 s (steps take ~1 s here) rather than 300.
    base += [f"--train.steps={args.time_steps}",
             f"--train.micro_batch_size={args.batch // NPROC}", "--train.timeout_s=60"]
    rows = []
    for ep in EPS:
        run = train(work / f"ep{ep}", NPROC, [*base, f"--parallel.ep={ep}"], cpu=cpu,
                    timeout=args.timeout, may_fail=True)
        lines = [m for m in _train_lines(run) if m["step"] > args.warmup]
        times = [m["step_time_s"] for m in lines]
        a2a = [m["moe_a2a_s"] for m in lines]
        share = [m["moe_a2a_share"] for m in lines if "moe_a2a_share" in m]
        cv = [m["moe_tokens_per_expert_cv"] for m in lines]
        row = {"ep": ep, "run": _compact(run), "command": run["command"],
               "banner": run["banner"],
               "wall_s": run["wall_s"], "failed": run["failed"],
               "last_step": max((m["step"] for m in _train_lines(run)), default=0),
               "steps": len(times), "step_s": times, "a2a_s": a2a, "a2a_share": share,
               "median_step_s": statistics.median(times) if times else None,
               "median_a2a_s": statistics.median(a2a) if a2a else None,
               "median_a2a_share": statistics.median(share) if share else None,
               "share_steps": len(share), "cv_median": statistics.median(cv) if cv else None}
        rows.append(row)
        print(f"  ep {ep}: median step {_num(row['median_step_s'])} s, all-to-all "
              f"{_num(row['median_a2a_s'])} s ({_pct(row['median_a2a_share'])})", flush=True)
    return _markdown_c(args, rows, cpu), {"rows": rows, "cpu": cpu}


def _num(x, digits: int = 3) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def _pct(x) -> str:
    return "—" if x is None else f"{x:.1%}"


def _markdown_c(args, rows, cpu) -> list[str]:
    base = rows[0]["median_step_s"]
    steps = f"steps {args.warmup + 1}-{args.time_steps}"
    out = ["## (c) Step time of ep 1/2/4 on 4 processes, and the all-to-all share", "",
           f"`meshfit train --nproc 4`, moe-tiny, dp_shard 4 (ZeRO-3, FSDP2), global batch "
           f"{args.batch} x {args.seq_len} tokens ({args.batch // NPROC} sequences per rank), "
           f"{args.time_steps} steps, medians over {steps} "
           f"(metrics.jsonl, one line per step). All-to-all: `moe_a2a_s` (the slowest rank's "
           "seconds in expert-parallel exchanges in the step, forward and backward) and "
           "`moe_a2a_share` (that / the step's wall time). "
           + ("4 processes on 2 CPU cores oversubscribe them (gloo): the figures show the "
              "structure, not what GPUs would do." if cpu else
              "On CUDA the exchanges are timed (synchronising) for the first 5 steps only."),
           "", "| ep | median step s | vs ep 1 | median all-to-all s | median all-to-all share "
           "| steps | experts CV (median) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = f"{r['median_step_s'] / base:.2f}x" if r["median_step_s"] and base else "—"
        note = f" (stopped after step {r['last_step']}: see below)" if r["failed"] else ""
        out.append(f"| {r['ep']} | {_num(r['median_step_s'])} | {ratio} | "
                   f"{_num(r['median_a2a_s'])} | {_pct(r['median_a2a_share'])} | "
                   f"{r['steps']}{note} | {_num(r['cv_median'])} |")
    for r in (r for r in rows if r["failed"]):
        out += ["", f"**ep {r['ep']} did not finish**: {r['failed'].rstrip('.')}. Its figures are the "
                "medians of the steps it completed."]
    command = rows[0]["command"].replace("--out ep1", "--out epE").replace(
        "--parallel.ep=1", "--parallel.ep=E")
    out += ["", f"Command (E = {', '.join(str(r['ep']) for r in rows)}): `{command}`. On gloo "
            "an exchange's seconds include waiting for the last rank to reach it, so with "
            "ranks sharing cores the share counts imbalance as well as transfer.", ""]
    return out


# ---------------------------------------------------------------------------- main
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", nargs="+", default=["a", "b", "c", "d"],
                   choices=["a", "b", "c", "d"])
    p.add_argument("--steps", type=int, default=400, help="(a), (d): optimizer steps per run")
    p.add_argument("--batch", type=int, default=16, help="sequences per optimizer step")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-steps", type=int, default=12, help="(c): steps per ep")
    p.add_argument("--warmup", type=int, default=2, help="(c): first steps left out")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    p.add_argument("--work", default=None, help="run folders (default: a temporary folder)")
    p.add_argument("--memory-worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    if args.memory_worker:
        memory_worker(args.memory_worker, args.seq_len, args.batch)
        return 0
    work = Path(args.work or tempfile.mkdtemp(prefix="meshfit-moe-"))
    work.mkdir(parents=True, exist_ok=True)
    info = machine_info()
    info["cuda_devices"] = cuda_devices()
    info["tree"] = tree_state()
    parts = set(args.parts)
    started = time.time()
    sections, payload = {}, {"command": "python benchmarks/moe.py " + " ".join(sys.argv[1:]),
                             "machine": info, "args": vars(args)}
    if parts & {"a", "d"}:
        md, payload["a_d"] = part_a_d(args, work, parts)
        sections["ad"] = md
    if "b" in parts:
        md, payload["b"] = part_b(args, work)
        sections["b"] = md
    if "c" in parts:
        md, payload["c"] = part_c(args, work)
        sections["c"] = md
    info["loadavg_at_end"] = list(os.getloadavg())
    info["tree_at_end"] = tree_state()
    payload["seconds"] = time.time() - started
    ad = sections.get("ad", [])
    split = next((i for i, x in enumerate(ad) if x.startswith("## (d)")), len(ad))
    body = [*ad[:split], *sections.get("b", []), *sections.get("c", []), *ad[split:]]
    command = "python benchmarks/moe.py" + (" " + " ".join(sys.argv[1:]) if sys.argv[1:]
                                            else "")
    markdown = "\n".join(["# Mixture of experts: quality, expert-parallel memory and time, "
                          "load balance", "", f"Command: `{command}` (took "
                          f"{payload['seconds'] / 60:.1f} min)", "", machine_markdown(info), "",
                          _machine_note(info), "", *body])
    print(markdown)
    if not args.no_write:
        md_path, js_path = write_results("moe", markdown, json.loads(json.dumps(
            payload, default=str)))
        print(f"wrote {md_path} and {js_path}")
    return 0


def _machine_note(info) -> str:
    def describe(tree) -> str:
        changed = (f" with src/ files changed from it: {', '.join(tree['src_changed'])}"
                   if tree["src_changed"] else ", src/ as committed")
        return f"commit {tree['commit']}{changed}"

    start, end = info["tree"], info.get("tree_at_end", info["tree"])
    text = f"Working tree (the runs import meshfit from it): {describe(start)}"
    text += ", the same at the end." if end == start else \
        f" at the start; {describe(end)} at the end."
    return text + "\n\n" + _device_note(info)


def _device_note(info) -> str:
    if info["cuda_devices"]:
        return (f"{info['cuda_devices']} CUDA device(s): (a) and (d) ran on one; (b) and (c) "
                + ("on 4." if info["cuda_devices"] >= NPROC else "on the CPU (gloo), fewer "
                   "than 4 devices."))
    return (f"CPU only ({info['logical_cores']} cores, gloo, torch {info['torch']}), one "
            "thread per process (OMP_NUM_THREADS=1 in every run): (a) and (d) run in one "
            "process; (b) and (c) start 4 processes on these 2 cores, which oversubscribes "
            "them. Other jobs shared the machine (the load average above).")


if __name__ == "__main__":
    raise SystemExit(main())
