"""Checkpoints and start-up, side by side with the peers: meshfit's `save_state` /
`load_state` against raw `torch.distributed.checkpoint` (DCP) of the same state and against
Accelerate's, `meshfit train`'s first step against a minimal torchrun script, `meshfit
launch` against torchrun itself, and the write and read speed of a large sharded state
against the disk's own.

    python benchmarks/checkpoint_speed.py                 # every part, 2 processes
    python benchmarks/checkpoint_speed.py --parts saveload,start --trials 5
    python benchmarks/checkpoint_speed.py --parts big --big-d-model 2048 --big-layers 20

Parts (each runs in processes of its own, started from here):

* ``saveload``: 2 processes (gloo), DDP, a Hugging Face Llama of about 25M parameters with
  AdamW state. Interleaved trials (each arm first in turn) of meshfit's ``save_state`` and
  of raw DCP's ``save`` of the same state: the model and optimizer state dicts
  (``get_state_dict``), each rank's RNG state and the step counters, under the keys meshfit
  writes; and of DCP's ``save`` of the model and optimizer alone. Then the loads: meshfit's
  ``load_state`` (the checks against the manifest, then the state); DCP's ``load`` then
  ``set_state_dict`` (and the RNG set). Medians.
* ``accelerate``: the same model and optimizer under Accelerate (``accelerate.Accelerator``,
  DDP on the same 2 processes, launched by torchrun): its ``save_state`` and ``load_state``.
* ``start``: wall time of ``meshfit train --nproc 2 --train.steps=1`` (the built-in corpus)
  against ``torchrun --nproc-per-node 2`` of a minimal script that builds the same reference
  GPT and takes one DDP step on the same batch size; and of ``meshfit launch --nproc 2``
  against ``torchrun --nproc-per-node 2`` of a script that only joins the process group.
  Interleaved, medians.
* ``big``: 2 processes, ZeRO-3, the reference GPT at about 1B parameters with AdamW state
  (`--big-d-model`, `--big-layers`): meshfit's save and load, and raw DCP's, as MB/s per
  rank, beside the disk's fsync'd sequential write and its read measured on the same folder.
  Which arm goes first alternates between trials; before the loads every file's pages are
  dropped from the page cache, so both read the disk.

Nothing asserts; results: benchmarks/results/checkpoint_speed.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

GiB, MiB = 2**30, 2**20
LLAMA = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=8, vocab_size=16000,
             max_position_embeddings=256, tie_word_embeddings=False)


# ---------------------------------------------------------------- workers (in processes)
def _llama(seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**LLAMA))


def _train_steps(model, opt, backward, device, steps: int = 2) -> None:
    import torch

    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randint(0, LLAMA["vocab_size"], (2, 64), generator=g).to(device)
        backward(model(input_ids=x, labels=x).loss)
        opt.step()
        opt.zero_grad()


def _timed(fn) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def worker_saveload(args) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from meshfit import Accelerator
    from meshfit.checkpoint.state import rng_state, set_rng_state

    acc = Accelerator(mixed_precision="no")
    model = acc.prepare(_llama())
    opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-4))
    _train_steps(model, opt, acc.backward, acc.device)
    inner, inner_opt = acc.unwrap_model(model), opt.optimizer
    root = Path(args.dir)
    arms = ("meshfit", "dcp", "dcp_mo")
    times: dict[str, list[float]] = {f"{a}_{op}": [] for a in arms for op in ("save", "load")}

    def dcp_state(everything: bool) -> dict:
        """What meshfit writes (`everything`: model, optimizer, this rank's RNG and the step
        counters, under meshfit's keys), or the model and optimizer alone."""
        m, o = get_state_dict(inner, inner_opt)
        state = {"model": m, "optimizer": o}
        if everything:
            state["rng"] = {f"rank{dist.get_rank()}": rng_state()}
            state["accelerator"] = {"optimizer_steps": 2, "micro_step": 0, "step": 2}
        return state

    def dcp_save(folder, everything):
        dcp.save(dcp_state(everything), checkpoint_id=str(folder))

    def dcp_load(folder, everything):
        state = dcp_state(everything)
        dcp.load(state, checkpoint_id=str(folder))
        set_state_dict(inner, inner_opt, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        if everything:
            set_rng_state(state["rng"][f"rank{dist.get_rank()}"])

    ops = {"meshfit": (lambda f: acc.save_state(f), lambda f: acc.load_state(f)),
           "dcp": (lambda f: dcp_save(f, True), lambda f: dcp_load(f, True)),
           "dcp_mo": (lambda f: dcp_save(f, False), lambda f: dcp_load(f, False))}
    for trial in range(args.trials):
        folders = {a: root / f"{a}-{trial}" for a in arms}
        order = arms[trial % 3:] + arms[:trial % 3]  # (each arm first in turn)
        for slot, op in enumerate(("save", "load")):
            for arm in order:
                times[f"{arm}_{op}"].append(_timed(lambda: ops[arm][slot](folders[arm])))
        if acc.is_main_process:
            for folder in folders.values():
                shutil.rmtree(folder)
        dist.barrier()
    params = sum(p.numel() for p in inner.parameters())
    acc.end_training()
    return {"params": params, "times": times}


def worker_accelerate(args) -> dict:
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    model = _llama()
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    _train_steps(model, opt, acc.backward, acc.device)
    root = Path(args.dir)
    times: dict[str, list[float]] = {"accelerate_save": [], "accelerate_load": []}
    for trial in range(args.trials):
        folder = root / f"accelerate-{trial}"
        times["accelerate_save"].append(_timed(lambda: acc.save_state(str(folder))))
        times["accelerate_load"].append(_timed(lambda: acc.load_state(str(folder))))
        if acc.is_main_process:
            shutil.rmtree(folder)
        dist.barrier()
    acc.end_training()
    return {"times": times}


def worker_big(args) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from meshfit import Accelerator, ParallelDims
    from meshfit.models import GPT, GPTConfig

    acc = Accelerator(parallel=ParallelDims(dp_replicate=1, dp_shard=2), zero_stage=3,
                      mixed_precision="no")
    cfg = GPTConfig.preset("tiny", d_model=args.big_d_model, n_layer=args.big_layers,
                           n_head=args.big_d_model // 128, d_ff=4 * args.big_d_model,
                           max_seq_len=64, dropout=0.0)
    torch.manual_seed(0)
    model = acc.prepare(GPT(cfg))
    opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-5))
    x = torch.randint(0, cfg.vocab_size, (1, 33))
    acc.backward(model(x[:, :-1], x[:, 1:]))
    opt.step()
    opt.zero_grad()
    root = Path(args.dir)
    inner, inner_opt = acc.unwrap_model(model), opt.optimizer
    times: dict[str, list[float]] = {k: [] for k in ("meshfit_save", "dcp_save",
                                                     "meshfit_load", "dcp_load")}
    first: dict[str, list[str]] = {"save": [], "load": []}

    def dcp_save(folder):  # (the state dicts' making counted, as in meshfit's save)
        m, o = get_state_dict(inner, inner_opt)
        dcp.save({"model": m, "optim": o}, checkpoint_id=str(folder))

    def dcp_load(folder):
        m, o = get_state_dict(inner, inner_opt)
        state = {"model": m, "optim": o}
        dcp.load(state, checkpoint_id=str(folder))
        set_state_dict(inner, inner_opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])

    written = 0
    for trial in range(-1, args.big_trials):  # (trial -1: a warm-up of each, not counted)
        folders = {"meshfit": root / f"big-meshfit-{trial}", "dcp": root / f"big-dcp-{trial}"}
        arms = {"meshfit": (lambda f: acc.save_state(f), lambda f: acc.load_state(f)),
                "dcp": (dcp_save, dcp_load)}
        # Which arm goes first alternates: the disk (a virtual one here) is measurably slower
        # right after a large write, for whichever arm comes second.
        order = ["meshfit", "dcp"] if trial % 2 == 0 else ["dcp", "meshfit"]
        for op, slot in (("save", 0), ("load", 1)):
            if op == "load":  # both read from the disk, not from the page cache
                for folder in folders.values():
                    _drop_cached(folder)
                dist.barrier()
            if trial >= 0:
                first[op].append(order[0])
            for arm in order:
                took = _timed(lambda: arms[arm][slot](folders[arm]))
                if trial >= 0:
                    times[f"{arm}_{op}"].append(took)
        written = sum(p.stat().st_size for p in folders["meshfit"].iterdir()
                      if p.name.startswith(f"__{acc.process_index}_"))
        if acc.is_main_process:
            for folder in folders.values():
                shutil.rmtree(folder)
        dist.barrier()
    params = sum(p.numel() for p in model.parameters())
    acc.end_training()
    return {"params": params, "bytes_per_rank": written, "times": times, "first": first}


def _drop_cached(folder: Path) -> None:
    """Drop the pages of this rank's files in `folder` from the page cache (they are clean:
    DCP fsync'd them), so that reading them goes to the disk."""
    import torch.distributed as dist

    rank = dist.get_rank()
    for path in folder.iterdir():
        if path.name.startswith(f"__{rank}_") or (rank == 0 and not path.name.startswith("__")):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


MINIMAL = '''
import os, time, torch, torch.distributed as dist
from meshfit.models import GPT, GPTConfig
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(GPT(GPTConfig.preset("tiny")))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randint(0, 256, (BATCH, SEQ + 1))
loss = model(x[:, :-1], x[:, 1:])
loss.backward(); opt.step()
print("first step", loss.item(), flush=True)
dist.destroy_process_group()
'''

JOIN = '''
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
'''


# ---------------------------------------------------------------- the driver
def _run(cmd: list[str], env: dict | None = None, cwd: str | None = None) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, cwd=cwd, stdout=subprocess.DEVNULL,
                   stderr=subprocess.PIPE)
    return time.perf_counter() - t0


def _worker(part: str, args, root: Path, launcher: str = "meshfit") -> dict:
    out = root / f"{part}.json"
    script = [str(Path(__file__).resolve()), "--worker", part, "--dir", str(root / part),
              "--out", str(out), "--trials", str(args.trials),
              "--big-d-model", str(args.big_d_model), "--big-layers", str(args.big_layers),
              "--big-trials", str(args.big_trials)]
    (root / part).mkdir(parents=True, exist_ok=True)
    if launcher == "meshfit":
        cmd = ["meshfit", "launch", "--nproc", "2", *script]
    else:
        cmd = ["torchrun", "--standalone", "--nproc-per-node", "2", *script]
    env = {**os.environ, "MESHFIT_CPU": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{part} failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def part_start(args, root: Path) -> dict:
    from meshfit.models import GPTConfig

    cfg = GPTConfig.preset("tiny")
    from meshfit.train.config import TrainConfig

    train = TrainConfig()
    batch = train.micro_batch_size
    minimal = root / "minimal.py"
    minimal.write_text(MINIMAL.replace("BATCH", str(batch)).replace("SEQ",
                                                                    str(train.seq_len)))
    join = root / "join.py"
    join.write_text(JOIN)
    env = {**os.environ, "MESHFIT_CPU": "1", "OMP_NUM_THREADS": "1"}
    torchrun = ["torchrun", "--standalone", "--nproc-per-node", "2"]
    arms = {
        "meshfit_train": lambda i: ["meshfit", "train", "--nproc", "2", "--train.steps=1",
                                    "--out", str(root / f"run-{i}")],
        "torchrun_minimal": lambda i: [*torchrun, str(minimal)],
        "meshfit_launch": lambda i: ["meshfit", "launch", "--nproc", "2", str(join)],
        "torchrun_join": lambda i: [*torchrun, str(join)],
    }
    _run(arms["meshfit_train"]("warm"), env)  # the token cache and the page cache, warm
    times: dict[str, list[float]] = {k: [] for k in arms}
    for i in range(args.trials):
        for name, cmd in arms.items():
            times[name].append(_run(cmd(i), env))
            shutil.rmtree(root / f"run-{i}", ignore_errors=True)
    return {"times": times, "model_params": cfg.d_model}


ASYNC_MODEL = ["--model.d_model=768", "--model.n_layer=6", "--model.n_head=12",
               "--train.micro_batch_size=4", "--train.global_batch_size=8",
               "--train.seq_len=64", "--train.eval_batches=1"]


def part_async(args, root: Path) -> dict:
    """Training time with a save every `--every` steps (synchronous, asynchronous by a thread
    and by a writer process) against
    none: the time from the first logged step to the last one before the end (the final
    save and the evaluation left out), interleaved trials."""
    steps, every = args.async_steps, args.every
    env = {**os.environ, "MESHFIT_CPU": "1"}
    arms = {"none": [], "sync": [f"--checkpoint.every={every}"],
            "async": [f"--checkpoint.every={every}", "--checkpoint.async=true"],
            "async-process": [f"--checkpoint.every={every}", "--checkpoint.async=true",
                              "--checkpoint.async_mode=process"]}
    times: dict[str, list[float]] = {k: [] for k in arms}
    for trial in range(args.async_trials):
        for name, extra in arms.items():
            out = root / f"async-{name}-{trial}"
            subprocess.run(["meshfit", "train", "--nproc", "2", f"--train.steps={steps}",
                            "--train.log_every=10", f"--train.eval_every={steps}",
                            "--out", str(out), *ASYNC_MODEL, *extra], check=True, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
            logged = [x for x in lines if "loss" in x and x["step"] < steps]
            times[name].append((logged[-1]["time"] - logged[0]["time"])
                               / (logged[-1]["step"] - logged[0]["step"]))
            shutil.rmtree(out, ignore_errors=True)
    return {"times": times, "steps": steps, "every": every}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default="saveload,accelerate,start,async,big")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--big-d-model", type=int, default=2048)
    p.add_argument("--big-layers", type=int, default=20)
    p.add_argument("--big-trials", type=int, default=4)
    p.add_argument("--every", type=int, default=50, help="async part: save interval")
    p.add_argument("--async-steps", type=int, default=200)
    p.add_argument("--async-trials", type=int, default=2)
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary "
                                               "folder, removed at the end)")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--name", default="checkpoint_speed",
                   help="results file name (benchmarks/results/NAME.md and .json)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:  # inside a launched process
        result = {"saveload": worker_saveload, "accelerate": worker_accelerate,
                  "big": worker_big}[args.worker](args)
        if int(os.environ.get("RANK", "0")) == 0:
            Path(args.out).write_text(json.dumps(result))
        return
    root = Path(args.dir or tempfile.mkdtemp(prefix="meshfit-ckpt-speed-"))
    root.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    try:
        for part in args.parts.split(","):
            print(f"{part} ...", flush=True)
            if part == "start":
                results[part] = part_start(args, root)
            elif part == "async":
                results[part] = part_async(args, root)
            elif part == "accelerate":
                results[part] = _worker(part, args, root, launcher="torchrun")
            else:
                if part == "big":
                    from meshfit.parallel.disk import disk_bandwidth

                    results["disk"] = dict(zip(("write", "read"), disk_bandwidth(root, GiB)))
                results[part] = _worker(part, args, root)
            print(json.dumps(results[part])[:600], flush=True)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    md = _markdown(results, args)
    print(md)
    if not args.no_write:
        import _common

        paths = _common.write_results(args.name, md, {
            "args": vars(args), "results": results, "machine": _common.machine_info()})
        print(f"wrote {', '.join(str(x) for x in paths)}")


def _med(values: list[float]) -> float:
    return statistics.median(values)


def _markdown(results: dict, args) -> str:
    import _common

    lines = ["# Checkpoints and start-up, side by side", "",
             f"Command: `python benchmarks/checkpoint_speed.py --parts {args.parts} "
             f"--trials {args.trials}`; medians of {args.trials} interleaved trials.", ""]
    t = {}
    for part in ("saveload", "accelerate", "start"):
        t.update({k: _med(v) for k, v in results.get(part, {}).get("times", {}).items()})
    if "meshfit_save" in t:
        n = results["saveload"]["params"]
        lines += [f"## save_state / load_state: DDP on 2 processes, a Llama of "
                  f"{n / 1e6:.1f}M parameters with AdamW state", "",
                  "Raw DCP of the same state (model, optimizer, each rank's RNG, the step "
                  "counters), and of the model and optimizer alone.", "",
                  "| | meshfit | raw DCP, same state | meshfit / DCP | raw DCP, model and "
                  "optimizer | meshfit / that | Accelerate | meshfit / Accelerate |",
                  "|---|---|---|---|---|---|---|---|"]
        for op in ("save", "load"):
            acc, mine = t.get(f"accelerate_{op}"), t[f"meshfit_{op}"]
            mo = t.get(f"dcp_mo_{op}")
            lines.append(f"| {op} | {mine:.3f} s | {t[f'dcp_{op}']:.3f} s | "
                         f"{mine / t[f'dcp_{op}']:.2f} | "
                         + (f"{mo:.3f} s | {mine / mo:.2f} | " if mo else "- | - | ")
                         + (f"{acc:.3f} s | {mine / acc:.2f} |" if acc else "- | - |"))
        lines.append("")
    if "meshfit_train" in t:
        lines += ["## Start-up (wall time of the whole command, 2 processes)", "",
                  "| | meshfit | torchrun | ratio | difference |", "|---|---|---|---|---|",
                  f"| train one step | {t['meshfit_train']:.2f} s | "
                  f"{t['torchrun_minimal']:.2f} s (minimal script) | "
                  f"{t['meshfit_train'] / t['torchrun_minimal']:.2f} | "
                  f"{t['meshfit_train'] - t['torchrun_minimal']:+.2f} s |",
                  f"| launch, join the group | {t['meshfit_launch']:.2f} s | "
                  f"{t['torchrun_join']:.2f} s | {t['meshfit_launch'] / t['torchrun_join']:.2f} "
                  f"| {t['meshfit_launch'] - t['torchrun_join']:+.2f} s |", ""]
    if "async" in results:
        a = results["async"]
        at = {k: _med(v) for k, v in a["times"].items()}
        lines += [f"## Saving every {a['every']} steps ({a['steps']}-step `meshfit train` on 2 "
                  "processes, the reference GPT with d_model 768 and 6 blocks: 42.5M "
                  "parameters, a 0.5 GB checkpoint)", "",
                  "Seconds per step from the first logged step to the last before the end "
                  "(the final save and evaluation left out), medians of "
                  f"{len(a['times']['none'])} interleaved runs.", "",
                  "| saves | s/step | against none |", "|---|---|---|"]
        for name in ("none", "sync", "async", "async-process"):
            if name in at:
                lines.append(f"| {name} | {at[name]:.4f} | {at[name] / at['none']:.3f} |")
        lines.append("")
    if "big" in results:
        b, disk = results["big"], results["disk"]
        per = b["bytes_per_rank"]
        bt = {k: _med(v) for k, v in b["times"].items()}
        lines += [f"## A large sharded state: ZeRO-3 on 2 processes, the reference GPT at "
                  f"{b['params'] / 1e9:.2f}B parameters with AdamW state "
                  f"({per / GiB:.2f} GiB per rank)", "",
                  f"Disk (the same folder): fsync'd sequential write {disk['write'] / MiB:.0f} "
                  f"MiB/s, read {disk['read'] / MiB:.0f} MiB/s (the file's pages dropped from "
                  "the page cache first). Both ranks write to and read from that one disk at "
                  "once. Each load reads from the disk: every file's pages are dropped from the "
                  "page cache before the loads. The arm that goes first alternates between "
                  f"trials; medians of {len(b['times']['meshfit_save'])} trials, and beside "
                  "them the medians of the trials where each arm went first and second.", "",
                  "| | meshfit | MiB/s per rank | raw DCP | MiB/s per rank | meshfit / DCP | "
                  "ratio, each first | ratio, each second |",
                  "|---|---|---|---|---|---|---|---|"]
        for op in ("save", "load"):
            m, d = bt[f"meshfit_{op}"], bt[f"dcp_{op}"]
            went = b.get("first", {}).get(op, [])
            by = {}
            for arm in ("meshfit", "dcp"):
                t = b["times"][f"{arm}_{op}"]
                by[arm] = ([x for x, f in zip(t, went) if f == arm],
                           [x for x, f in zip(t, went) if f != arm])
            pos = [f"{_med(by['meshfit'][i]) / _med(by['dcp'][i]):.2f}"
                   if by["meshfit"][i] and by["dcp"][i] else "-" for i in (0, 1)]
            lines.append(f"| {op} | {m:.1f} s | {per / m / MiB:.0f} | {d:.1f} s | "
                         f"{per / d / MiB:.0f} | {m / d:.2f} | {pos[0]} | {pos[1]} |")
        lines.append("")
    lines.append(_common.machine_markdown(_common.machine_info()))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
