"""Loading a local Hugging Face model under ZeRO-3, measured: meshfit's rank-efficient path
against every rank loading the whole model.

    python benchmarks/load_pretrained.py                        # the driver: both modes, 2 rounds
    meshfit launch --nproc 2 benchmarks/load_pretrained.py --mode meshfit   # one launch

The model: a Llama-shaped causal LM of about 1.1B parameters (TinyLlama-1.1B's shape: hidden
2048, 22 layers, intermediate 5632, 32 heads, 4 KV heads, vocabulary 32000; fp32, 4.4 GB of
safetensors) with random weights, built once on the meta device, filled per tensor from a
seeded normal * 0.02 (norm weights 1) and written with ``save_pretrained`` to ``--folder``
(reused when present; nothing is downloaded), and the same values rounded to bf16 in
``FOLDER-bf16`` (2.2 GB). Both are loaded in fp32. The two folders differ in what
``from_pretrained`` does on CPU: a tensor whose dtype is already the one asked for stays a
copy-on-write memory map of the file (transformers 5: no anonymous memory, pages read when
touched, so each rank's FSDP2 sharding reads only its half), while a bf16 file loaded in fp32
is converted into anonymous memory, the whole model in every rank (as it also is on a GPU).

Two modes, each in its own launch of 2 processes so that their peaks do not mix, both with
``Accelerator(parallel=ParallelDims(dp_shard=2, dp_replicate=1), zero_stage=3)``:

* ``meshfit``: ``meshfit.checkpoint.pretrained.meta_model(folder)`` (the model on the meta
  device) then ``prepare``: FSDP2 lays it out on the meta device and each rank reads only its
  slices of each tensor from the safetensors;
* ``whole``: ``transformers.AutoModelForCausalLM.from_pretrained(folder)`` on every rank (the
  whole model in each rank: converted in memory, or memory-mapped where the dtypes match),
  then ``prepare``.

Per rank: wall time from the start of loading (after a barrier) to the model prepared (own,
and after a closing barrier), and peak memory up to that point: the process's anonymous
resident memory (``RssAnon`` of /proc/self/status, sampled every ``--sample-ms`` by a
background thread; file-backed pages of the memory-mapped safetensors are not in it, they are
page cache shared between processes and reclaimable) and ``getrusage(RUSAGE_SELF).ru_maxrss``
(the peak resident set, file-backed pages included). After ``prepare`` both modes compute the
loss of one fixed batch; the driver prints their difference (identical weights and work: 0).

The driver runs ``--rounds`` rounds of every (folder, mode) launch (the folders' files are in the page cache
from the second round on, for every launch alike: dropping caches needs root) and reports the
last round; every round is in the JSON. Results: benchmarks/results/load_pretrained_2ranks.md
and .json. Not a test: nothing here asserts on timings.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

SHAPE = dict(hidden_size=2048, num_hidden_layers=22, intermediate_size=5632,
             num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
             max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False)
MODES = ("meshfit", "whole")
GIB = 2**30


# ----------------------------------------------------------------------------- the folder
def build_folder(folder: Path, seed: int, dtype: torch.dtype = torch.float32) -> dict:
    """Write the random-weight model to `folder` in `dtype` unless it is already there (the
    same values for every dtype: drawn in fp32, then rounded)."""
    import transformers

    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return {"built": False, "folder": str(folder)}
    t0 = time.perf_counter()
    config = transformers.LlamaConfig(**SHAPE)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.dim() == 1:  # RMSNorm weights
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.to(dtype)
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tmp.rename(folder)
    return {"built": True, "folder": str(folder), "build_s": time.perf_counter() - t0}


def disk_dtype(folder: Path) -> str:
    from safetensors import safe_open

    file = next(iter(sorted(folder.glob("*.safetensors"))))
    with safe_open(str(file), "pt") as fh:
        return str(fh.get_slice(next(iter(fh.keys()))).get_dtype()).lower()


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


# ----------------------------------------------------------------------------- memory
def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


class Sampler:
    """Peak RssAnon and RssFile (KiB) of this process, sampled by a daemon thread."""

    def __init__(self, every_s: float):
        self.every_s, self.peak_anon, self.peak_file, self.samples = every_s, 0, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.every_s)

    def sample(self) -> None:
        text = Path("/proc/self/status").read_text()
        for line in text.splitlines():
            if line.startswith("RssAnon:"):
                self.peak_anon = max(self.peak_anon, int(line.split()[1]))
            elif line.startswith("RssFile:"):
                self.peak_file = max(self.peak_file, int(line.split()[1]))
        self.samples += 1

    def start(self) -> "Sampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


# ----------------------------------------------------------------------------- one launch
def worker(args) -> None:
    import torch.distributed as dist

    from meshfit import Accelerator, ParallelDims

    acc = Accelerator(parallel=ParallelDims(dp_shard=2, dp_replicate=1), zero_stage=3)
    if acc.num_processes != 2:
        raise SystemExit("run with 2 processes: meshfit launch --nproc 2 "
                         "benchmarks/load_pretrained.py --mode meshfit")
    import transformers  # noqa: F401  (imported before the clock in both modes)
    from meshfit.checkpoint.pretrained import meta_model

    info = _common.machine_info(acc)
    info["transformers"] = transformers.__version__
    info["safetensors"] = importlib.metadata.version("safetensors")
    folder = args.folder
    baseline_anon = _status_kib("RssAnon")
    sampler = Sampler(args.sample_ms / 1000).start()
    dist.barrier()
    t0 = time.perf_counter()
    if args.mode == "meshfit":
        model = meta_model(folder)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, local_files_only=True)
    t_built = time.perf_counter()
    built_anon = _status_kib("RssAnon")
    model = acc.prepare(model)
    t_own = time.perf_counter()
    dist.barrier()
    t_all = time.perf_counter()
    sampler.stop()
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                for p in model.parameters())  # (before the forward: FSDP2 keeps the root's
    # parameters unsharded after it)
    rusage_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    rest_anon = _status_kib("RssAnon")

    batch = torch.randint(0, SHAPE["vocab_size"], (args.batch_size, args.seq_len),
                          generator=torch.Generator().manual_seed(1234)).to(acc.device)
    model.eval()
    with torch.no_grad():
        loss = model(input_ids=batch, labels=batch).loss.float().item()
    row = {"rank": acc.process_index, "mode": args.mode, "on_disk": disk_dtype(Path(folder)),
           "dtype": str(next(model.parameters()).dtype),
           "build_s": t_built - t0, "prepare_s": t_own - t_built, "own_s": t_own - t0,
           "all_s": t_all - t0, "baseline_anon_kib": baseline_anon,
           "built_anon_kib": built_anon,
           "peak_anon_kib": sampler.peak_anon, "peak_file_kib": sampler.peak_file,
           "ru_maxrss_kib": rusage_kib, "rest_anon_kib": rest_anon,
           "samples": sampler.samples, "local_params": local, "loss": loss}
    rows = [None] * acc.num_processes
    dist.all_gather_object(rows, row)
    if acc.is_main_process:
        for r in rows:
            print(json.dumps(r), flush=True)
        if args.out:
            info["loadavg_at_end"] = list(os.getloadavg())
            Path(args.out).write_text(json.dumps({"machine": info, "rows": rows}, indent=2))
    acc.end_training()


# ----------------------------------------------------------------------------- the driver
def _meshfit_exe() -> str:
    exe = Path(sys.executable).parent / "meshfit"
    return str(exe) if exe.exists() else "meshfit"


def _folders(args) -> list[tuple[str, Path, torch.dtype]]:
    base = Path(args.folder).expanduser()
    known = {"fp32": (base, torch.float32),
             "bf16": (base.with_name(base.name + "-bf16"), torch.bfloat16)}
    return [(name, *known[name]) for name in args.on_disk.split(",")]


def driver(args) -> None:
    script = _common._rel(str(Path(__file__).resolve()))
    tmp = Path(tempfile.mkdtemp(prefix="meshfit-loadbench-"))
    env = dict(os.environ, TMPDIR=str(tmp))
    folders, cases = {}, []
    for name, folder, dtype in _folders(args):
        made = build_folder(folder, args.seed, dtype)
        made["bytes"] = folder_bytes(folder)
        folders[name] = made
        print(f"folder {folder}: {made['bytes'] / 1e9:.2f} GB of {name} safetensors"
              + (f" (built in {made['build_s']:.1f} s)" if made["built"] else " (reused)"),
              flush=True)
        cases += [(name, folder, mode) for mode in MODES]
    rounds, commands = [], []
    for k in range(args.rounds):
        for name, folder, mode in cases:
            out = tmp / f"{name}-{mode}-{k}.json"
            cmd = [_meshfit_exe(), "launch", "--nproc", "2", script, "--mode", mode,
                   "--folder", str(folder), "--seq-len", str(args.seq_len), "--batch-size",
                   str(args.batch_size), "--sample-ms", str(args.sample_ms), "--out", str(out)]
            shown = " ".join(["meshfit", *cmd[1:]])
            if k == 0:
                commands.append(shown.replace(f" --out {out}", ""))
            print(f"round {k + 1}/{args.rounds}: {shown}", flush=True)
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True, env=env)
            got = json.loads(out.read_text())
            got.update(on_disk=name, mode=mode, round=k + 1, launch_s=time.perf_counter() - t0)
            rounds.append(got)
    shutil.rmtree(tmp, ignore_errors=True)
    last = [g for g in rounds if g["round"] == args.rounds]
    losses = {f"{g['on_disk']}/{g['mode']}": g["rows"][0]["loss"] for g in last}
    diffs = {name: abs(losses[f"{name}/meshfit"] - losses[f"{name}/whole"])
             for name in folders}
    info = last[0]["machine"]
    info["loadavg_at_end"] = list(os.getloadavg())
    md = _markdown(last, rounds, losses, diffs, folders, args, info, commands)
    print(md)
    for name, d in diffs.items():
        print(f"loss ({name} on disk): meshfit {losses[name + '/meshfit']:.8f}, whole "
              f"{losses[name + '/whole']:.8f}, |difference| {d:.3g}")
    if not args.no_write:
        paths = _common.write_results(
            "load_pretrained_2ranks", md,
            {"machine": info, "args": vars(args), "shape": SHAPE, "folders": folders,
             "commands": commands, "loss": losses, "loss_abs_diff": diffs,
             "reported_round": args.rounds, "rounds": rounds})
        print(f"wrote {paths[0]} and {paths[1]}")


def _markdown(last, rounds, losses, diffs, folders, args, info, commands) -> str:
    n = sum(r["local_params"] for r in last[0]["rows"])
    shard = 4 * max(r["local_params"] for r in last[0]["rows"])
    sizes = ", ".join(f"{name}: {f['bytes'] / 1e9:.2f} GB" for name, f in folders.items())
    cache = ("warm: the safetensors were in the page cache (written by this driver or read by "
             "the earlier rounds; dropping caches needs root), for every mode alike"
             if args.rounds > 1 else "a single round: the first launch may have read from disk")
    out = ["# Loading a local Hugging Face model under ZeRO-3: per-rank time and peak memory",
           "", f"Command: `{_common.launch_command()}` (the driver: {args.rounds} rounds of "
           "one launch per row, each in its own 2 processes:", ""]
    out += [f"    {c}" for c in commands]
    out += ["", ")", "", _common.machine_markdown(info), "",
            f"Model: Llama-shaped causal LM, TinyLlama-1.1B's shape (hidden 2048, 22 layers, "
            f"intermediate 5632, 32/4 heads, vocabulary 32000), {n / 1e9:.3f}B parameters, "
            f"random weights, in one local folder per on-disk dtype ({sizes} of safetensors; "
            "the same values, bf16 rounded from fp32), loaded in fp32 in every row. "
            "`Accelerator(parallel=ParallelDims(dp_shard=2, dp_replicate=1), zero_stage=3)`; "
            f"transformers {info.get('transformers')}, safetensors {info.get('safetensors')}.",
            "",
            "- **meshfit**: `meta_model(folder)` + `prepare` (FSDP2 on the meta device, each rank "
            "reads only its slices of each tensor);",
            "- **whole**: `AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)` on "
            "every rank + `prepare`.", "",
            "On CPU, `from_pretrained` keeps a tensor whose file dtype is the dtype asked for as "
            "a copy-on-write memory map of the safetensors (RssAnon after build ≈ baseline; the "
            "pages are read when touched, and FSDP2's sharding in `prepare` touches only this "
            "rank's half), so with fp32 on disk *whole* costs no more anonymous memory than "
            "*meshfit*; a bf16 file loaded in fp32 is converted into anonymous memory: the whole "
            "fp32 model in every rank, then its shard (as on a GPU, where `from_pretrained` "
            "puts the whole model on every device).", "",
            f"Round {args.rounds} of {args.rounds} ({cache}). Time: from the start of loading "
            "(after a barrier) to this rank's model prepared (build = `meta_model` / "
            "`from_pretrained`, then `prepare`), and to both ranks prepared (closing barrier). "
            "Peak RssAnon: the process's anonymous resident memory, sampled every "
            f"{args.sample_ms:g} ms by a thread (file-backed pages of the memory-mapped "
            "safetensors are excluded: page cache, shared and reclaimable; shown as peak "
            "RssFile); baseline = RssAnon before loading (torch, transformers, process group). "
            "ru_maxrss: `getrusage(RUSAGE_SELF)`, the peak resident set including file-backed "
            "pages. After build: RssAnon after `meta_model` / `from_pretrained`, before `prepare`. "
            f"Once prepared, every rank holds {shard / GIB:.2f} GiB of fp32 shard (RssAnon "
            "at that point is in the JSON, `rest_anon_kib`). "
            "GiB = 2^30 bytes.", "",
            "| on disk | mode | rank | build s | prepare s | to own prepared s | "
            "to all prepared s | baseline RssAnon GiB | after build RssAnon GiB | "
            "peak RssAnon GiB | peak − baseline GiB | ru_maxrss GiB | peak RssFile GiB |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    k = GIB / 1024
    for g in last:
        for r in g["rows"]:
            out.append(
                f"| {g['on_disk']} | {g['mode']} | {r['rank']} | {r['build_s']:.2f} | "
                f"{r['prepare_s']:.2f} | {r['own_s']:.2f} | {r['all_s']:.2f} | "
                f"{r['baseline_anon_kib'] / k:.2f} | {r['built_anon_kib'] / k:.2f} | "
                f"{r['peak_anon_kib'] / k:.2f} | "
                f"{(r['peak_anon_kib'] - r['baseline_anon_kib']) / k:.2f} | "
                f"{r['ru_maxrss_kib'] / k:.2f} | {r['peak_file_kib'] / k:.2f} |")
    out += ["", "Every round:", "",
            "| round | on disk | mode | to all prepared s | peak RssAnon GiB (rank 0 / 1) | "
            "ru_maxrss GiB (rank 0 / 1) |", "|---:|---|---|---:|---|---|"]
    for g in rounds:
        rs = g["rows"]
        out.append(f"| {g['round']} | {g['on_disk']} | {g['mode']} | "
                   f"{max(r['all_s'] for r in rs):.2f} | "
                   + " / ".join(f"{r['peak_anon_kib'] / k:.2f}" for r in rs) + " | "
                   + " / ".join(f"{r['ru_maxrss_kib'] / k:.2f}" for r in rs) + " |")
    out += ["", f"Correctness: after `prepare`, the loss of one fixed batch ({args.batch_size} "
            f"x {args.seq_len} tokens, labels = inputs), meshfit vs whole: "
            + "; ".join(f"{name} on disk: {losses[name + '/meshfit']:.8f} vs "
                        f"{losses[name + '/whole']:.8f}, |difference| = {d:.3g}"
                        for name, d in diffs.items()) + "."]
    return "\n".join(out) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=MODES, default=None,
                   help="one launch of one mode (under meshfit launch --nproc 2); without it, "
                        "the driver runs both modes --rounds times and writes the results")
    p.add_argument("--folder", default="/tmp/meshfit-bench-1b",
                   help="the fp32 model folder (built there once, reused when present); the "
                        "driver's bf16 copy is FOLDER-bf16")
    p.add_argument("--on-disk", default="fp32,bf16",
                   help="(driver) the folders' dtypes to measure, fp32 and/or bf16")
    p.add_argument("--rounds", type=int, default=2,
                   help="rounds of every launch; the last is reported (warm page cache)")
    p.add_argument("--seq-len", type=int, default=32, help="tokens of the loss check's batch")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--sample-ms", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="(with --mode) where rank 0 writes its rows")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    if args.mode is None:
        if "WORLD_SIZE" in os.environ:
            raise SystemExit("the driver runs in one process: python "
                             "benchmarks/load_pretrained.py (or give --mode under a launch)")
        driver(args)
    else:
        worker(args)


if __name__ == "__main__":
    main()
