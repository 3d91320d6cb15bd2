"""`meshfit train`'s checks, each a one-line ValueError naming the config key (or flag), the
value and the fix, so that a run that cannot work never starts. No torch at load.

* the values of the config's sections (`check_positive`, ...; and of `meshfit generate`'s
  sampling flags), as they are built;
* `check_layout`: what needs the number of processes (no torch unless the layout splits the
  model, whose structure is then built on the meta device);
* `preflight`: what needs this machine, and the data.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from meshfit import distributed as mdist
from meshfit.data.corpus import data_source
from meshfit.models import GPTConfig
from meshfit.models.factory import import_object
from meshfit.parallel.layout import Layout, ModelFacts
from meshfit.parallel.request import LayoutRequest
from meshfit.train import tokens

# Imported where used: torch and the modules that import it (the model, the optimizers, the
# devices' checks, the memory estimate), so that a config is refused before torch loads (this
# module is on TORCH_FREE's list in tests/test_architecture.py); transformers (optional).

# The layout's fields as `meshfit train`'s errors spell them (see `meshfit.parallel.layout`).
LAYOUT_NAMES = {
    **{k: f"parallel.{k}" for k in LayoutRequest.field_names()},
    "parallel": "parallel", "mixed_precision": "train.mixed_precision",
    "find_batch_size": "train.find_batch_size", "seq_len": "train.seq_len"}


INT64_MAX = 2**63 - 1
"""The largest integer a setting may hold by default: what torch and the C++ below it store."""


def check_positive(section: str, name: str, value: Any, *, allow_zero: bool = False,
                   most: int = INT64_MAX) -> None:
    """An integer in [1, most] ([0, most] with `allow_zero`; True and False are not
    integers here)."""
    least = 0 if allow_zero else 1
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{section}.{name}={value!r} must be an integer >= {least}")
    if value > most:
        raise ValueError(f"{section}.{name}={value!r} is too large: it must be an integer from "
                         f"{least} to {most:,}")


def check_number(section: str, name: str, value: Any, lo: float, hi: float) -> None:
    """A number in [lo, hi] (not NaN, not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            lo <= value <= hi) or math.isnan(value):
        raise ValueError(f"{section}.{name}={value!r} must be a number in [{lo}, {hi}]")


def check_choice(section: str, name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{section}.{name}={value!r} is not one of {', '.join(choices)}")


def check_bool(section: str, name: str, value: Any) -> None:
    """true or false (TOML's booleans, not 0 and 1)."""
    if not isinstance(value, bool):
        raise ValueError(f"{section}.{name}={value!r} must be true or false")


def check_sampling(max_new_tokens: int, temperature: float, top_k: int | None) -> None:
    """`meshfit generate`'s and `meshfit.generate.generate_ids`' settings."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
            or max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens={max_new_tokens!r} must be an integer >= 0")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature)
            and temperature >= 0):
        raise ValueError(f"--temperature={temperature!r} must be a number >= 0 (0: greedy)")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise ValueError(f"--top-k={top_k!r} must be an integer >= 0 (0: no top-k cut)")


def check_layout(cfg, world_size: int, local_world_size: int | None = None) -> Layout:
    """Checks of `cfg` (a `RunConfig`) that need the number of processes; returns the run's
    layout."""
    layout = cfg.layout(world_size, local_world_size)
    cfg.grad_accumulation(world_size)
    if cfg.train.find_batch_size:
        layout.check_batch_probe(names=LAYOUT_NAMES)
    _check_peft(cfg, layout)
    _check_cp(cfg, layout)
    _check_disk(cfg, layout, world_size, local_world_size or world_size)
    if cfg.train.float8 and (layout.dims.tp > 1 or cfg.peft.method != "none"):
        raise ValueError(f"train.float8=true with parallel.tp={layout.dims.tp} and peft.method="
                         f"{cfg.peft.method!r} is not available yet: float8 works with tp = 1 and "
                         "no adapters (dp, ZeRO/FSDP and pp layouts); set train.float8=false")
    if layout.dims.tp > 1 or layout.dims.pp > 1 or layout.dims.ep > 1:
        _check_model_split(cfg, layout, world_size)
    for name in ("factory", "tp_plan", "pipeline_plan"):  # a missing module or name, named
        if getattr(cfg.model, name):                     # before the model is built
            import_object(getattr(cfg.model, name), f"model.{name}")
    return layout


_STATE_BYTES = {"adamw": 8, "adamw_fused": 8, "sgd": 4}


def _check_disk(cfg, layout: Layout, world_size: int, local: int) -> None:
    """offload = "disk": an optimizer it streams, a new folder, and room on its disk for the
    local ranks' state (AdamW 8 B, SGD with momentum 4 B per trainable parameter, divided by
    the ZeRO shards; with offload_params, the parameter shards too)."""
    p = cfg.parallel
    if p.offload != "disk":
        return
    name = cfg.optim.optimizer
    if name not in _STATE_BYTES or (name == "sgd" and not cfg.optim.momentum):
        raise ValueError(f"parallel.offload='disk' with optim.optimizer={name!r}"
                         f"{' without momentum' if name == 'sgd' else ''}: the disk holds "
                         "Adam/AdamW moments or SGD momentum; use adamw, adamw_fused or sgd "
                         "with momentum")
    folder = Path(p.offload_dir).expanduser()
    from meshfit.parallel.disk import MARKER, check_writable, free_bytes

    check_writable(folder, "parallel.offload_dir")
    taken = sorted(q.name for q in folder.glob("rank-*")  # (an earlier run's: replaced)
                   if q.is_dir() and not (q / MARKER).is_file()) if folder.is_dir() else []
    if taken:
        raise ValueError(f"parallel.offload_dir={p.offload_dir!r} holds another run's state "
                         f"({taken[0]}/); give a new folder, or remove that one")
    from meshfit.train.models import build_model

    model = build_model(cfg, tokens.vocab_size(cfg), meta=True)
    trainable = sum(q.numel() for q in model.parameters() if q.requires_grad)
    shards = layout.dims.dp_shard * layout.dims.cp if layout.zero_stage >= 1 else 1
    per_rank = _STATE_BYTES[name] * trainable / shards
    what = "the optimizer state"
    if p.offload_params:  # + the parameter shards (fp32 masters, frozen ones too)
        per_rank += sum(q.numel() * q.element_size() for q in model.parameters()) / shards
        what = "the parameters and optimizer state"
    need = per_rank * min(local, world_size)
    free = free_bytes(folder)
    if need > free:
        raise ValueError(f"parallel.offload_dir={p.offload_dir!r}: {what} of "
                         f"{min(local, world_size)} local rank(s) needs {need / 2**30:.2f} GiB "
                         f"and {free / 2**30:.2f} GiB is free on that disk; give a folder on a "
                         "larger disk")


def _check_cp(cfg, layout: Layout) -> None:
    """Context parallel runs the attention of the reference GPT and of transformers decoders
    whose attention goes through transformers' attention interface as a ring over text
    windows (`meshfit.parallel.cp_hf.cp_problem` says why a configuration cannot)."""
    cp = layout.dims.cp
    if cp == 1:
        return
    m, d, t = cfg.model, cfg.data, cfg.train
    if m.source in ("hf_config", "hf_model"):
        import transformers

        from meshfit.parallel.cp_hf import cp_problem

        folder = str(Path(getattr(m, m.source)).expanduser())
        problem = cp_problem(transformers.AutoConfig.from_pretrained(
            folder, local_files_only=True, trust_remote_code=m.trust_code), cp)
        if problem:
            raise ValueError(f"parallel.cp={cp} with model.{m.source}={getattr(m, m.source)!r}"
                             f": {problem}")
    elif m.source != "preset":
        raise ValueError(f"parallel.cp={cp} with model.{m.source} is not available yet: "
                         "context parallel runs the attention of the reference GPT and of "
                         "transformers decoders (model.hf_config or model.hf_model) as a "
                         "ring; use cp=1 with this model")
    if d.masked or d.packing:
        what = f"data.format={d.format!r}" if d.examples else \
            "data.packing=true" if d.packing else "data.document_mask=true"
        raise ValueError(f"parallel.cp={cp} with {what} is not available yet (the ring "
                         "attends causally over whole windows of text); use data.format="
                         "'text' without packing or document masks, or cp=1")
    pieces = 2 * cp if cfg.parallel.cp_load_balance else cp
    if t.seq_len % pieces:
        raise ValueError(f"parallel.cp={cp}: train.seq_len={t.seq_len} must divide into "
                         f"{pieces} equal chunks ({'2 x cp, load-balanced' if pieces > cp else 'cp'}"
                         f"); use a multiple of {pieces}")
    dropout = 0.0 if m.source != "preset" else m.dropout if m.dropout is not None \
        else GPTConfig.preset(m.preset).dropout
    if dropout > 0:
        raise ValueError(f"parallel.cp={cp} with model.dropout={dropout} is not available: "
                         "the ring computes attention exactly, without dropout; set "
                         "model.dropout=0")
    if t.compile:
        raise ValueError(f"parallel.cp={cp} with train.compile=true is not available yet "
                         "(the ring's sends and receives sit inside each block); set "
                         "train.compile=false")


def _check_peft(cfg, layout: Layout) -> None:
    """LoRA works with data, ZeRO, tensor and pipeline parallelism, not (yet) with ep;
    QLoRA with data parallelism and ZeRO, on a pretrained folder."""
    method = cfg.peft.method
    if layout.dims.ep > 1 and method != "none":
        raise ValueError(f"peft.method={method!r} with parallel.ep > 1 is not yet "
                         "available (LoRA adapts linear layers; the experts are stacked "
                         "weights split over the ep ranks); use peft.method='none' or ep=1")
    if method != "qlora":
        return
    if cfg.model.source != "hf_model":
        raise ValueError(f"peft.method='qlora' keeps pretrained weights in 4 bits: set "
                         f"model.hf_model=FOLDER (model.{cfg.model.source} builds random "
                         "weights, which 4 bits would only blur); use peft.method='lora' "
                         "to adapt it")
    from meshfit.peft import check_quantized_layout
    from meshfit.train.models import build_model

    model = build_model(cfg, tokens.vocab_size(cfg), meta=True)
    try:
        check_quantized_layout(model, shards=layout.dims.dp_shard if layout.is_fsdp else 1,
                               tp=layout.dims.tp, pp=layout.dims.pp)
    except ValueError as err:  # named as the config's fields
        text = str(err).removeprefix("qlora with ")
        axis = text.split("=", 1)[0]
        raise ValueError(f"peft.method='qlora' with parallel.{text}".replace(
            f"use a {axis} that", f"use a parallel.{axis} that")) from None


def _check_model_split(cfg, layout: Layout, world_size: int) -> None:
    """The model (on the meta device) has the plans its tp / pp need, and its sizes divide
    as the layout cuts them."""
    from meshfit.models.plans import has_builtin_plans, plan_for, tp_problem
    from meshfit.parallel.ep import ep_problem, moe_modules
    from meshfit.train.models import check_model_source, plans, resolve_plan

    model = check_model_source(cfg, tokens.vocab_size(cfg))  # on the meta device
    tp_plan, pp_plan = (resolve_plan(p, model) for p in plans(cfg))
    builtin, name, dims = has_builtin_plans(model), type(model).__name__, layout.dims
    # tensor parallel: meshfit's own plan (transformers decoders: read from the model's own
    # plan) unless the user gives one; what it cannot cover is named here, in one line
    problem = tp_problem(model, 1) if dims.tp > 1 and tp_plan is None else None
    if problem:
        raise ValueError(f"parallel.tp={dims.tp}: {problem}; or give a plan as model.tp_plan"
                         " = \"module:PLAN\" (a TPPlan or {module pattern: style}; in your "
                         "own loop: Accelerator(tp_plan=PLAN))")
    if dims.tp > 1 and tp_plan is None:
        tp_plan = plan_for(model)  # its sizes (heads, widths, vocabulary) are checked below
    if dims.pp > 1 and pp_plan is None:
        # the model's own plan: meshfit's GPT, GPT-2, or read from transformers' pp plan
        from meshfit.parallel.pp import pp_problem

        problem = pp_problem(model, 1)  # (stages vs layers: check_model below, by field)
        if problem:
            raise ValueError(f"parallel.pp={dims.pp}: {problem}")
    if dims.ep > 1:  # a dense family, a MoE class meshfit has not mapped, ep not dividing
        problem = ep_problem(model, dims.ep, "parallel.ep")
        if problem:
            raise ValueError(problem)
    if dims.pp == 1 and pp_plan is None and not builtin:
        # a dict plan has no divisible sizes to name
        facts = ModelFacts(n_blocks=1, divisible=tuple(getattr(tp_plan, "divisible", ())),
                           experts=tuple(m.n_experts for m in moe_modules([model])))
    else:
        facts = ModelFacts.of(model, pipeline_plan=pp_plan, tp_plan=tp_plan)
    layout.check_model(facts, seq_len=cfg.train.seq_len,
                       microbatches=cfg.microbatches(world_size), names=LAYOUT_NAMES)


def preflight(cfg, world_size: int | None = None, local_world_size: int | None = None, *,
              memory_check: bool = True) -> list[str]:
    """Checks that need this machine: the device the workers will use (attention kernel,
    8-bit optimizer), the model source, with `world_size` the data (`check_data`) and whether
    the run fits in memory (`meshfit.train.fits.check_fits`, unless not `memory_check`);
    returns warnings (tensor-core shapes; with `world_size` also the layout's
    `Layout.warnings`)."""
    import torch

    from meshfit.accelerator.precision import Precision
    from meshfit.train.batch_size import shape_advice

    cuda = torch.cuda.is_available() and not mdist.cpu_requested(None)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    precision = Precision(cfg.train.mixed_precision, device)
    if cfg.train.float8:
        from meshfit.parallel.float8 import check_float8_device

        check_float8_device(device, "train.float8")
    model, shape = _matmul_shape(cfg, device, precision.dtype or torch.float32)
    if cfg.optim.optimizer in ("adamw_8bit", "adamw_4bit"):  # torchao (or bitsandbytes) there
        from meshfit import optim

        optim.build(cfg.optim.optimizer, [torch.nn.Parameter(torch.zeros(1, device=device))],
                    lr=1e-3)
    warnings = list(cfg.layout(world_size, local_world_size).warnings) if world_size else []
    if cfg.train.warmup_steps >= cfg.train.steps:  # (unset, it is at most a tenth of them)
        warnings.append(f"train.warmup_steps={cfg.train.warmup_steps} covers the whole run of "
                        f"train.steps={cfg.train.steps}: the learning rate only rises, never "
                        "decays; lower it, or leave it unset (a tenth of the run, at most 20)")
    if world_size:
        check_data(cfg, world_size)
    if world_size and memory_check:
        from meshfit.train.fits import check_fits

        local = local_world_size or world_size
        note = check_fits(cfg, model, cfg.layout(world_size, local), world_size=world_size,
                          local_world_size=local, device=device)
        if note:
            warnings.append(note)
    if (precision.dtype is None and not cfg.train.tf32) or shape is None:
        return warnings
    return warnings + shape_advice(device=device, micro_batch_size=cfg.train.micro_batch_size,
                                   d_model=shape[0], d_ff=shape[1], vocab_size=shape[2])


def _matmul_shape(cfg, device, dtype):
    """The model checked (built on the meta device) and its (width, MLP width, vocabulary),
    the sizes tensor cores want in multiples (None where a model's config does not say). The
    reference GPT's attention kernel is checked on `device` too."""
    from meshfit.models.gpt import check_attention_backend
    from meshfit.train.models import check_model_source

    # The model's vocabulary is the tokenizer's for the reference GPT (the gpt2 preset's
    # 50257 becomes 256 on bytes); other models must hold the tokenizer's ids.
    vocab_size = tokens.vocab_size(cfg)
    model = _checked_model(cfg, vocab_size, check_model_source)
    if cfg.model.source == "preset":
        model_cfg = cfg.model_config(vocab_size)
        try:
            check_attention_backend(cfg.model.attention_backend, device, dtype,
                                    head_dim=model_cfg.head_dim)
        except ValueError as err:
            raise ValueError(f"model.{err}") from None
        return model, (model_cfg.d_model, model_cfg.d_ff, model_cfg.vocab_size)
    c = getattr(model, "config", None)  # a user's model may have no config, or other names
    width = getattr(c, "hidden_size", None) or getattr(c, "n_embd", None)
    ff = getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None)
    return model, ((width, ff, getattr(c, "vocab_size", vocab_size)) if width and ff else None)


def _checked_model(cfg, vocab_size: int, check):
    """`check(cfg, vocab_size)` (the model built on the meta device), with what a user's model
    source raises while being read or built (an unreadable or malformed config.json, a factory that
    is not a function, a library's multi-line message) as one line naming the [model] key."""
    source = cfg.model.source
    if source == "preset":
        return check(cfg, vocab_size)
    field = f"model.{source}={getattr(cfg.model, source)!r}"
    try:
        return check(cfg, vocab_size)
    except ValueError as err:
        text = " ".join(str(err).split())
        if text == str(err):
            raise
        raise ValueError(text if text.startswith("model.") else f"{field}: {text}") from None
    except (OSError, TypeError, KeyError, AttributeError) as err:
        text = " ".join(str(err).split()) or type(err).__name__
        raise ValueError(f"{field}: the model cannot be built ({type(err).__name__}: {text}); "
                         "check that source") from None


def check_data(cfg, world_size: int) -> None:
    """Before launch: the run's token splits can be read (the cache is built here if missing,
    and the workers reuse it) and hold one global batch of training windows and the
    validation windows the evaluation needs; one-line ValueError otherwise. A training split
    smaller than one batch per data-parallel rank would give every epoch zero batches."""
    source = data_source(cfg.data.path, cfg.data.hf_dataset)  # the [data] key, as errors name it
    splits = _readable_tokens(cfg, source)
    t = cfg.train
    dims = cfg.parallel.dims().resolve(world_size)
    chunks = cfg.microbatches(world_size)
    accum = cfg.grad_accumulation(world_size)
    if cfg.data.examples:
        _check_examples(cfg, splits, dims, rows=t.micro_batch_size * chunks)
        return
    if cfg.data.document_mask:
        if dims.pp > 1 or dims.tp > 1 or cfg.model.source == "factory":
            raise ValueError("data.document_mask=true runs with the reference GPT or a "
                             "Hugging Face model under data parallel or ZeRO for now, not "
                             f"model.{cfg.model.source} with pp={dims.pp}, tp={dims.tp}")
        splits.windows("train", t.seq_len, documents_apart=True)  # a single-token separator
    n_train, n_val = int(splits.train.shape[0]), int(splits.val.shape[0])
    windows = max(0, n_train - 1) // t.seq_len
    if windows < t.global_batch_size:
        raise ValueError(
            f"{source} gives {windows} training windows of train.seq_len={t.seq_len} tokens "
            f"({n_train} tokens), fewer than one global batch needs: "
            f"train.global_batch_size={t.global_batch_size} (train.micro_batch_size="
            f"{t.micro_batch_size} x {chunks} micro-batch(es) x {dims.dp} data-parallel "
            f"rank(s) x {accum} accumulation); lower train.global_batch_size or train.seq_len, "
            "or give more data")
    _check_validation_windows(cfg, source, n_val, dims, rows=t.micro_batch_size * chunks)


def _check_examples(cfg, splits, dims, rows: int) -> None:
    """Examples (format "completion" or "chat"): one global batch of training rows and the
    validation rows evaluation needs (under pp: one pipeline batch per data-parallel rank)."""
    t, d = cfg.train, cfg.data
    if d.packing and (dims.pp > 1 or dims.tp > 1):
        raise ValueError(f"data.packing=true does not run with parallel.pp={dims.pp}, "
                         f"tp={dims.tp} yet (the per-example attention mask is not passed "
                         "through pipeline stages or tensor-parallel plans); use data "
                         "parallel or ZeRO, or data.packing=false")
    if d.packing and cfg.model.source == "factory":
        raise ValueError("data.packing=true needs the reference GPT or a Hugging Face model "
                         "(model.hf_model or model.hf_config), not model.factory: the "
                         "per-example attention mask goes to its attention")
    n_train, n_val = len(splits.train), len(splits.val)
    if n_train < t.global_batch_size:
        raise ValueError(f"data.hf_dataset={d.hf_dataset!r} gives {n_train} training examples "
                         f"(one per row), fewer than train.global_batch_size="
                         f"{t.global_batch_size}; lower train.global_batch_size or give more "
                         "examples")
    need = rows * dims.dp if dims.pp > 1 else 1
    if n_val < need:
        raise ValueError(f"data.hf_dataset={d.hf_dataset!r} gives {n_val} validation "
                         f"example(s), fewer than {need}"
                         f"{' (one pipeline batch per data-parallel rank)' if dims.pp > 1 else ''}"
                         "; add a 'validation' split or more rows")


def _readable_tokens(cfg, source: str):
    """The run's token splits; a file that cannot be read or written is one line naming the
    [data] key it comes from."""
    try:
        return tokens.load_tokens(cfg)
    except OSError as err:
        where = err.filename or source
        cache = cfg.data.cache_dir or "~/.cache/meshfit/tokens"
        cache_path, at = Path(cache).expanduser(), Path(str(where))
        in_cache = at == cache_path or cache_path in at.parents or at in cache_path.parents
        field = (f"data.cache_dir={cache!r}" + ("" if cfg.data.cache_dir else " (the default)")
                 if in_cache else source)
        raise ValueError(f"{field}: cannot use {where} ({err.strerror or err}); make it readable "
                         "(and the cache folder writable) or point the setting elsewhere") from None


def _check_validation_windows(cfg, source: str, n_val: int, dims, rows: int) -> None:
    """The validation split holds one window (under pp: one pipeline batch of `rows` per
    data-parallel rank)."""
    from meshfit.data import DEFAULT_VAL_FRACTION

    t = cfg.train
    val_windows = max(0, n_val - 1) // t.seq_len
    need_val = rows * dims.dp if dims.pp > 1 else 1
    if val_windows < need_val:
        unit = (f"one pipeline batch of {rows} per data-parallel rank x {dims.dp}"
                if dims.pp > 1 else "one")
        raise ValueError(
            f"{source} gives {val_windows} validation windows of train.seq_len={t.seq_len} "
            f"tokens ({n_val} tokens), fewer than {unit}; lower train.seq_len"
            f"{' or train.micro_batch_size' if dims.pp > 1 else ''}, or give more data "
            f"(validation takes whole files, or the last {DEFAULT_VAL_FRACTION:.0%} of the "
            "tokens)")
