"""Run configuration: frozen dataclasses, read from TOML plus ``--section.key=value`` overrides.

Every field has one spelling; unknown sections and keys are rejected and listed, and each value
is checked in ``__post_init__`` with an error that names the field, the value and the fix.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from typing import get_args

# No torch below: a bad value is refused before torch loads (the modules that build and run
# the model are imported where they are used).
from meshfit.distributed.dims import AXES, ParallelDims
from meshfit.models.config import AttentionBackend, GPTConfig
from meshfit.optim_names import OPTIMIZERS
from meshfit.parallel.layout import Layout, ModelFacts, check_options
from meshfit.parallel.options import (SCHEDULES, CheckpointMode, CheckpointPolicy, CompileScope,
                                      check_compile_args)

# How `meshfit train` spells the layout's fields in its errors (see `meshfit.parallel.layout`).
LAYOUT_NAMES = {
    **{k: f"parallel.{k}" for k in (*AXES, "zero_stage", "offload", "sync_each_batch",
                                     "sequence_parallel", "loss_parallel", "schedule",
                                     "microbatches", "virtual_stages")},
    "parallel": "parallel", "mixed_precision": "train.mixed_precision",
    "find_batch_size": "train.find_batch_size", "seq_len": "train.seq_len"}


def _positive(section: str, name: str, value: Any, *, allow_zero: bool = False) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and (
        value >= 0 if allow_zero else value >= 1)
    if not ok:
        bound = ">= 0" if allow_zero else ">= 1"
        raise ValueError(f"{section}.{name}={value!r} must be an integer {bound}")


def _number(section: str, name: str, value: Any, lo: float, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            lo <= value <= hi) or math.isnan(value):
        raise ValueError(f"{section}.{name}={value!r} must be a number in [{lo}, {hi}]")


def _choice(section: str, name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{section}.{name}={value!r} is not one of {', '.join(choices)}")


def _bool(section: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{section}.{name}={value!r} must be true or false")


_MOE_FIELDS = ("n_experts", "top_k", "moe_every", "moe_d_ff", "shared_experts", "router",
               "capacity_factor", "aux_loss_coef", "router_z_loss_coef")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """[model]: what to train. One source: a reference GPT `preset` (size fields left unset
    take the preset's), a Hugging Face `hf_config` (random weights from the seed) or
    `hf_model` (its weights), or the user's own `factory`."""

    preset: str = "tiny"
    """A `GPTConfig.preset` name: tiny, gpt2, llama-1b, llama-7b, llama-70b (used when none of
    hf_config, hf_model and factory is given)."""
    hf_config: str = ""
    """A Hugging Face config.json (or a folder holding one): that causal LM, built with
    random weights (transformers' init, from train.seed). No download."""
    hf_model: str = ""
    """A local Hugging Face model folder (config.json + safetensors, as save_pretrained
    writes it): built on the meta device, each rank reading only the slices its layout
    needs."""
    factory: str = ""
    """"module:function" returning your own nn.Module (module importable from the current
    folder or PYTHONPATH); called with the keyword arguments it declares among vocab_size and
    max_seq_len. Its forward takes token ids [B, T] and returns logits [B, T, V] (or an
    object with .logits)."""
    tp_plan: str = ""
    """"module:PLAN" — the tensor-parallel plan of a model without a built-in one: a
    `meshfit.models.plans.TPPlan`, a {module pattern: style} dict, or a function of the model
    returning either (built-in: the reference GPT, Llama, Qwen2, Mistral, GPT-2)."""
    pipeline_plan: str = ""
    """"module:PLAN" — where pipeline stages are cut for a model without a built-in plan: a
    `meshfit.models.plans.PipelinePlan` or a function of the model returning one."""
    n_layer: int | None = None
    """Transformer blocks (None: the preset's)."""
    n_head: int | None = None
    """Attention heads (None: the preset's)."""
    d_model: int | None = None
    """Hidden size (None: the preset's)."""
    d_ff: int | None = None
    """MLP hidden size (None: the preset's)."""
    dropout: float | None = None
    """Dropout probability (None: the preset's)."""
    n_experts: int | None = None
    """Mixture of experts: routed experts per MoE block (0: dense; None: the preset's, e.g.
    moe-tiny's 8). See `meshfit.models.GPTConfig` for this and the next fields."""
    top_k: int | None = None
    """Experts each token is routed to (<= n_experts)."""
    moe_every: int | None = None
    """Every this many blocks is an MoE block (1: all)."""
    moe_d_ff: int | None = None
    """Hidden width of each expert (None: d_ff)."""
    shared_experts: int | None = None
    """0 or 1: a dense expert every token also passes through."""
    router: str | None = None
    """"softmax_topk" or "sigmoid_topk"."""
    capacity_factor: float | None = None
    """> 0: each expert keeps at most capacity_factor x its even share of the assignments
    (the rest are dropped and counted); unset: dropless."""
    aux_loss_coef: float | None = None
    """Weight of the load-balancing loss (Switch / GShard)."""
    router_z_loss_coef: float | None = None
    """Weight of the router z-loss (ST-MoE)."""
    attention_backend: str = "auto"
    """SDPA kernel: auto, math, flash, efficient or cudnn (checked on the device before
    launch; the reference GPT only)."""

    def __post_init__(self) -> None:
        if self.preset not in GPTConfig.preset_names():
            raise ValueError(f"model.preset={self.preset!r} is not a preset; use one of "
                             f"{', '.join(GPTConfig.preset_names())}")
        for name in ("n_layer", "n_head", "d_model", "d_ff"):
            if getattr(self, name) is not None:
                _positive("model", name, getattr(self, name))
        if self.dropout is not None:
            _number("model", "dropout", self.dropout, 0.0, 0.99)
        _choice("model", "attention_backend", self.attention_backend, get_args(AttentionBackend))
        for name in ("hf_config", "hf_model", "factory", "tp_plan", "pipeline_plan"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"model.{name}={getattr(self, name)!r} must be a string")
        given = [n for n in ("hf_config", "hf_model", "factory") if getattr(self, n)]
        if len(given) > 1:
            raise ValueError(f"model.{given[0]} and model.{given[1]} are both set; give one "
                             "source of the model")
        sized = [n for n in ("n_layer", "n_head", "d_model", "d_ff", "dropout", *_MOE_FIELDS)
                 if getattr(self, n) is not None]
        if given and sized:
            raise ValueError(f"model.{sized[0]}={getattr(self, sized[0])!r} sizes the reference "
                             f"GPT, but the model comes from model.{given[0]}; change the size "
                             "in that model's config instead")
        if self.hf_config:
            path = Path(self.hf_config).expanduser()
            if not (path.is_file() or (path / "config.json").is_file()):
                raise ValueError(f"model.hf_config={self.hf_config!r} is neither a config.json "
                                 "file nor a folder holding one")
        if self.hf_model:
            from meshfit.checkpoint.pretrained import check_folder

            check_folder(self.hf_model, "model.hf_model")
        for name in ("factory", "tp_plan", "pipeline_plan"):
            spec = getattr(self, name)
            module, sep, attr = spec.partition(":")
            if spec and not (sep and module and attr):
                raise ValueError(f"model.{name}={spec!r} must look like module:attribute, e.g. "
                                 "mymodels:build_model")

        if not given:  # the GPTConfig's own checks (top_k <= n_experts, ...), named here
            try:
                gpt = GPTConfig.preset(self.preset, **{n: getattr(self, n) for n in _MOE_FIELDS
                                                       if getattr(self, n) is not None})
            except (ValueError, TypeError) as err:
                raise ValueError(str(err).replace("GPTConfig.", "model.")) from None
            routed = [n for n in _MOE_FIELDS if n != "n_experts" and getattr(self, n) is not None]
            if routed and not gpt.n_experts:
                raise ValueError(f"model.{routed[0]}={getattr(self, routed[0])!r} configures "
                                 f"mixture-of-experts blocks, but model.preset={self.preset!r} "
                                 "has none (n_experts=0); set model.n_experts or use the "
                                 "moe-tiny preset")

    @property
    def source(self) -> str:
        """Which field gives the model: preset, hf_config, hf_model or factory."""
        return next((n for n in ("hf_config", "hf_model", "factory") if getattr(self, n)),
                    "preset")

    def overrides(self) -> dict[str, Any]:
        keep = ("n_layer", "n_head", "d_model", "d_ff", "dropout", "attention_backend",
                *_MOE_FIELDS)
        return {name: getattr(self, name) for name in keep if getattr(self, name) is not None}


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """[train]: the optimisation loop."""

    steps: int = 400
    """Optimizer steps."""
    global_batch_size: int = 32
    """Sequences per optimizer step, over all data-parallel ranks and micro-batches."""
    micro_batch_size: int = 16
    """Sequences per forward/backward on one rank; accumulation fills the rest."""
    seq_len: int = 128
    """Tokens per sequence."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr * min_lr_ratio."""
    warmup_steps: int = 20
    """Linear warm-up steps."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0: no clipping)."""
    seed: int = 0
    """Seed for weights, data order and dropout."""
    eval_every: int = 100
    """Evaluate validation loss every this many steps (and at the end); 0: only at the end."""
    eval_batches: int = 8
    """Micro-batches per rank in each evaluation."""
    log_every: int = 10
    """Write a metrics line every this many steps."""
    mixed_precision: str = "no"
    """"no", "bf16" or "fp16"."""
    tf32: bool = False
    """TF32 tensor cores for fp32 matrix products (NVIDIA Ampere and newer)."""
    activation_checkpointing: str = "none"
    """"none", "full" (every block) or "selective" (see the two keys below)."""
    activation_checkpointing_every: int = 2
    """selective with policy "block": checkpoint every this many blocks."""
    activation_checkpointing_policy: str = "block"
    """selective: "block" (every n-th block) or "op" (keep matrix-product outputs, recompute
    the rest)."""
    compile: bool = False
    """torch.compile the model."""
    compile_backend: str = "inductor"
    """torch.compile backend: inductor, aot_eager, eager, ..."""
    compile_mode: str = "default"
    """inductor mode: default, reduce-overhead, max-autotune, ..."""
    compile_scope: str = "block"
    """"block" (each transformer block) or "model" (the whole model)."""
    empty_cache_steps: int = 0
    """Release the device allocator's cache every this many steps (0: never)."""
    find_batch_size: bool = False
    """Before training, probe forward + backward and halve the micro-batch (doubling the
    accumulation) until it fits on every rank."""
    timeout_s: int = 300
    """Seconds a collective may wait for the other ranks before the run fails with the
    operation's name (instead of hanging); raise it for steps or checkpoints slower than
    that."""

    def __post_init__(self) -> None:
        for name in ("steps", "global_batch_size", "micro_batch_size", "seq_len",
                     "eval_batches", "log_every"):
            _positive("train", name, getattr(self, name))
        _positive("train", "timeout_s", self.timeout_s)
        for name in ("warmup_steps", "seed", "eval_every", "empty_cache_steps"):
            _positive("train", name, getattr(self, name), allow_zero=True)
        _positive("train", "activation_checkpointing_every", self.activation_checkpointing_every)
        _number("train", "min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        _number("train", "grad_clip", self.grad_clip, 0.0, 1e9)
        check_options(mixed_precision=self.mixed_precision, names=LAYOUT_NAMES)
        for name in ("tf32", "compile", "find_batch_size"):
            _bool("train", name, getattr(self, name))
        _choice("train", "activation_checkpointing", self.activation_checkpointing,
                get_args(CheckpointMode))
        _choice("train", "activation_checkpointing_policy", self.activation_checkpointing_policy,
                get_args(CheckpointPolicy))
        _choice("train", "compile_scope", self.compile_scope, get_args(CompileScope))
        check_compile_args(self.compile_backend,
                           None if self.compile_mode == "default" else self.compile_mode,
                           scope=self.compile_scope, compile=self.compile, prefix="train.")
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(f"train.global_batch_size={self.global_batch_size} must be a "
                             f"multiple of train.micro_batch_size={self.micro_batch_size}")


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """[optim]: the optimizer (`meshfit.optim.build`)."""

    optimizer: str = "adamw_fused"
    """adamw (foreach), adamw_fused, adafactor, adamw_8bit or sgd."""
    lr: float = 3e-3
    """Peak learning rate (warm-up, then cosine decay; see [train])."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices; none on biases and norm weights."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam's moment decay rates (AdamW variants)."""
    eps: float = 1e-8
    """Adam's denominator epsilon."""
    momentum: float = 0.9
    """SGD momentum."""

    def __post_init__(self) -> None:
        _choice("optim", "optimizer", self.optimizer, OPTIMIZERS)
        _number("optim", "lr", self.lr, 1e-12, 10.0)
        _number("optim", "weight_decay", self.weight_decay, 0.0, 10.0)
        _number("optim", "eps", self.eps, 0.0, 1.0)
        _number("optim", "momentum", self.momentum, 0.0, 1.0)
        betas = self.betas
        if not isinstance(betas, (list, tuple)) or len(betas) != 2 or any(
                isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 <= b < 1
                for b in betas):
            raise ValueError(f"optim.betas={betas!r} must be two numbers in [0, 1), "
                             "e.g. [0.9, 0.95]")
        object.__setattr__(self, "betas", tuple(float(b) for b in betas))


@dataclass(frozen=True, kw_only=True)
class PeftConfig:
    """[peft]: parameter-efficient fine-tuning (`meshfit.peft`)."""

    method: str = "none"
    """"none" or "lora"."""
    r: int = 8
    """LoRA rank."""
    alpha: float = 16.0
    """LoRA scaling numerator (the update is scaled by alpha / r)."""
    dropout: float = 0.0
    """Dropout on the LoRA branch's input."""
    target_modules: tuple[str, ...] = ()
    """Module names to adapt; empty: the attention and MLP linears."""
    merge: bool = False
    """At the end, also write the model with the adapters folded into its weights
    (OUT/model/) beside the adapter (OUT/adapter/)."""

    def __post_init__(self) -> None:
        _choice("peft", "method", self.method, ("none", "lora"))
        _bool("peft", "merge", self.merge)
        _positive("peft", "r", self.r)
        _number("peft", "alpha", self.alpha, 1e-12, 1e6)
        _number("peft", "dropout", self.dropout, 0.0, 0.99)
        if isinstance(self.target_modules, str) or not all(
                isinstance(m, str) for m in self.target_modules):
            raise ValueError(f"peft.target_modules={self.target_modules!r} must be a list of "
                             'module names, e.g. ["wq", "wv"]')
        object.__setattr__(self, "target_modules", tuple(self.target_modules))


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """[data]: what to train on."""

    path: str = ""
    """A text file or folder of text files; empty: the Python standard library's source."""
    cache_dir: str = ""
    """Where token caches are kept; empty: ~/.cache/meshfit/tokens."""
    tokenizer: str = "bytes"
    """"bytes" (UTF-8 bytes, vocab 256; empty means the same), or a path to a Hugging Face
    tokenizer folder or a tokenizer.json file; documents are separated by its EOS token."""
    hf_dataset: str = ""
    """A `datasets` dataset on local disk (save_to_disk folder, or a data folder/file that
    datasets.load_dataset reads offline) to train on instead of data.path."""
    text_column: str = "text"
    """The data.hf_dataset column holding each document's text."""
    num_workers: int = 0
    """DataLoader worker processes per rank (0: load in the training process)."""
    prefetch_factor: int = 2
    """Batches each worker loads ahead (with num_workers > 0)."""
    persistent_workers: bool = True
    """Keep the workers alive between epochs and evaluations (with num_workers > 0)."""
    pin_memory: bool = True
    """Page-locked host batches, so the copy to a CUDA device runs asynchronously (ignored
    without CUDA)."""

    def __post_init__(self) -> None:
        _positive("data", "num_workers", self.num_workers, allow_zero=True)
        _positive("data", "prefetch_factor", self.prefetch_factor)
        for name in ("persistent_workers", "pin_memory"):
            _bool("data", name, getattr(self, name))
        for name in ("path", "cache_dir"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"data.{name}={getattr(self, name)!r} must be a path (a string)")
        if self.cache_dir:
            cache = Path(self.cache_dir).expanduser()
            above = next((p for p in (cache, *cache.parents) if p.exists()), None)
            if above is not None and not above.is_dir():
                raise ValueError(f"data.cache_dir={self.cache_dir!r}: {above} is a file, not a "
                                 "folder; give a folder for the token caches (it is created "
                                 "if missing)")
        if self.path and not Path(self.path).expanduser().exists():
            raise ValueError(f"data.path={self.path!r} does not exist; give a text file or a "
                             "folder of text files, or leave it empty for the built-in corpus")
        if not isinstance(self.tokenizer, str):
            raise ValueError(f'data.tokenizer={self.tokenizer!r} must be "bytes" or a path to a '
                             "Hugging Face tokenizer folder or tokenizer.json file")
        if self.tokenizer not in ("", "bytes") and \
                not Path(self.tokenizer).expanduser().exists():
            raise ValueError(f"data.tokenizer={self.tokenizer!r} does not exist; give \"bytes\", "
                             "a Hugging Face tokenizer folder or a tokenizer.json file")
        if not isinstance(self.hf_dataset, str):
            raise ValueError(f"data.hf_dataset={self.hf_dataset!r} must be a path (a string); "
                             "leave it empty to train on data.path")
        if self.hf_dataset and self.path:
            raise ValueError(f"data.path={self.path!r} and data.hf_dataset={self.hf_dataset!r} "
                             "are mutually exclusive; set only one of them")
        if self.hf_dataset and not Path(self.hf_dataset).expanduser().exists():
            raise ValueError(f"data.hf_dataset={self.hf_dataset!r} does not exist; give a "
                             "folder written by save_to_disk or a local data folder/file")
        if not isinstance(self.text_column, str) or not self.text_column:
            raise ValueError(f"data.text_column={self.text_column!r} must be a column name, "
                             'e.g. "text"')


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """[parallel]: sizes of the mesh axes (see `meshfit.ParallelDims`) and ZeRO sharding
    (see `meshfit.Accelerator`)."""

    pp: int = 1
    dp_replicate: int = -1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    zero_stage: int | None = None
    """0 (DDP), 1 (optimizer state sharded), 2 (+ gradients), 3 (+ parameters) over the
    dp_shard ranks; unset: 3 when dp_shard > 1, else 0."""
    offload: str = "none"
    """"cpu": sharded parameters, gradients and optimizer state in host memory (stage 3)."""
    sync_each_batch: bool | str = False
    """Stages 2/3 under accumulation: reduce-scatter every micro-batch (true: less memory),
    only on the last (false: fewer collectives), or "auto" (decided from free memory)."""
    schedule: str = "1f1b"
    """pp > 1: "gpipe", "1f1b", "interleaved_1f1b" or "zero_bubble"."""
    microbatches: int | None = None
    """pp > 1: micro-batches ("chunks") per pipeline step; the global batch is
    micro_batch_size x microbatches x data-parallel ranks x accumulation. Unset: all of the
    accumulation, i.e. global_batch_size / (micro_batch_size x data-parallel ranks)."""
    virtual_stages: int | None = None
    """pp > 1: stages per rank (unset: 1, or 2 for interleaved_1f1b and zero_bubble)."""
    sequence_parallel: bool = False
    """tp > 1: norms and dropout on a sequence shard (train.seq_len must divide by tp)."""
    loss_parallel: bool = False
    """tp > 1: the loss on vocabulary-sharded logits, never gathering them (not with pp)."""

    def __post_init__(self) -> None:
        self.dims()  # ParallelDims validates each size
        check_options(zero_stage=self.zero_stage, offload=self.offload,
                      sync_each_batch=self.sync_each_batch,
                      sequence_parallel=self.sequence_parallel, loss_parallel=self.loss_parallel,
                      names=LAYOUT_NAMES)
        _choice("parallel", "schedule", self.schedule, SCHEDULES)
        for name in ("microbatches", "virtual_stages"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"parallel.{name}={value!r} must be a positive integer (or "
                                 "unset)")

    def dims(self, world_size: int | None = None) -> ParallelDims:
        return ParallelDims(world_size=world_size, **{n: getattr(self, n) for n in AXES})


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """[checkpoint]: sharded checkpoints of the whole training state in OUT/checkpoints/step-N/
    (`Accelerator.save_state`), for `meshfit train --out OUT --resume`."""

    every: int = 0
    """Save every this many optimizer steps, and at the last step (0: no checkpoints)."""
    keep: int = 3
    """Complete checkpoints kept: older ones are deleted once a newer one is committed."""
    async_save: bool = field(default=False, metadata={"toml": "async"})
    """(TOML key `async`) Write in the background while training goes on: the state is
    copied to host memory, files are written by a thread, and the checkpoint is committed
    (manifest, rename) at the next save or at the end."""

    def __post_init__(self) -> None:
        _positive("checkpoint", "every", self.every, allow_zero=True)
        _positive("checkpoint", "keep", self.keep)
        _bool("checkpoint", "async", self.async_save)


@dataclass(frozen=True, kw_only=True)
class LogConfig:
    """[log]: where a run's figures go besides OUT/metrics.jsonl (always written) and the
    terminal (a progress bar on a terminal, plain lines otherwise)."""

    with_: list[str] = field(default_factory=list, metadata={"toml": "with"})
    """(TOML key `with`) trackers: "tensorboard", "wandb" (offline unless WANDB_MODE says
    otherwise), "mlflow" (a local store under OUT unless MLFLOW_TRACKING_URI is set), "csv",
    or "all" (those installed); written under OUT/tracking/ by the main process."""
    project: str = "meshfit"
    """The run's name in the trackers (TensorBoard folder, W&B project, MLflow experiment)."""
    calibration: str = ""
    """A `meshfit calibrate` file: its measured matmul FLOP/s is the device peak for the MFU
    figure (unset: the data sheet of a known GPU; "n/a" on a CPU)."""

    def __post_init__(self) -> None:
        from meshfit.tracking import resolve_names

        if isinstance(self.with_, str):  # --log.with=tensorboard: one tracker
            object.__setattr__(self, "with_", [self.with_] if self.with_ else [])
        if not isinstance(self.with_, list) or not all(
                isinstance(x, str) for x in self.with_):
            raise ValueError(f"log.with={self.with_!r} must be a list of tracker names, e.g. "
                             '["tensorboard", "csv"]')
        resolve_names(self.with_, field="log.with")
        if not isinstance(self.project, str) or not self.project:
            raise ValueError(f"log.project={self.project!r} must be a non-empty name")
        if not isinstance(self.calibration, str):
            raise ValueError(f"log.calibration={self.calibration!r} must be the path of a "
                             "`meshfit calibrate` file (a string)")
        if self.calibration:
            from meshfit.plan.calibrate import load_calibration

            load_calibration(self.calibration)  # one line if missing or of another schema


def _toml_name(f) -> str:
    return f.metadata.get("toml", f.name)


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """A whole `meshfit train` run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def grad_accumulation(self, world_size: int) -> int:
        """Micro-batches per step on each rank so that the global batch is as configured
        (with pp > 1: pipeline steps per optimizer step, see `microbatches`)."""
        dims = self.parallel.dims().resolve(world_size)
        per_step = self.train.micro_batch_size * dims.dp
        if self.train.global_batch_size % per_step:
            raise ValueError(
                f"train.global_batch_size={self.train.global_batch_size} must be a multiple of "
                f"micro_batch_size x data-parallel ranks = {self.train.micro_batch_size} x "
                f"{dims.dp} = {per_step}; change one of them")
        accum = self.train.global_batch_size // per_step
        if dims.pp == 1:
            return accum
        m = self.microbatches(world_size)
        if accum % m:
            raise ValueError(
                f"parallel.microbatches={m} does not divide the {accum} micro-batches of "
                f"{self.train.micro_batch_size} sequences that make up each data-parallel "
                f"rank's share of train.global_batch_size={self.train.global_batch_size}; "
                "use a divisor of it (global batch = micro_batch_size x microbatches x "
                "data-parallel ranks x accumulation)")
        return accum // m

    def microbatches(self, world_size: int) -> int:
        """Micro-batches per pipeline step (1 without pp)."""
        dims = self.parallel.dims().resolve(world_size)
        if dims.pp == 1:
            return 1
        if self.parallel.microbatches is not None:
            return self.parallel.microbatches
        return max(1, self.train.global_batch_size // (self.train.micro_batch_size * dims.dp))

    def layout(self, world_size: int, local_world_size: int | None = None) -> Layout:
        """The run's `Layout` on `world_size` processes (errors name the config keys)."""
        p = self.parallel
        return Layout.resolve(p.dims(), world_size, zero_stage=p.zero_stage, offload=p.offload,
                              mixed_precision=self.train.mixed_precision,
                              sequence_parallel=p.sequence_parallel,
                              loss_parallel=p.loss_parallel, local_world_size=local_world_size,
                              names=LAYOUT_NAMES)

    def model_config(self):
        """The reference GPT's config for this run: [model] over its preset, train.seq_len as
        the context, the tokenizer's vocabulary."""
        return GPTConfig.preset(self.model.preset, max_seq_len=self.train.seq_len,
                                vocab_size=self.vocab_size(), **self.model.overrides())

    def tokenizer(self):
        """The run's tokenizer ([data] tokenizer: bytes, or a Hugging Face tokenizer)."""
        from meshfit.data import ByteTokenizer

        spec = getattr(self.data, "tokenizer", "bytes")
        if spec in ("", "bytes"):
            return ByteTokenizer()
        from meshfit.data import load_tokenizer

        return load_tokenizer(spec)

    def vocab_size(self) -> int:
        """Token ids the run's tokenizer gives (the reference GPT's vocabulary)."""
        return int(self.tokenizer().vocab_size)

    def load_tokens(self):
        """The run's token splits ([data]: text files, a datasets dataset or the built-in
        corpus, through the run's tokenizer; cached)."""
        from meshfit.data import load_tokens

        d = self.data
        extra = {}
        if hasattr(d, "hf_dataset"):
            extra = dict(tokenizer=self.tokenizer(), hf_dataset=d.hf_dataset or None,
                         text_column=d.text_column)
        return load_tokens(d.path or None, cache_dir=d.cache_dir or None, **extra)

    def validate_for(self, world_size: int, local_world_size: int | None = None) -> Layout:
        """Checks that need the number of processes (run before launching any); returns the
        run's layout."""
        layout = self.layout(world_size, local_world_size)
        self.grad_accumulation(world_size)
        if self.train.find_batch_size:
            layout.check_batch_probe(names=LAYOUT_NAMES)
        if layout.dims.ep > 1 and self.peft.method != "none":
            raise ValueError(f"peft.method={self.peft.method!r} with parallel.ep > 1 is not yet "
                             "available (LoRA adapts linear layers; the experts are stacked "
                             "weights split over the ep ranks); use peft.method='none' or ep=1")
        if layout.dims.tp > 1 or layout.dims.pp > 1 or layout.dims.ep > 1:
            if self.peft.method != "none":
                raise ValueError(f"peft.method={self.peft.method!r} with parallel.tp/pp > 1 is "
                                 "not yet available: LoRA wraps each adapted linear in a "
                                 "peft LoraLayer (its weight moves to base_layer), which the "
                                 "tensor-parallel plans and pipeline stages do not name; use "
                                 "peft.method='none' or tp = pp = 1 (data parallel and ZeRO "
                                 "work with LoRA)")
            from meshfit.train.models import check_model_source, plans, resolve_plan

            model = check_model_source(self, self.vocab_size())  # on the meta device
            from meshfit.models.plans import has_builtin_plans

            tp_plan, pp_plan = (resolve_plan(p, model) for p in plans(self))
            builtin, name = has_builtin_plans(model), type(model).__name__
            if layout.dims.tp > 1 and tp_plan is None and not builtin:
                raise ValueError(f"parallel.tp={layout.dims.tp}: {name} has no built-in "
                                 "tensor-parallel plan; give one as model.tp_plan = "
                                 "\"module:PLAN\" (a TPPlan or {module pattern: style}; in "
                                 "your own loop: Accelerator(tp_plan=PLAN))")
            if layout.dims.pp > 1 and pp_plan is None and not builtin:
                raise ValueError(f"parallel.pp={layout.dims.pp}: {name} has no built-in "
                                 "pipeline plan; give one as model.pipeline_plan = "
                                 "\"module:PLAN\" (a PipelinePlan; in your own loop: "
                                 "accelerator.prepare_pipeline(model, plan=PLAN, ...))")
            if layout.dims.pp == 1 and pp_plan is None and not builtin:
                facts = ModelFacts(n_blocks=1, divisible=tuple(getattr(tp_plan, "divisible",
                                                                       ())))
            else:
                facts = ModelFacts.of(model, pipeline_plan=pp_plan, tp_plan=tp_plan)
            layout.check_model(facts, seq_len=self.train.seq_len, schedule=self.parallel.schedule,
                               microbatches=self.microbatches(world_size),
                               virtual_stages=self.parallel.virtual_stages, names=LAYOUT_NAMES)
        from meshfit.models.factory import import_object

        for name in ("factory", "tp_plan", "pipeline_plan"):  # a missing module or name, named
            if getattr(self.model, name):                    # before the model is built
                import_object(getattr(self.model, name), f"model.{name}")
        return layout

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Sections and keys as the TOML file spells them."""
        return {s.name: {_toml_name(f): dataclasses.asdict(getattr(self, s.name))[f.name]
                         for f in fields(getattr(self, s.name))} for s in fields(self)}

    def to_toml(self) -> str:
        lines = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            for key, value in values.items():
                if value is not None:  # TOML has no null; unset means "the default"
                    lines.append(f"{key} = {json.dumps(value)}")
            lines.append("")
        return "\n".join(lines)


_SECTIONS = {f.name: f.default_factory for f in fields(RunConfig)}  # type: ignore[misc]


def _parse_value(text: str) -> Any:
    """A TOML literal (3, 1e-3, true, "x") or, failing that, the bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def build_config(data: dict[str, Any]) -> RunConfig:
    """A validated RunConfig from nested dicts; unknown sections/keys are listed in the error."""
    unknown_sections = sorted(set(data) - set(_SECTIONS))
    if unknown_sections:
        raise ValueError(f"unknown config section(s) {', '.join(unknown_sections)}; known: "
                         f"{', '.join(_SECTIONS)}")
    sections = {}
    for name, factory in _SECTIONS.items():
        values = data.get(name, {})
        if not isinstance(values, dict):
            raise ValueError(f"config section [{name}] must be a table of keys, not "
                             f"{name} = {values!r}; write [{name}] followed by key = value lines")
        cls = type(factory())
        known = {_toml_name(f): f.name for f in fields(cls) if f.init}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"unknown key(s) in [{name}]: {', '.join(unknown)}; known keys: "
                             f"{', '.join(sorted(known))}")
        sections[name] = cls(**{known[k]: v for k, v in values.items()})
    return RunConfig(**sections)


def load_config(path: str | Path | None = None, overrides: list[str] = (), *,
                allowed: tuple[str, ...] | None = None) -> RunConfig:
    """Read a TOML file (optional) and apply ``--section.key=value`` overrides (only of the
    sections in `allowed`, when given)."""
    data: dict[str, dict[str, Any]] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            what = "is a folder" if path.is_dir() else "does not exist"
            raise ValueError(f"--config={str(path)!r} {what}; give a TOML file")
        try:
            text = path.read_bytes().decode("utf-8")
        except OSError as err:
            raise ValueError(f"--config={str(path)!r} cannot be read ({err.strerror or err}); "
                             "give a readable TOML file") from None
        except UnicodeDecodeError as err:
            raise ValueError(f"--config={str(path)!r} is not UTF-8 text (byte {err.start}); "
                             "give a TOML file") from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            reason = " ".join(str(err).split())  # one line, with its line and column
            raise ValueError(f"--config={str(path)!r} is not valid TOML: {reason}") from None
    for item in overrides:
        key, sep, value = item.removeprefix("--").partition("=")
        section, dot, name = key.partition(".")
        if not sep or not dot or not section or not name:
            raise ValueError(f"override {item!r} must look like --section.key=value, "
                             "e.g. --train.steps=100")
        if allowed is not None and section not in allowed:
            raise ValueError(f"override {item!r}: a resumed run keeps its saved config except "
                             f"[{'], ['.join(allowed)}]; start a new run to change {key}")
        table = data.setdefault(section, {})
        if not isinstance(table, dict):
            raise ValueError(f"override {item!r}: {section} = {table!r} in the config is a value, "
                             f"not a [{section}] table of keys; write [{section}] followed by "
                             "key = value lines")
        table[name] = _parse_value(value)
    return build_config(data)
