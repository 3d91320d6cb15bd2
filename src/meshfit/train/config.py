"""A run's configuration: frozen dataclasses, one per [section] of the TOML file, each value
checked in ``__post_init__`` (`meshfit.train.preflight`); `RunConfig` adds what follows from its
fields (accumulation, micro-batches, the `Layout`; the tokenizer and token splits from
`meshfit.train.tokens`). `meshfit.train.configfile` reads and writes the TOML file. No torch at
load: a bad value is refused before torch loads (a [model] hf_model folder is read).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_args

from meshfit.data import column_keys, data_format, format_names
from meshfit.data.corpus import data_source
from meshfit.models.config import AttentionBackend, GPTConfig
from meshfit.models.factory import check_folder_code
from meshfit.optim_names import OPTIMIZERS
from meshfit.parallel.layout import Layout, check_precision
from meshfit.parallel.options import ModelOptions
from meshfit.parallel.request import LayoutRequest
from meshfit.train.preflight import (LAYOUT_NAMES, check_bool, check_choice, check_layout,
                                     check_number, check_positive)

DEFAULT_WARMUP = 20
"""train.warmup_steps when unset, for runs of 200 steps or more (a tenth of shorter ones)."""
MOE_FIELDS = ("n_experts", "top_k", "moe_every", "moe_d_ff", "shared_experts", "router",
              "capacity_factor", "aux_loss_coef", "router_z_loss_coef")
"""[model]'s mixture-of-experts fields (see `meshfit.models.GPTConfig`)."""


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
    """A local Hugging Face model folder (config.json + safetensors, as save_pretrained writes it):
    built on the meta device, each rank reading only the slices its layout needs."""
    factory: str = ""
    """"module:function" returning your own nn.Module (module importable from the current folder or
    PYTHONPATH); called with the keyword arguments it declares among vocab_size and max_seq_len. Its
    forward takes token ids [B, T] and returns logits [B, T, V] (or an object with .logits)."""
    tp_plan: str = ""
    """"module:PLAN" — the tensor-parallel plan of a model without a built-in one: a
    `meshfit.models.plans.TPPlan`, a {module pattern: style} dict, or a function of the model
    returning either (built-in: the reference GPT, Llama, Qwen2, Mistral, GPT-2)."""
    pipeline_plan: str = ""
    """"module:PLAN" — where pipeline stages are cut for a model without a built-in plan: a
    `meshfit.models.plans.PipelinePlan` or a function of the model returning one."""
    trust_code: bool = False
    """Run code that the hf_config / hf_model folder's config.json names (transformers'
    remote code, ``auto_map``), as transformers' trust_remote_code: only for a folder whose
    writer you trust. Without it such a folder is refused before anything runs."""
    n_layer: int | None = None  # Transformer blocks (None: the preset's)
    n_head: int | None = None  # Attention heads (None: the preset's)
    d_model: int | None = None  # Hidden size (None: the preset's)
    d_ff: int | None = None  # MLP hidden size (None: the preset's)
    dropout: float | None = None  # Dropout probability (None: the preset's)
    n_experts: int | None = None
    """Mixture of experts: routed experts per MoE block (0: dense; None: the preset's, e.g.
    moe-tiny's 8). See `meshfit.models.GPTConfig` for this and the next fields."""
    top_k: int | None = None  # Experts each token is routed to (<= n_experts)
    moe_every: int | None = None  # Every this many blocks is an MoE block (1: all)
    moe_d_ff: int | None = None  # Hidden width of each expert (None: d_ff)
    shared_experts: int | None = None  # 0 or 1: a dense expert every token also passes through
    router: str | None = None  # "softmax_topk" or "sigmoid_topk"
    capacity_factor: float | None = None
    """> 0: each expert keeps at most capacity_factor x its even share of the assignments
    (the rest are dropped and counted); unset: dropless."""
    aux_loss_coef: float | None = None  # Weight of the load-balancing loss (Switch / GShard)
    router_z_loss_coef: float | None = None  # Weight of the router z-loss (ST-MoE)
    attention_backend: str = "auto"
    """SDPA kernel: auto, math, flash, efficient or cudnn (checked on the device before
    launch; the reference GPT only)."""

    def __post_init__(self) -> None:
        if self.preset not in GPTConfig.preset_names():
            raise ValueError(f"model.preset={self.preset!r} is not a preset; use one of "
                             f"{', '.join(GPTConfig.preset_names())}")
        for name in ("n_layer", "n_head", "d_model", "d_ff"):
            if getattr(self, name) is not None:
                check_positive("model", name, getattr(self, name))
        if self.dropout is not None:
            check_number("model", "dropout", self.dropout, 0.0, 0.99)
        check_choice("model", "attention_backend", self.attention_backend,
                     get_args(AttentionBackend))
        for name in ("hf_config", "hf_model", "factory", "tp_plan", "pipeline_plan"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"model.{name}={getattr(self, name)!r} must be a string")
        given = [n for n in ("hf_config", "hf_model", "factory") if getattr(self, n)]
        if len(given) > 1:
            raise ValueError(f"model.{given[0]} and model.{given[1]} are both set; give one "
                             "source of the model")
        sized = [n for n in ("n_layer", "n_head", "d_model", "d_ff", "dropout", *MOE_FIELDS)
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
        check_bool("model", "trust_code", self.trust_code)
        for name in ("hf_config", "hf_model"):  # before the folder is opened by anything
            if getattr(self, name):
                check_folder_code(getattr(self, name), trust_code=self.trust_code,
                                  field=f"model.{name}", how="model.trust_code = true "
                                  "(--model.trust_code=true)", factories=False)
        if self.hf_model:
            from meshfit.checkpoint.pretrained import check_folder  # (imports torch)

            check_folder(self.hf_model, "model.hf_model")
        for name in ("factory", "tp_plan", "pipeline_plan"):
            spec = getattr(self, name)
            module, sep, attr = spec.partition(":")
            if spec and not (sep and module and attr):
                raise ValueError(f"model.{name}={spec!r} must look like module:attribute, e.g. "
                                 "mymodels:build_model")
        if not given:
            self._check_preset()

    def _check_preset(self) -> None:
        """The GPTConfig's own checks (top_k <= n_experts, ...), named as [model] keys."""
        try:
            gpt = GPTConfig.preset(self.preset, **{n: getattr(self, n) for n in MOE_FIELDS
                                                   if getattr(self, n) is not None})
        except (ValueError, TypeError) as err:
            raise ValueError(str(err).replace("GPTConfig.", "model.")) from None
        routed = [n for n in MOE_FIELDS if n != "n_experts" and getattr(self, n) is not None]
        if routed and not gpt.n_experts:
            raise ValueError(f"model.{routed[0]}={getattr(self, routed[0])!r} configures "
                             f"mixture-of-experts blocks, but model.preset={self.preset!r} has "
                             "none (n_experts=0); set model.n_experts or use the moe-tiny preset")

    @property
    def source(self) -> str:
        """Which field gives the model: preset, hf_config, hf_model or factory."""
        return next((n for n in ("hf_config", "hf_model", "factory") if getattr(self, n)), "preset")

    def overrides(self) -> dict[str, Any]:
        """The reference GPT's fields this section sets (over its preset's)."""
        keep = ("n_layer", "n_head", "d_model", "d_ff", "dropout", "attention_backend", *MOE_FIELDS)
        return {name: getattr(self, name) for name in keep if getattr(self, name) is not None}


@dataclass(frozen=True, kw_only=True)
class TrainConfig(ModelOptions):
    """[train]: the optimisation loop, and how each block is checkpointed and compiled (the
    fields of `meshfit.parallel.options.ModelOptions`, spelled as `Accelerator`'s keywords:
    activation_checkpointing, _every, _policy, compile, compile_backend, _mode, _scope)."""

    steps: int = 400  # Optimizer steps
    global_batch_size: int = 32
    """Sequences per optimizer step, over all data-parallel ranks and micro-batches."""
    micro_batch_size: int = 16
    """Sequences per forward/backward on one rank; accumulation fills the rest."""
    seq_len: int = 128  # Tokens per sequence
    min_lr_ratio: float = 0.1  # Cosine decay ends at lr * min_lr_ratio
    warmup_steps: int | None = None
    """Linear warm-up steps; unset: a tenth of train.steps, at most 20. (Resolved when the
    config is read, so that config.toml holds the number a resume keeps.)"""
    grad_clip: float = 1.0  # Clip the global gradient norm to this (0: no clipping)
    seed: int = 0  # Seed for weights, data order and dropout
    eval_every: int = 100  # Evaluate every this many steps and at the end (0: at the end only)
    eval_windows: int = 128
    """Validation windows per evaluation: the first eval_windows windows of train.seq_len
    tokens of the validation split (all of it if shorter), each counted once, whatever the
    micro-batch, the accumulation or the layout (the key eval_batches of older configs
    means eval_batches x micro_batch_size of them)."""
    log_every: int = 10  # Write a metrics line every this many steps
    mixed_precision: str = "no"  # "no", "bf16" or "fp16"
    tf32: bool = False  # TF32 tensor cores for fp32 matrix products (NVIDIA Ampere and newer)
    empty_cache_steps: int = 0  # Release the allocator's cache every this many steps (0: never)
    find_batch_size: bool = False
    """Before training, probe forward + backward and halve the micro-batch (doubling the
    accumulation) until it fits on every rank."""
    timeout_s: int = 300
    """Seconds a collective may wait for the other ranks before the run fails with the operation's
    name (instead of hanging); raise it for steps or checkpoints slower than that."""

    def __post_init__(self) -> None:
        for name in ("steps", "global_batch_size", "micro_batch_size", "seq_len",
                     "eval_windows", "log_every"):
            check_positive("train", name, getattr(self, name))
        # A collective's deadline in milliseconds must fit C++'s clocks: a year is plenty.
        check_positive("train", "timeout_s", self.timeout_s, most=366 * 86400)
        if self.warmup_steps is None:  # a short run is not all warm-up
            object.__setattr__(self, "warmup_steps", min(DEFAULT_WARMUP, self.steps // 10))
        for name in ("warmup_steps", "eval_every", "empty_cache_steps"):
            check_positive("train", name, getattr(self, name), allow_zero=True)
        # The data order's seed is train.seed + epoch, in a 64-bit generator.
        check_positive("train", "seed", self.seed, allow_zero=True, most=2**63 - 1 - 2**32)
        check_number("train", "min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        check_number("train", "grad_clip", self.grad_clip, 0.0, 1e9)
        check_precision(self.mixed_precision, names=LAYOUT_NAMES)
        for name in ("tf32", "find_batch_size"):
            check_bool("train", name, getattr(self, name))
        self.check(prefix="train.")  # the ModelOptions fields
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(f"train.global_batch_size={self.global_batch_size} must be a "
                             f"multiple of train.micro_batch_size={self.micro_batch_size}")

    @property
    def eval_batches(self) -> int:
        """(Before eval_windows) the validation set in micro-batches, rounded up: code that
        read this key keeps working; `RunConfig.eval_windows` is the count."""
        return -(-self.eval_windows // self.micro_batch_size)


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """[optim]: the optimizer (`meshfit.optim.build`)."""

    optimizer: str = "adamw_fused"  # adamw (foreach), adamw_fused, adafactor, adamw_8bit, sgd or muon
    # (also adamw_bf16_states: moments in bf16, 4 B/param; adamw_4bit: torchao, ~1.06 B/param)
    lr: float = 3e-3  # Peak learning rate (warm-up, then cosine decay; see [train])
    weight_decay: float = 0.1  # Decoupled weight decay on matrices; none on biases and norm weights
    betas: tuple[float, float] = (0.9, 0.95)  # Adam's moment decay rates (AdamW variants)
    eps: float = 1e-8  # Adam's denominator epsilon
    momentum: float = 0.9  # SGD momentum
    muon_lr: float = 0.02  # Muon's learning rate on the blocks' matrices (the rest: lr, AdamW)
    muon_momentum: float = 0.95  # Muon's momentum (Nesterov's with muon_nesterov)
    muon_nesterov: bool = True  # Nesterov momentum in Muon (torch.optim.Muon's default)
    muon_ns_steps: int = 5  # Newton-Schulz iterations per step
    muon_adjust_lr: str = "original"  # Per-matrix lr scale: "original" or "match_rms_adamw"
    muon_exclude: tuple[str, ...] = ()  # Block matrices (name substrings) to step with AdamW
    muon_whole: str = "owner"  # Sharded matrices made whole by an owner rank, or "gather"

    def __post_init__(self) -> None:
        check_choice("optim", "optimizer", self.optimizer, OPTIMIZERS)
        self._check_muon()
        check_number("optim", "lr", self.lr, 1e-12, 10.0)
        check_number("optim", "weight_decay", self.weight_decay, 0.0, 10.0)
        check_number("optim", "eps", self.eps, 0.0, 1.0)
        check_number("optim", "momentum", self.momentum, 0.0, 1.0)
        betas = self.betas
        if not isinstance(betas, (list, tuple)) or len(betas) != 2 or any(
                isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 <= b < 1
                for b in betas):
            raise ValueError(f"optim.betas={betas!r} must be two numbers in [0, 1), "
                             "e.g. [0.9, 0.95]")
        object.__setattr__(self, "betas", tuple(float(b) for b in betas))

    def _check_muon(self) -> None:
        check_number("optim", "muon_lr", self.muon_lr, 1e-12, 10.0)
        check_number("optim", "muon_momentum", self.muon_momentum, 0.0, 1.0)
        check_bool("optim", "muon_nesterov", self.muon_nesterov)
        check_positive("optim", "muon_ns_steps", self.muon_ns_steps, most=99)
        check_choice("optim", "muon_adjust_lr", self.muon_adjust_lr,
                     ("original", "match_rms_adamw"))
        check_choice("optim", "muon_whole", self.muon_whole, ("owner", "gather"))
        if isinstance(self.muon_exclude, str) or not all(
                isinstance(m, str) and m for m in self.muon_exclude):
            raise ValueError(f"optim.muon_exclude={self.muon_exclude!r} must be a list of "
                             'parameter-name substrings, e.g. ["router"]')
        object.__setattr__(self, "muon_exclude", tuple(self.muon_exclude))

    def muon_kwargs(self) -> dict[str, Any]:
        """`meshfit.optim.build`'s Muon arguments from this section (empty unless
        optimizer = "muon")."""
        if self.optimizer != "muon":
            return {}
        return {"muon_lr": self.muon_lr, "muon_momentum": self.muon_momentum,
                "nesterov": self.muon_nesterov, "ns_steps": self.muon_ns_steps,
                "adjust_lr_fn": self.muon_adjust_lr, "muon_exclude": self.muon_exclude,
                "whole": self.muon_whole}


@dataclass(frozen=True, kw_only=True)
class PeftConfig:
    """[peft]: parameter-efficient fine-tuning (`meshfit.peft`)."""

    method: str = "none"
    """"none", "lora", or "qlora" (LoRA on the base's linear weights held in 4 bits, NF4:
    needs torchao and a pretrained model.hf_model)."""
    r: int = 8  # LoRA rank
    alpha: float = 16.0  # LoRA scaling numerator (the update is scaled by alpha / r)
    dropout: float = 0.0  # Dropout on the LoRA branch's input
    target_modules: tuple[str, ...] = ()
    """Module names to adapt; empty: the attention and MLP linears."""
    merge: bool = False
    """At the end, also write the model with the adapters folded into its weights
    (OUT/model/) beside the adapter (OUT/adapter/)."""

    def __post_init__(self) -> None:
        check_choice("peft", "method", self.method, ("none", "lora", "qlora"))
        check_bool("peft", "merge", self.merge)
        check_positive("peft", "r", self.r)
        check_number("peft", "alpha", self.alpha, 1e-12, 1e6)
        check_number("peft", "dropout", self.dropout, 0.0, 0.99)
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
    cache_dir: str = ""  # Where token caches are kept; empty: ~/.cache/meshfit/tokens
    tokenizer: str = "bytes"
    """"bytes" (UTF-8 bytes, vocab 256; empty means the same), or a path to a Hugging Face
    tokenizer folder or a tokenizer.json file; documents are separated by its EOS token."""
    hf_dataset: str = ""
    """A `datasets` dataset on local disk (save_to_disk folder, or a data folder/file that
    datasets.load_dataset reads offline) to train on instead of data.path."""
    text_column: str = column_keys()["text_column"]
    """format "text": the data.hf_dataset column holding each document's text ("text")."""
    format: str = "text"
    """How a row becomes training tokens, a format of `meshfit.data.formats`: "text"
    (documents packed, every token trained), "completion" (prompt and completion columns:
    only the completion trained) or "chat" (a messages column rendered by the tokenizer's
    chat template: only the assistant's turns trained); see `meshfit.data.examples`."""
    # Each column's default is its format's (`meshfit.data.formats`).
    prompt_column: str = column_keys()["prompt_column"]
    """format "completion": the prompt's column ("prompt")."""
    completion_column: str = column_keys()["completion_column"]
    """format "completion": the completion's column ("completion")."""
    messages_column: str = column_keys()["messages_column"]
    """format "chat": the column of [{role, content}] lists ("messages")."""
    chat_template: str = ""
    """format "chat": a Jinja template (a file, or the text) instead of the tokenizer's."""
    train_on_prompt: bool = False
    """Train on every token of an example (prompt and user turns too), not only the answer."""
    packing: bool = False
    """format "completion"/"chat": several examples per row, attention kept inside each
    (the reference GPT and Hugging Face models; not with pp or tp yet)."""
    document_mask: bool = False
    """format "text": keep each packed document to itself (positions restart after EOS,
    attention never crosses it, a document's first token is no target; the reference GPT
    and Hugging Face models, not with pp or tp yet)."""
    num_workers: int = 0  # DataLoader worker processes per rank (0: load in the training process)
    prefetch_factor: int = 2  # Batches each worker loads ahead (with num_workers > 0)
    persistent_workers: bool = True
    """Keep the workers alive between epochs and evaluations (with num_workers > 0)."""
    pin_memory: bool = True
    """Page-locked host batches, so the copy to a CUDA device runs asynchronously (ignored
    without CUDA)."""

    def __post_init__(self) -> None:
        check_positive("data", "num_workers", self.num_workers, allow_zero=True)
        check_positive("data", "prefetch_factor", self.prefetch_factor)
        for name in ("persistent_workers", "pin_memory"):
            check_bool("data", name, getattr(self, name))
        self._check_sources()
        self._check_format()

    def _check_sources(self) -> None:
        """Where the text and the tokenizer come from: strings, paths that exist."""
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
        if not isinstance(self.tokenizer, str):
            raise ValueError(f'data.tokenizer={self.tokenizer!r} must be "bytes" or a path to a '
                             "Hugging Face tokenizer folder or tokenizer.json file")
        if not isinstance(self.hf_dataset, str):
            raise ValueError(f"data.hf_dataset={self.hf_dataset!r} must be a path (a string); "
                             "leave it empty to train on data.path")
        data_source(self.path, self.hf_dataset)  # data.path exists, never with hf_dataset
        if self.tokenizer not in ("", "bytes") and \
                not Path(self.tokenizer).expanduser().exists():
            raise ValueError(f"data.tokenizer={self.tokenizer!r} does not exist; give \"bytes\", "
                             "a Hugging Face tokenizer folder or a tokenizer.json file")
        if self.hf_dataset and not Path(self.hf_dataset).expanduser().exists():
            raise ValueError(f"data.hf_dataset={self.hf_dataset!r} does not exist; give a "
                             "folder written by save_to_disk or a local data folder/file")

    def _check_format(self) -> None:
        """data.format against its entry of `meshfit.data.formats`: the columns, what the
        format needs, and the settings that apply to its kind of rows only."""
        for key, column in column_keys().items():  # every format's, as each has a default
            if not isinstance(getattr(self, key), str) or not getattr(self, key):
                raise ValueError(f"data.{key}={getattr(self, key)!r} must be a column name, "
                                 f'e.g. "{column}"')
        fmt = data_format(self.format)
        if not isinstance(self.chat_template, str):
            raise ValueError(f"data.chat_template={self.chat_template!r} must be a file or the "
                             "template's text (a string)")
        for name in ("train_on_prompt", "packing", "document_mask"):
            check_bool("data", name, getattr(self, name))
        if self.document_mask and fmt.examples:
            raise ValueError(f"data.document_mask=true is for data.format="
                             f"{format_names(examples=False)}; with format={self.format!r} use "
                             "data.packing=true (examples are kept apart there)")
        if fmt.dataset and not self.hf_dataset:
            raise ValueError(f"data.format={self.format!r} reads data.hf_dataset (a datasets "
                             "folder, or a .json/.jsonl file of rows); set it")
        if fmt.hf_tokenizer and self.tokenizer in ("", "bytes"):
            raise ValueError(f"data.format={self.format!r} needs a Hugging Face tokenizer "
                             "folder in data.tokenizer (the byte tokenizer has no chat "
                             "template or special tokens)")
        if not fmt.examples and (self.chat_template or self.train_on_prompt or self.packing):
            raise ValueError("data.chat_template, data.train_on_prompt and data.packing apply "
                             f"to data.format={format_names(examples=True)}, not "
                             f"{self.format!r} (text documents are always packed)")

    @property
    def masked(self) -> bool:
        """Targets may be ignored (a prompt, padding, a document's first token), so the
        trainer weighs every trained token the same in a step: the format's rows are
        masked, or data.document_mask keeps documents apart."""
        return data_format(self.format).masked or self.document_mask

    @property
    def examples(self) -> bool:
        """The format's rows are examples with loss masks (not documents packed into one
        stream)."""
        return data_format(self.format).examples


@dataclass(frozen=True, kw_only=True)
class ParallelConfig(LayoutRequest):
    """[parallel]: a `meshfit.parallel.request.LayoutRequest` (the mesh sizes of
    `meshfit.ParallelDims`, ZeRO sharding, the pipeline schedule; see `meshfit.Accelerator`),
    its errors naming the config keys."""

    cp_load_balance: bool = True
    """cp > 1: each rank holds a chunk from the start and one from the end of each sequence
    (equal causal work on every rank); false: the r-th contiguous piece."""
    offload_dir: str = ""
    """offload = "disk": the folder the optimizer state goes to (one subfolder per rank,
    created private to the run, removed at the end)."""

    def __post_init__(self) -> None:
        self.check(LAYOUT_NAMES)
        check_bool("parallel", "cp_load_balance", self.cp_load_balance)
        if not isinstance(self.offload_dir, str):
            raise ValueError(f"parallel.offload_dir={self.offload_dir!r} must be a path")
        if self.offload == "disk" and not self.offload_dir.strip():
            raise ValueError("parallel.offload='disk' needs parallel.offload_dir=PATH: a "
                             "folder on a local disk for the optimizer state")
        if self.offload_dir and self.offload != "disk":
            raise ValueError(f"parallel.offload_dir={self.offload_dir!r} is used with "
                             f"parallel.offload='disk' only (offload={self.offload!r})")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """[checkpoint]: sharded checkpoints of the whole training state in OUT/checkpoints/step-N/
    (`Accelerator.save_state`), for `meshfit train --out OUT --resume`."""

    every: int = 0  # Save every this many optimizer steps, and at the last step (0: no checkpoints)
    keep: int = 3  # Complete checkpoints kept: older ones are deleted once a newer one is committed
    async_save: bool = field(default=False, metadata={"toml": "async"})
    """(TOML key `async`) Write in the background while training goes on: the state is
    copied to host memory, files are written by a thread (or a process: `async_mode`), and
    the checkpoint is committed (manifest, rename) at the next save or at the end."""
    async_mode: str = "thread"
    """Who writes an asynchronous save: "thread" (in each rank's process) or "process" (a
    process of each rank's own, staged through shared memory: no writer holds the training
    process's GIL; started at the first save, about 2 s, and kept)."""

    def __post_init__(self) -> None:
        check_positive("checkpoint", "every", self.every, allow_zero=True)
        check_positive("checkpoint", "keep", self.keep)
        check_bool("checkpoint", "async", self.async_save)
        check_choice("checkpoint", "async_mode", self.async_mode, ("thread", "process"))


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
        # (torch-free, but not on TORCH_FREE's list in tests/test_architecture.py)
        from meshfit.tracking import resolve_names

        if isinstance(self.with_, str):  # --log.with=tensorboard: one tracker
            object.__setattr__(self, "with_", [self.with_] if self.with_ else [])
        if not isinstance(self.with_, list) or not all(isinstance(x, str) for x in self.with_):
            raise ValueError(f"log.with={self.with_!r} must be a list of tracker names, e.g. "
                             '["tensorboard", "csv"]')
        resolve_names(self.with_, field="log.with")
        if not isinstance(self.project, str) or not self.project:
            raise ValueError(f"log.project={self.project!r} must be a non-empty name")
        if not isinstance(self.calibration, str):
            raise ValueError(f"log.calibration={self.calibration!r} must be the path of a "
                             "`meshfit calibrate` file (a string)")
        if self.calibration:
            from meshfit.plan.calibrate import load_calibration  # (imports torch)

            load_calibration(self.calibration)  # one line if missing or of another schema


def toml_name(f) -> str | None:
    """A field's key in the TOML file (`with` and `async` are Python keywords; None: not a
    config key, e.g. `ModelOptions.tp_plan`, which [model] names instead)."""
    return f.metadata.get("toml", f.name)


def config_fields(section) -> list:
    """The fields of a section (class or instance) that are keys of the TOML file."""
    return [f for f in fields(section) if f.init and toml_name(f) is not None]


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
        return Layout.resolve(self.parallel, world_size,
                              mixed_precision=self.train.mixed_precision,
                              local_world_size=local_world_size, names=LAYOUT_NAMES)

    def eval_windows(self) -> int:
        """Validation windows per evaluation (the split's first ones; fewer if it is shorter):
        what `meshfit train` logs as val_loss and `meshfit eval RUN` evaluates by default."""
        return self.train.eval_windows

    def model_config(self, vocab_size: int):
        """The reference GPT's config for this run: [model] over its preset, train.seq_len as
        the context, the tokenizer's vocabulary (`meshfit.train.tokens.vocab_size`)."""
        return GPTConfig.preset(self.model.preset, max_seq_len=self.train.seq_len,
                                vocab_size=vocab_size, **self.model.overrides())

    def validate_for(self, world_size: int, local_world_size: int | None = None) -> Layout:
        """Checks that need the number of processes (run before launching any); returns the
        run's layout (`meshfit.train.preflight.check_layout`)."""
        return check_layout(self, world_size, local_world_size)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Sections and keys as the TOML file spells them."""
        return {s.name: {toml_name(f): dataclasses.asdict(getattr(self, s.name))[f.name]
                         for f in config_fields(getattr(self, s.name))} for s in fields(self)}
