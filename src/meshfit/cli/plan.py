"""`meshfit estimate` (per-rank memory of a layout) and `meshfit plan` (the best layouts of a
cluster), on `meshfit.memory.estimate` and `meshfit.plan.search`.

    meshfit estimate llama-7b --world-size 8 --dtype bf16 --seq-len 4096
    meshfit estimate configs/llama.json --layout dp_shard=4,tp=2 --json
    meshfit plan llama-70b --gpus-per-node 8 --nodes 4 --gpu h100 --seq-len 4096 \\
        --global-batch-size 512 --out plan.toml
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from meshfit.cli import OneLineParser
from meshfit.distributed.dims import AXES
from meshfit.models.factory import check_folder_code

_PIPELINE_FIELDS = ("schedule", "microbatches", "virtual_stages")

GiB = 2**30


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL",
                   help="a preset (tiny, gpt2, llama-1b, llama-7b, llama-70b), a Hugging Face "
                        "config.json (or its folder), or module:function")
    p.add_argument("--dtype", default="bf16", choices=("fp32", "bf16", "fp16"),
                   help="activation / compute dtype (parameters stay fp32 masters)")
    p.add_argument("--optimizer", default="adamw",
                   choices=("adamw", "adamw_8bit", "adafactor", "sgd", "muon",
                            "adamw_bf16_states", "adamw_4bit"))
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per sequence (default: the model's context, at most 4096)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="for presets: the tokenizer's vocabulary (default: the preset's)")
    p.add_argument("--attention", default="flash", choices=("flash", "math"),
                   help="flash/efficient kernels save no score matrix; math saves it")
    p.add_argument("--peft", default="none", choices=("none", "lora", "qlora"),
                   help="LoRA adapters on every block linear (gradients and optimizer state "
                        "for them alone); qlora: the block linears in 4 bits (NF4)")
    p.add_argument("--lora-r", type=int, default=8, help="the adapters' rank with --peft")
    p.add_argument("--json", action="store_true", help="print JSON (schema: docs/planning.md)")
    p.add_argument("--trust-code", action="store_true",
                   help="run the code a MODEL folder's config.json names (transformers' remote "
                        "code): only for a folder whose writer you trust")


def _shape(ns):
    from meshfit.memory import ModelShape

    if Path(ns.model).expanduser().exists():  # a folder or config.json: someone else's code?
        check_folder_code(ns.model, trust_code=ns.trust_code, field="MODEL", how="--trust-code",
                          factories=False)
    shape = ModelShape.of(ns.model, vocab_size=ns.vocab_size, trust_code=ns.trust_code)
    if ns.seq_len is None:
        ns.seq_len = min(shape.max_seq_len or 4096, 4096)
    if ns.seq_len < 1:
        raise ValueError(f"--seq-len={ns.seq_len} must be >= 1")
    if shape.max_seq_len is not None and ns.seq_len > shape.max_seq_len:
        raise ValueError(f"--seq-len={ns.seq_len} is longer than the {shape.max_seq_len} "
                         f"positions of {ns.model}; lower --seq-len")
    return shape


def _adapters(ns, shape):
    """The `Adapters` of --peft / --lora-r (every block linear adapted), or None."""
    if ns.peft == "none":
        return None
    from meshfit.memory import Adapters

    try:
        return Adapters.lora(shape, ns.lora_r, quantized=ns.peft == "qlora")
    except ValueError as err:
        raise ValueError(f"--peft={ns.peft}: {err}") from None


def _positive(ns, *flags: str) -> None:
    for flag in flags:
        value = getattr(ns, flag.lstrip("-").replace("-", "_"))
        if value is not None and value < 1:
            raise ValueError(f"{flag}={value} must be >= 1")


# ---------------------------------------------------------------------------- estimate
def _estimate_parser() -> argparse.ArgumentParser:
    p = OneLineParser("meshfit estimate", "Per-rank bytes of parameters, gradients, optimizer "
                      "state, activations and buffers of a training step, for one layout or one "
                      "of each family.")
    _common(p)
    p.add_argument("--world-size", type=int, default=1, help="processes (GPUs) in all")
    p.add_argument("--layout", default=None,
                   help="e.g. dp_shard=4,tp=2,zero_stage=3 (axes not named: 1; default: one "
                        "row per layout family of --world-size)")
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="refuse a --layout whose tp does not divide it (TP groups across nodes)")
    p.add_argument("--activation-checkpointing", default="none",
                   choices=("none", "selective", "full"))
    return p


def _families(world: int, shape, ns) -> list:
    """One layout per family for `world` processes: DDP, ZeRO-1/2/3 (+ offload), TP, PP,
    and dp x tp, pp x dp when they divide."""
    from meshfit.memory import LayoutSpec

    base = dict(micro_batch_size=ns.micro_batch_size,
                activation_checkpointing=ns.activation_checkpointing)
    if world == 1:
        return [("one process", LayoutSpec(**base))]
    out = [("DDP", LayoutSpec(dp_replicate=world, **base))]
    for stage in (1, 2, 3):
        out.append((f"ZeRO-{stage}", LayoutSpec(dp_shard=world, zero_stage=stage, **base)))
    out.append(("ZeRO-3 + offload", LayoutSpec(dp_shard=world, zero_stage=3, offload="cpu",
                                                **base)))
    out.append((f"TP {world} + SP", LayoutSpec(tp=world, sequence_parallel=True, **base)))
    m = max(world, 2 * world)
    out.append((f"PP {world} (1f1b, {m} micro-batches)",
                LayoutSpec(pp=world, microbatches=m, **base)))
    if world % 2 == 0 and world >= 4:
        half = world // 2
        out.append((f"ZeRO-3 {half} x TP 2", LayoutSpec(dp_shard=half, tp=2, zero_stage=3, **base)))
        out.append((f"PP 2 x ZeRO-1 {half}", LayoutSpec(pp=2, dp_shard=half, zero_stage=1,
                                                         microbatches=4, **base)))
    return out


def cmd_estimate(argv: list[str]) -> int:
    ns = _estimate_parser().parse_args(argv)
    _positive(ns, "--world-size", "--micro-batch-size", "--vocab-size", "--gpus-per-node",
              "--lora-r")
    given = None
    if ns.layout:  # (the one grammar of a layout: `LayoutRequest.parse`; no torch yet)
        from meshfit.parallel.spec import LayoutSpec

        given = LayoutSpec.parse(ns.layout, flag="--layout", micro_batch_size=ns.micro_batch_size,
                                 activation_checkpointing=ns.activation_checkpointing)
    from meshfit.memory import estimate  # torch: after the arguments' refusals
    from meshfit.memory.estimate import resolve_layout
    shape = _shape(ns)
    adapters = _adapters(ns, shape)
    rows = []
    if given is not None:
        spec = given
        if ns.gpus_per_node is not None and ns.gpus_per_node % spec.tp:
            raise ValueError(f"--layout tp={spec.tp} does not divide --gpus-per-node="
                             f"{ns.gpus_per_node}: tensor-parallel groups would cross nodes; "
                             "use a tp that divides the GPUs of a node")
        if ns.world_size not in (1, spec.world_size):
            raise ValueError(f"--layout {ns.layout} uses {spec.world_size} processes but "
                             f"--world-size={ns.world_size}; make them agree")
        rows.append((spec.describe(), spec))
    else:
        rows = _families(ns.world_size, shape, ns)
    results, refused = [], []
    for label, spec in rows:
        try:
            resolve_layout(spec, ns.dtype)
            _check_model(shape, spec, ns.seq_len)
        except ValueError as err:
            if given is not None:
                raise
            refused.append((label, str(err)))
            continue
        results.append((label, estimate(shape, spec, seq_len=ns.seq_len, dtype=ns.dtype,
                                        optimizer=ns.optimizer, attention=ns.attention,
                                        adapters=adapters)))
    if ns.json:
        out = {"model": shape.name, "params": shape.params}
        if shape.active_params is not None:
            out["active_params"] = shape.active_params  # mixture of experts: per token
        out["layouts"] = [e.to_json() for _, e in results]
        print(json.dumps(out, indent=2))
        return 0
    _print_estimates(ns, shape, results, refused)
    return 0


def _peft_note(ns) -> str:
    if ns.peft == "none":
        return ""
    return (f", {'QLoRA' if ns.peft == 'qlora' else 'LoRA'} r={ns.lora_r} on every block "
            f"linear{' (4-bit base)' if ns.peft == 'qlora' else ''}")


def _print_estimates(ns, shape, results: list, refused: list) -> None:
    from meshfit.memory.estimate import byte_unit

    unit, size = byte_unit(e for _, e in results)
    active = (f", {shape.active_params:,} active per token" if shape.active_params is not None
              else "")
    print(f"{shape.name}: {shape.params:,} parameters{active} ({shape.n_layer} blocks of up "
          f"to {shape.block_params:,}); seq_len {ns.seq_len}, {ns.dtype} activations, "
          f"{ns.optimizer}{_peft_note(ns)}; {unit} per rank")
    print(f"{'layout':34} {'params':>8} {'grads':>8} {'optim':>8} {'activ':>8} {'buffers':>8} "
          f"{'total':>8}")
    for label, e in results:
        b = e.per_rank_bytes
        print(f"{label[:34]:34} " + " ".join(f"{b[k] / size:8.2f}" for k in (
            "params", "grads", "optimizer", "activations", "buffers", "total")))
    for label, reason in refused:
        print(f"{label[:34]:34} refused: {reason}")


def _check_model(shape, spec, seq_len: int) -> None:
    from meshfit.memory.estimate import resolve_layout
    from meshfit.parallel.layout import ModelFacts

    facts = ModelFacts(n_blocks=shape.n_layer, divisible=shape.divisible,
                       experts=(shape.n_experts,) * shape.moe_layers)  # what ep splits
    resolve_layout(spec).check_model(facts, seq_len=seq_len)


# ---------------------------------------------------------------------------- plan
def _plan_parser() -> argparse.ArgumentParser:
    from meshfit.plan import DEVICES, INTERCONNECTS, NETWORKS

    p = OneLineParser("meshfit plan", "Rank the layouts of a cluster that fit in memory by "
                      "predicted step time, with the multi-GPU guide's reason; --out writes a "
                      "config for meshfit train.")
    _common(p)
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpu", default="h100", choices=tuple(DEVICES))
    p.add_argument("--gpu-memory", default=None,
                   help="memory per GPU, e.g. 80GiB (default: the --gpu's; cpu: this "
                        "machine's memory, shared by its processes)")
    p.add_argument("--interconnect", default=None, choices=tuple(INTERCONNECTS),
                   help="the link inside a node (default: loopback with --gpu cpu, else "
                        "nvlink)")
    p.add_argument("--network", default=None, choices=tuple(NETWORKS),
                   help="the link between nodes (default: ethernet with --gpu cpu, else "
                        "infiniband)")
    p.add_argument("--disk-bandwidth", type=float, default=None,
                   help="GB/s each node's disk reads and writes, for the optimizer state on "
                        "disk (proposed only when nothing else fits; default: the --profile's "
                        "measured disk, else 2)")
    p.add_argument("--global-batch-size", type=int, default=None,
                   help="sequences per optimizer step (default: 8 per GPU)")
    p.add_argument("--margin", type=float, default=0.1,
                   help="share of each GPU's memory kept free (default 0.1)")
    p.add_argument("--profile", default=None,
                   help="a calibration.json from meshfit calibrate (measured throughput and "
                        "collectives instead of the device table)")
    p.add_argument("--host-memory", default=None,
                   help="host memory per node, e.g. 512GiB: layouts whose CPU-offloaded states "
                        "need more are left out (default: not checked; the need is printed)")
    p.add_argument("--top", type=int, default=5, help="layouts printed (default 5)")
    p.add_argument("--out", default=None, help="write the best layout as a meshfit train TOML")
    p.add_argument("--validate", type=int, default=0, metavar="K",
                   help="run the top K layouts here for a few steps and print predicted vs "
                        "measured per-rank bytes and step time (layouts of --gpus-per-node x "
                        "--nodes processes, all on this machine)")
    p.add_argument("--validate-steps", type=int, default=3, help=argparse.SUPPRESS)
    return p


def cmd_plan(argv: list[str]) -> int:
    from meshfit.plan import DEVICES, Cluster, parse_bytes, search

    ns = _plan_parser().parse_args(argv)
    _positive(ns, "--gpus-per-node", "--nodes", "--global-batch-size", "--top", "--vocab-size",
              "--lora-r")
    if ns.disk_bandwidth is not None and not ns.disk_bandwidth > 0:
        raise ValueError(f"--disk-bandwidth={ns.disk_bandwidth} must be > 0 (GB/s)")
    if ns.validate < 0:
        raise ValueError(f"--validate={ns.validate} must be >= 0 (the layouts to run)")
    if not 0 <= ns.margin < 1:
        raise ValueError(f"--margin={ns.margin} must be in [0, 1), e.g. 0.1")
    device = DEVICES[ns.gpu]
    if ns.gpu_memory is not None:  # (each process's own, also on a CPU)
        device = dataclasses.replace(device, memory=parse_bytes(ns.gpu_memory), shared=False)
    if ns.out is not None and not Path(ns.out).parent.exists():
        raise ValueError(f"--out={ns.out!r}: its folder does not exist")
    calibration = None
    if ns.profile is not None:
        from meshfit.plan.calibrate import load_calibration

        calibration = load_calibration(ns.profile)
    cluster = Cluster(gpus_per_node=ns.gpus_per_node, nodes=ns.nodes, device=device,
                      interconnect_name=ns.interconnect, network_name=ns.network,
                      calibration=calibration, disk_bandwidth=_disk_bandwidth(ns, calibration))
    shape = _shape(ns)
    adapters = _adapters(ns, shape)
    batch = ns.global_batch_size or 8 * cluster.world_size
    host = None if ns.host_memory is None else parse_bytes(ns.host_memory, "--host-memory")
    result = search(shape, cluster, seq_len=ns.seq_len, global_batch_size=batch, dtype=ns.dtype,
                    optimizer=ns.optimizer, margin=ns.margin, attention=ns.attention,
                    host_memory=host, adapters=adapters)
    plans = result.plans[:ns.top]
    if ns.out is not None:
        Path(ns.out).write_text(plan_toml(ns, plans[0], batch))
    rows = []
    if ns.validate:
        from meshfit.plan_validate import validate

        rows = validate(result.plans[:ns.validate], model=ns.model, seq_len=ns.seq_len,
                        global_batch_size=batch, dtype=ns.dtype, steps=ns.validate_steps,
                        nproc=cluster.world_size, optimizer=ns.optimizer)
    if ns.json:
        out = result.to_json()
        out["plans"] = out["plans"][:ns.top]
        if rows:
            out["validation"] = rows
        print(json.dumps(out, indent=2))
        return 0
    _print_plans(ns, shape, batch, result, plans)
    _print_validation(rows)
    if ns.out is not None:
        print(f"wrote {ns.out}: meshfit train --nproc {ns.gpus_per_node} --nnodes {ns.nodes} "
              f"--config {ns.out}")
    return 0


def _print_plans(ns, shape, batch: int, result, plans) -> None:
    print(f"{shape.name}: {shape.params:,} parameters on {result.cluster.describe()}; "
          f"global batch {batch} x {ns.seq_len} tokens, {ns.dtype}")
    print(f"{result.scenario}.")
    print(f"{result.considered} settings of legal layouts estimated, {result.too_big} did not "
          f"fit{' (GPU or host memory)' if ns.host_memory else ''}; {result.refused} layouts "
          "refused by meshfit's rules")
    s = result.sources
    print(f"figures from: compute: {s['compute']}; collectives: {s['collectives']}; MFU: "
          f"model FLOPs over {s['mfu_peak']}")
    if s["not_used"]:  # (flagged by meshfit calibrate: the table's or assumed figures instead)
        print(f"not used from --profile {ns.profile} (calibrate flagged them; the assumed "
              f"figures instead): {s['not_used']}")
    for i, p in enumerate(plans, 1):
        b = p.estimate.per_rank_bytes
        unit, scale = ("GiB", GiB) if b["total"] >= GiB else ("MiB", 2**20)
        print(f"{i}. {p.layout.describe()}")
        print(f"   {b['total'] / scale:.1f} {unit} per rank (states "
              f"{(b['params'] + b['grads'] + b['optimizer']) / scale:.1f}, activations "
              f"{b['activations'] / scale:.1f}, buffers {b['buffers'] / scale:.1f}); step "
              f"{p.step_time_s:.3g} s, {p.tokens_per_s:,.0f} tokens/s, MFU {p.mfu:.0%}"
              + ("" if result.cluster.uses(f"matmul_flops.{ns.dtype}") else
                 " (assumed efficiency)"))
        if p.host_bytes_per_node:
            held = "gradient shards and state chunks" if p.layout.offload_params \
                else "CPU offload"
            print(f"   host memory for {held}: {p.host_bytes_per_node / GiB:,.0f} GiB per "
                  f"node ({p.host_bytes_per_node / ns.gpus_per_node / GiB:,.1f} GiB per rank)"
                  + ("" if ns.host_memory else "; not checked (give --host-memory)"))


def _print_validation(rows: list[dict]) -> None:
    if not rows:
        return
    print("validation (this machine): predicted vs measured per-rank bytes and step time")
    for row in rows:
        if row.get("skipped"):
            print(f"   {row['layout']}: skipped ({row['skipped']})")
            continue
        print(f"   {row['layout']}: {row['predicted_bytes'] / GiB:.3f} vs "
              f"{row['measured_bytes'] / GiB:.3f} GiB ({row['bytes_error']:+.0%}), "
              f"{row['predicted_step_s']:.3g} vs {row['measured_step_s']:.3g} s "
              f"({row['time_error']:+.0%})")


def _disk_bandwidth(ns, calibration) -> float:
    """Bytes/s of the offload disk: --disk-bandwidth, else the profile's measured disk
    (`meshfit calibrate --offload-dir`), else 2 GB/s."""
    if ns.disk_bandwidth is not None:
        return ns.disk_bandwidth * 1e9
    measured = calibration.disk_bandwidth() if calibration is not None and \
        calibration.trusted("disk") else None
    return measured or 2e9


def plan_toml(ns, plan, global_batch_size: int) -> str:
    """A `meshfit train` config running `plan`'s layout for MODEL."""
    from meshfit.models import GPTConfig

    lay = plan.layout
    if ns.model in GPTConfig.preset_names():
        model = {"preset": ns.model}
    elif ":" in ns.model and not Path(ns.model).exists():
        model = {"factory": ns.model}
    else:
        model = {"hf_config": str(Path(ns.model).resolve())}
        if ns.trust_code:  # the run builds it from the same folder
            model["trust_code"] = True
    # [parallel] is the plan's request, whole: every field, sizes always, the pipeline's
    # only with pp, the other options where they differ from the default
    defaults = {f.name: f.default for f in dataclasses.fields(type(lay))}
    parallel = {k: v for k, v in lay.fields_dict().items()
                if k in AXES or k == "zero_stage" or (k in _PIPELINE_FIELDS and lay.pp > 1)
                or (k not in _PIPELINE_FIELDS and v != defaults[k])}
    if lay.offload == "disk":  # a folder on the node's local disk (change it to yours)
        parallel["offload_dir"] = "./meshfit-offload"
    sections = {
        "model": model,
        "train": {"global_batch_size": global_batch_size,
                  "micro_batch_size": lay.micro_batch_size, "seq_len": ns.seq_len,
                  "mixed_precision": "no" if ns.dtype == "fp32" else ns.dtype,
                  "activation_checkpointing": lay.activation_checkpointing},
        "optim": {"optimizer": ns.optimizer if ns.optimizer != "adamw" else "adamw_fused"},
        "parallel": parallel}
    if ns.peft != "none":  # (the estimate adapted every block linear: an upper bound)
        sections["peft"] = {"method": ns.peft, "r": ns.lora_r}
        if ns.peft == "qlora" and "hf_config" in model:  # 4 bits of pretrained weights
            model = {"hf_model": model.pop("hf_config"), **model}
            sections["model"] = model
    lines = [f"# meshfit plan {' '.join(sys.argv[2:]) if len(sys.argv) > 2 else ns.model}",
             f"# {plan.why}"]
    for name, values in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
        lines.append("")
    return "\n".join(lines)
