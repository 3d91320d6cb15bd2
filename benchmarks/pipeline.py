"""Pipeline parallel: step time and bubble against micro-batches ("chunks"), per schedule.

For every schedule of `meshfit.parallel.pp` (gpipe, 1f1b, interleaved_1f1b, zero_bubble) and
m = 1, 2, 4, 8, 16 micro-batches, the reference GPT trains on one FIXED global batch (16
sequences by default, so a micro-batch holds 16/m of them) across the P processes of the
launch. Per (schedule, m):

* step time: `Pipeline.step` (forward + backward of the whole batch, tied-embedding gradient
  sum, loss broadcast; no optimizer step), wall clock from a barrier to the step's end, the
  slowest rank per step, median over the measured steps;
* measured bubble: from the per-micro-batch forward/backward intervals every stage records
  (`record_timings=True`), `bubble_ratio` = idle / busy and `bubble_fraction` = idle /
  (ranks x step span), over the measured steps. "Idle" is everything between the step's
  first and last recorded compute that is not compute: waiting, and the gloo sends/receives;
* theory: `theoretical_bubble` (Megatron-LM, Narayanan et al. 2021, sec. 2.2): (P-1)/m for
  GPipe and 1F1B, (P-1)/(v m) interleaved, 0 for ZB-V (Qi et al. 2024); fraction r/(1+r);
* speed-up against naive model parallelism = gpipe with m=1 (one rank works at a time), and
  beside it the whole model in one process (rank 0 alone, the others waiting), the work a
  perfect pipeline divides by P.

Combinations `check_pipeline` refuses (1f1b needs m >= P, ...) are listed with the reason.
Variants run interleaved in rounds (order rotated) inside one launch, so machine drift hits all
of them. Each rank runs one thread (`torch.set_num_threads(1)`): 2 processes fill this 2-core
machine, 4 oversubscribe it, so on 4 the figure of interest is the bubble structure, not the
absolute speed. Nothing here asserts.

    meshfit launch --nproc 2 benchmarks/pipeline.py      # results/pipeline_2ranks.{md,json}
    meshfit launch --nproc 4 benchmarks/pipeline.py      # results/pipeline_4ranks.{md,json}
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

from meshfit import distributed  # noqa: E402
from meshfit.parallel import pp  # noqa: E402

NAIVE = ("gpipe", 1)
SINGLE = ("single process", 0)  # the whole model on rank 0, no pipeline
PHASE_CHAR = {"forward": "F", "backward": "B", "backward_input": "I", "backward_weight": "W"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--schedules", default=",".join(pp.SCHEDULES))
    p.add_argument("--chunks", default="1,2,4,8,16", help="micro-batch counts m")
    p.add_argument("--global-batch", type=int, default=16,
                   help="sequences per step, split into m micro-batches")
    p.add_argument("--warmup", type=int, default=2,
                   help="unmeasured steps per variant before the rounds (the first also "
                        "infers shapes)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    p.add_argument("--steps-per-round", type=int, default=3)
    p.add_argument("--gantt-chunks", type=int, default=4,
                   help="m of the per-schedule timelines printed in the results")
    p.add_argument("--tag", default="", help="suffix of the results files")
    p.add_argument("--no-write", action="store_true", help="print only; write no results files")
    g = p.add_argument_group("model (GPTConfig.preset('tiny') with these overrides)")
    g.add_argument("--d-model", type=int, default=128)
    g.add_argument("--n-layer", type=int, default=8)
    g.add_argument("--n-head", type=int, default=4)
    g.add_argument("--d-ff", type=int, default=512)
    g.add_argument("--seq-len", type=int, default=64)
    g.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- variants
def plan(args, world: int) -> tuple[list[tuple[str, int]], dict]:
    """The (schedule, m) pairs to run and the refused ones with check_pipeline's reason."""
    run, refused = [], {}
    for schedule in args.schedules.split(","):
        for m in (int(c) for c in args.chunks.split(",")):
            try:
                pp.check_pipeline(args.n_layer, world, schedule=schedule, microbatches=m,
                                  batch_size=args.global_batch)
                run.append((schedule, m))
            except ValueError as err:
                refused[(schedule, m)] = str(err)
    if NAIVE not in run:
        raise SystemExit("the naive baseline (gpipe, m=1) must be among the variants")
    return run, refused


class Single:
    """The whole model in one process (rank 0); the other ranks wait at the next barrier."""

    def __init__(self, model, rank: int):
        self.model, self.rank = (model if rank == 0 else None), rank

    def step(self, x, y):
        if self.model is not None:
            self.model(x, y).backward()

    def parameters(self):
        return self.model.parameters() if self.model is not None else iter(())


def timed_steps(runner, x, y, n: int) -> list[float]:
    out = []
    for _ in range(n):
        dist.barrier()
        t0 = time.perf_counter()
        runner.step(x, y)
        out.append(time.perf_counter() - t0)
        for p in runner.parameters():
            p.grad = None
    return out


def analyse(name, m, timings, steps: list[int], world: int, v: int) -> dict:
    """Bubble figures over the measured `steps` of every rank's `timings`."""
    mine = [t for t in timings if t["step"] in set(steps)]
    phases = defaultdict(list)
    for t in mine:
        phases[t["phase"]].append(t["end"] - t["start"])
    theory = pp.theoretical_bubble(name, world, m, v)
    busy = sum(t["end"] - t["start"] for t in mine) / (world * len(steps))
    return dict(bubble_ratio=pp.bubble_ratio(mine), bubble_fraction=pp.bubble_fraction(mine),
                busy_ms_per_rank=1e3 * busy,
                theory_ratio=theory, theory_fraction=theory / (1 + theory),
                phase_median_ms={k: 1e3 * statistics.median(d) for k, d in phases.items()})


def gantt(timings, step: int, world: int, width: int) -> list[str]:
    """One text row per rank over the step's span: F forward, B backward, I backward-input,
    W backward-weight, '.' idle; the cell shows what covers its midpoint."""
    mine = [t for t in timings if t["step"] == step]
    t0, t1 = min(t["start"] for t in mine), max(t["end"] for t in mine)
    dt = (t1 - t0) / width
    rows = []
    for r in range(world):
        cells = []
        for c in range(width):
            mid = t0 + (c + 0.5) * dt
            hit = [t for t in mine if t["rank"] == r and t["start"] <= mid < t["end"]]
            cells.append(PHASE_CHAR[hit[0]["phase"]] if hit else ".")
        rows.append(f"rank {r} |{''.join(cells)}|")
    return rows + [f"span {1e3 * (t1 - t0):.0f} ms, {width} columns of {1e3 * dt:.1f} ms"]


# ----------------------------------------------------------------------------- main
def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    env = distributed.init(cpu=True)
    world, rank = env.world_size, env.rank
    if world < 2:
        raise SystemExit("pipeline.py needs 2+ processes: meshfit launch --nproc 2 "
                         "benchmarks/pipeline.py")
    info = _common.machine_info()
    info["concurrency_slowdown"] = _common.concurrency_slowdown(world, rank)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    cfg = _common.model_config(args)
    full = _common.build_model(cfg, args.seed)  # same weights on every rank
    g = torch.Generator().manual_seed(args.seed + 1)
    tokens = torch.randint(0, cfg.vocab_size, (args.global_batch, args.seq_len + 1), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    variants, refused = plan(args, world)
    runners = {SINGLE: Single(full, rank)}
    for schedule, m in variants:
        runners[(schedule, m)] = pp.build_pipeline(full, mesh, schedule=schedule,
                                                   microbatches=m, record_timings=True)
    keys = list(runners)
    first = runners[NAIVE]
    if rank == 0:
        print(f"pipeline: {world} processes, GPT {cfg.num_params() / 1e6:.2f}M params "
              f"({cfg.n_layer} blocks, split {first.points}), global batch "
              f"{args.global_batch} x {args.seq_len} tokens; {len(variants)} variants, "
              f"{len(refused)} refused", flush=True)

    t_start = time.perf_counter()
    measured_from = {}
    for k in keys:  # warm-up, not measured (a pipeline's step 0 infers shapes)
        timed_steps(runners[k], x, y, args.warmup)
        measured_from[k] = args.warmup
    times = {k: [] for k in keys}
    for r in range(args.rounds):
        order = keys[r % len(keys):] + keys[:r % len(keys)]
        for k in order:
            times[k] += timed_steps(runners[k], x, y, args.steps_per_round)
        if rank == 0:
            print(f"  round {r + 1}/{args.rounds} done ({time.perf_counter() - t_start:.0f} s)",
                  flush=True)
    sweep_s = time.perf_counter() - t_start

    # The slowest rank's time per step (they end together: the loss is broadcast last).
    rows = {}
    n_measured = args.rounds * args.steps_per_round
    for k in keys:
        per_rank = _common.gather_floats(times[k])
        slowest = [max(col) for col in zip(*per_rank)]
        row = dict(schedule=k[0], microbatches=k[1], step_s=statistics.median(slowest),
                   step_s_all=slowest, step_s_rank0=per_rank[0])
        if k != SINGLE:
            pipe = runners[k]
            steps = list(range(measured_from[k], measured_from[k] + n_measured))
            timings = pp.gather_timings(pipe)
            v = len(pipe.stage_indices)
            row.update(analyse(k[0], k[1], timings, steps, world, v), virtual_stages=v,
                       micro_batch=args.global_batch // k[1], points=pipe.points)
            # The timeline of the measured step whose span is the median one.
            spans = sorted((max(t["end"] for t in timings if t["step"] == s)
                            - min(t["start"] for t in timings if t["step"] == s), s)
                           for s in steps)
            row["gantt"] = gantt(timings, spans[len(spans) // 2][1], world, 96) \
                if k[1] == args.gantt_chunks or k == NAIVE else None
        rows[k] = row
    naive = rows[NAIVE]["step_s"]
    for row in rows.values():
        row["speedup_vs_naive"] = naive / row["step_s"]
    info["loadavg_at_end"] = list(os.getloadavg())

    if rank == 0:
        md = markdown(args, info, cfg, world, rows, refused, first.points, sweep_s)
        print(md)
        if not args.no_write:
            name = f"pipeline_{world}ranks{'_' + args.tag if args.tag else ''}"
            payload = dict(benchmark="pipeline", command=_common.launch_command(),
                           args=vars(args), n_params=cfg.num_params(), machine=info,
                           sweep_s=sweep_s,
                           rows=list(rows.values()),
                           refused=[dict(schedule=s, microbatches=m, reason=why)
                                    for (s, m), why in refused.items()])
            paths = _common.write_results(name, md, payload)
            print(f"wrote {paths[0]} and {paths[1]}")
    dist.barrier()
    dist.destroy_process_group()


def markdown(args, info, cfg, world, rows, refused, points, sweep_s) -> str:
    cores = info.get("affinity_cores") or info.get("logical_cores")
    over = world > (cores or world)
    n = args.rounds * args.steps_per_round
    out = [f"# Pipeline parallel on {world} processes: bubble and step time against chunks", "",
           f"Command: `{_common.launch_command()}`", "", _common.machine_markdown(info), ""]
    out += [f"Concurrency check: a single-thread matmul loop run by all {world} ranks at once "
            f"took {info['concurrency_slowdown']:.2f}x as long as on one rank alone (1.00 = "
            "independent cores); compute intervals stretch by about that much where ranks "
            "overlap, which idle time alone does not show.", ""]
    if over:
        out += [f"**{world} single-threaded processes on {cores} cores: oversubscribed.** Ranks "
                "share cores, so compute intervals stretch and the step times are not what "
                f"{world} free cores would give; read the bubble structure (measured beside "
                "theory, and the timelines), not the absolute speed.", ""]
    out += [f"Model: reference GPT, {cfg.num_params() / 1e6:.2f}M parameters, {cfg.n_layer} "
            f"blocks (d_model={cfg.d_model}, n_head={cfg.n_head}, d_ff={cfg.d_ff}, byte "
            f"vocabulary, tied embedding), fp32. Global batch {args.global_batch} x "
            f"{args.seq_len} tokens, the same every step; micro-batch = {args.global_batch}/m "
            f"sequences. Stages split by parameter count (`split_points`; {world} stages start "
            f"at blocks {points}). {args.warmup} warm-up steps per variant, then "
            f"{args.rounds} interleaved rounds x {args.steps_per_round} = {n} measured steps. "
            "Step = `Pipeline.step` (forward + backward, tied-gradient sum, loss broadcast; "
            "no optimizer step), slowest rank, median. Bubble from the recorded per-micro-batch "
            "compute intervals of the measured steps; idle includes gloo send/recv time. "
            "Theory: `theoretical_bubble` (idle/busy), fraction = r/(1+r). Speed-up: naive "
            "(gpipe, m=1) step time / this step time.", "",
            "| schedule | m | micro-batch | v | step s | speed-up vs naive | bubble idle/busy "
            "measured | theory | bubble fraction measured | theory | busy ms per rank | median "
            "ms per F / B (I / W) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    single = rows[SINGLE]
    for schedule in args.schedules.split(","):
        for m in (int(c) for c in args.chunks.split(",")):
            if (schedule, m) in refused:
                why = refused[(schedule, m)].split(" (")[0].split(";")[0]
                out.append(f"| {schedule} | {m} | {args.global_batch // m} | | n/a: {why} "
                           "| | | | | | | |")
                continue
            r = rows[(schedule, m)]
            ph = r["phase_median_ms"]
            parts = "/".join(f"{ph[p]:.1f}" for p in PHASE_CHAR if p in ph)
            label = f"{schedule} (naive MP)" if (schedule, m) == NAIVE else schedule
            out.append(f"| {label} | {m} | {r['micro_batch']} | {r['virtual_stages']} | "
                       f"{r['step_s']:.3f} | {r['speedup_vs_naive']:.2f}x | "
                       f"{r['bubble_ratio']:.3f} | {r['theory_ratio']:.3f} | "
                       f"{r['bubble_fraction']:.3f} | {r['theory_fraction']:.3f} | "
                       f"{r['busy_ms_per_rank']:.0f} | {parts} |")
    out += [f"| whole model, 1 process (rank 0; others wait) | 1 | {args.global_batch} | | "
            f"{single['step_s']:.3f} | {single['speedup_vs_naive']:.2f}x | | | | | | |", "",
            "Phases in the last column: F forward, B full backward (gpipe, 1f1b, interleaved), "
            "I / W backward split into input and weight parts (zero_bubble), each per micro-"
            "batch per stage. Busy ms per rank: recorded compute per rank per step (the work "
            "a rank does grows as micro-batches shrink: smaller matrix products, more calls).",
            "", "The theory column is Megatron-LM's closed form as `theoretical_bubble` returns "
            "it. It is exact for GPipe at any m, and assumes m >= P for 1F1B/interleaved; with "
            f"fewer micro-batches than stages (interleaved m < {world}) the step is partly "
            "sequential and cannot reach it. ZB-V's 0 is its ideal for large m with forward, "
            "input-backward and weight-backward of equal length; at m=1 one micro-batch still "
            "crosses the stages one after another.", ""]
    timelines = [(k, r) for k, r in rows.items() if r.get("gantt")]
    if timelines:
        out += ["## Timelines of one measured step (the step with the median span)", "",
                "F forward, B backward, I backward-input, W backward-weight, `.` idle "
                "(waiting or communicating).", ""]
        for (schedule, m), r in timelines:
            out += [f"{schedule}, m={m}:", "", "```", *r["gantt"], "```", ""]
    out.append(f"Sweep time (warm-up + rounds, all variants): {sweep_s:.0f} s.")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
