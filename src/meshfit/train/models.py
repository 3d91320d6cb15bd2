"""The model of a `meshfit train` run, from its [model] section (`ModelConfig`), its loss on
(x, y) windows, its parallel plans, and the final weights written to ``OUT/model/`` (and
``OUT/adapter/``)."""

from __future__ import annotations

import contextlib
import inspect
import re
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from meshfit._compat import transformers as hf_internals
from meshfit._quiet import quiet_logs
from meshfit.checkpoint.pretrained import check_weights, meta_model
from meshfit.checkpoint.saved import save_model_folder
from meshfit.distributed.env import cpu_requested
from meshfit.models import GPT, GPTConfig
from meshfit.models.factory import import_object
from meshfit.models.packing import check_packable, packed_forward
from meshfit.models.plans import PipelinePlan, TPPlan, adapted_model

# Imported where used: transformers and meshfit.peft (it imports peft: both optional), and the
# tensor-parallel loss (DTensor: ~2 s of imports, sympy's), which `meshfit train`'s checks
# before launch (the model built on the meta device, in the launching process) do not need.


def _factory_kwargs(factory: Callable, cfg, vocab_size: int) -> dict[str, Any]:
    offered = {"vocab_size": vocab_size, "max_seq_len": cfg.train.seq_len}
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return offered
    return {k: v for k, v in offered.items() if k in params}


def build_model(cfg, vocab_size: int, *, meta: bool = False) -> nn.Module:
    """The [model] of `cfg` for a tokenizer of `vocab_size` ids, with LoRA adapters when
    [peft] asks for them. `meta`: structure only, on the meta device (sizes and plans,
    before launch). A `hf_model` is always built on the meta device and marked with its
    folder: `Accelerator.prepare` fills each rank's shards from the files."""
    m = cfg.model
    with _on_meta() if meta else contextlib.nullcontext(), user_code(
            f"model.{m.source}={getattr(m, m.source)!r}", "building the model",
            skip=m.source == "preset"), quiet_logs():  # (torchao's notes, through transformers)
        if m.source == "preset":
            model = GPT(GPTConfig.preset(m.preset, vocab_size=vocab_size,
                                         max_seq_len=cfg.train.seq_len, **m.overrides()))
        elif m.source == "hf_config":
            import transformers

            # (trust_remote_code given either way: left unset, transformers asks on the
            # terminal, mid-command and on every rank, whether to run the folder's code)
            config = transformers.AutoConfig.from_pretrained(
                str(Path(m.hf_config).expanduser()), local_files_only=True,
                trust_remote_code=m.trust_code)
            model = transformers.AutoModelForCausalLM.from_config(
                config, trust_remote_code=m.trust_code)
        elif m.source == "hf_model":
            model = meta_model(m.hf_model, trust_code=m.trust_code)
            if meta:  # before launch: the files hold every weight, whole and floating
                check_weights(model, m.hf_model)
        else:
            factory = import_object(m.factory, "model.factory")
            model = factory(**_factory_kwargs(factory, cfg, vocab_size))
            if not isinstance(model, nn.Module):
                raise ValueError(f"model.factory={m.factory!r} returned "
                                 f"{type(model).__name__}, not an nn.Module")
    if cfg.peft.method in ("lora", "qlora"):
        from meshfit.peft import lora, qlora

        p = cfg.peft
        try:
            model = (qlora if p.method == "qlora" else lora)(
                model, r=p.r, alpha=p.alpha, dropout=p.dropout,
                target_modules=list(p.target_modules) or None)
        except ValueError as err:  # name the config key the user wrote
            text = str(err)
            for prefix in ("lora: ", "qlora: "):
                if text.startswith(prefix):
                    text = text.removeprefix(prefix)
                    if not text.startswith(("r=", "alpha=", "dropout=", "target_modules=",
                                            "init_lora_weights=")):
                        text = f"method={p.method!r}: {text}"
                    break
            raise ValueError(f"peft.{text}") from None
    return model


class _SkipMetaInit(torch.overrides.TorchFunctionMode):
    """`torch.nn.init`'s functions do nothing on a meta tensor (there are no values to
    fill). Without this, the first one (every `nn.Linear` and `nn.Embedding` calls one)
    imports torch._dynamo through torch's meta kernels: 0.8 s of every `meshfit train`'s
    start, before launch."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else kwargs.get("tensor")  # (nn.init passes it by name)
        if getattr(func, "__module__", None) == "torch.nn.init" and \
                isinstance(first, torch.Tensor) and first.is_meta:
            return first
        return func(*args, **kwargs)


@contextlib.contextmanager
def _on_meta():
    """Modules built inside are on the meta device, their initialisation skipped."""
    with torch.device("meta"), _SkipMetaInit():
        yield


@contextlib.contextmanager
def user_code(field: str, doing: str, *, skip: bool = False):
    """Code the user gave (a factory, a plan, a config of another library) run as one line
    on failure: any exception, and `sys.exit` too, becomes a ValueError naming `field`, what
    was being done, the error and the user's line it came from. meshfit's own one-line
    ValueErrors that already name a setting pass through; Ctrl-C is left alone."""
    if skip:
        yield
        return
    try:
        yield
    except KeyboardInterrupt:
        raise
    except ValueError as err:
        text = " ".join(str(err).split())
        if re.match(r"[a-z_.]+=", text) and "\n" not in str(err):  # names its setting
            raise
        raise ValueError(f"{field}: {doing} raised ValueError: {text}{_where(err)}") from None
    except SystemExit as err:
        raise ValueError(f"{field}: {doing} called sys.exit({err.code!r}); a model source must "
                         "return (or raise), not end the process") from None
    except BaseException as err:  # noqa: BLE001 - any error of user code, as one line
        text = " ".join(str(err).split()) or "(no message)"
        raise ValueError(f"{field}: {doing} raised {type(err).__name__}: {text}"
                         f"{_where(err)}") from None


def _where(err: BaseException) -> str:
    """ " (at file.py:12)": the last frame of the traceback outside torch, transformers and
    meshfit (the user's line), or nothing."""
    frames = traceback.extract_tb(err.__traceback__)
    here = str(Path(__file__).resolve().parents[1])  # meshfit's own files
    for frame in reversed(frames):
        path = frame.filename.replace("\\", "/")
        if not (path.startswith((here, sys.base_prefix, sys.prefix, "<"))
                or "-packages/" in path):
            return f" (at {Path(path).name}:{frame.lineno})"
    return ""


def check_model_source(cfg, vocab_size: int) -> nn.Module:
    """Before launch: the model builds (on the meta device), holds the tokenizer's ids and
    the sequence length, keeps packed documents apart (`check_packable`), and has plans for
    the layout's tensor/pipeline axes; returns it."""
    model = build_model(cfg, vocab_size, meta=True)
    m, config = cfg.model, getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    field = f"model.{m.source}"
    if vocab is not None and vocab < vocab_size:
        raise ValueError(f"{field}: the model's vocabulary holds {vocab} ids but the tokenizer "
                         f"(data.tokenizer={getattr(cfg.data, 'tokenizer', 'bytes')!r}) gives up "
                         f"to {vocab_size}; use "
                         "the model's own tokenizer or a model with a larger vocab_size")
    embedding = _input_embedding(model)
    if embedding is not None and embedding.num_embeddings < vocab_size:
        raise ValueError(f"{field}: the model's input embedding holds {embedding.num_embeddings} "
                         f"ids but the tokenizer (data.tokenizer="
                         f"{getattr(cfg.data, 'tokenizer', 'bytes')!r}) gives up to {vocab_size};"
                         " make the embedding at least that large or use a smaller tokenizer")
    longest = getattr(config, "max_position_embeddings", None) or getattr(
        config, "n_positions", None)
    if m.source != "preset" and longest is not None and cfg.train.seq_len > longest:
        raise ValueError(f"train.seq_len={cfg.train.seq_len} is longer than the "
                         f"{longest} positions of {field}; lower train.seq_len")
    if (cfg.data.packing or cfg.data.document_mask) and is_hf(model):
        check_packable(_base(model), f"{field}={getattr(m, m.source)!r}")
    if is_hf(model) and _on_cpu() and \
            hf_internals.attention_implementation(_base(model)) == "flex_attention":
        raise ValueError(f"{field}={getattr(m, m.source)!r} runs attn_implementation "
                         "'flex_attention', which torch cannot train on the CPU (it has no CPU "
                         "backward); use 'sdpa' in its config.json, or a GPU")
    if cfg.parallel.pp > 1 and _router_aux_loss(model):
        raise ValueError(f"{field}: output_router_logits=true (the router load-balancing loss) "
                         f"with parallel.pp={cfg.parallel.pp} is not yet available: a pipeline's "
                         "loss is the last stage's cross-entropy, and the loss couples the "
                         "routers of every stage; set output_router_logits=false in its "
                         "config.json (cross-entropy only) or use pp = 1")
    return model


def _on_cpu() -> bool:
    """Whether the run's processes train on the CPU (no CUDA, or MESHFIT_CPU=1)."""
    return not torch.cuda.is_available() or cpu_requested(None)


def _input_embedding(model: nn.Module) -> nn.Embedding | None:
    """The embedding the token ids index: the model's own (`get_input_embeddings`), or its
    first nn.Embedding."""
    getter = getattr(model, "get_input_embeddings", None)
    if callable(getter):
        try:
            found = getter()
        except (NotImplementedError, AttributeError):
            found = None
        if isinstance(found, nn.Embedding):
            return found
    return next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)


def plans(cfg) -> tuple[Any, Any]:
    """The [model] tp_plan and pipeline_plan objects (None: the model's built-in ones)."""
    m = cfg.model
    tp = import_object(m.tp_plan, "model.tp_plan") if m.tp_plan else None
    pp = import_object(m.pipeline_plan, "model.pipeline_plan") if m.pipeline_plan else None
    return tp, pp


def resolve_plan(plan: Any, model: nn.Module) -> Any:
    """A plan given as a function of the model, called; other plans as they are."""
    if callable(plan) and not isinstance(plan, (TPPlan, PipelinePlan, dict)):
        return plan(model)
    return plan


def _logits(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits


def loss_function(model: nn.Module) -> Callable[[nn.Module, torch.Tensor, torch.Tensor],
                                                 torch.Tensor]:
    """``loss(prepared_model, x, y)``: mean next-token cross-entropy (ignore_index -100).
    The reference GPT computes it itself (vocabulary-parallel under loss_parallel); other
    models give logits ([B, T, V], or an output with ``.logits``), taken through
    `tp_cross_entropy`, so that vocabulary-sharded logits are never gathered; a
    transformers MoE may add its router loss (`_with_router_aux_loss`)."""
    from meshfit.parallel.tp import tp_cross_entropy

    if isinstance(_base(model), GPT):
        return lambda m, x, y, positions=None: m(x, y) if positions is None else \
            m(x, y, positions=positions)
    if is_hf(model) and _router_aux_loss(model):
        return _with_router_aux_loss(_base(model).config.router_aux_loss_coef)
    if is_hf(model):
        return lambda m, x, y, positions=None: tp_cross_entropy(_logits(packed_forward(
            m, x, positions, use_cache=False)), y)
    return lambda m, x, y, positions=None: tp_cross_entropy(_logits(m(x)), y) \
        if positions is None else _unpackable()


def _unpackable():
    raise ValueError("data.packing=true / data.document_mask=true need the reference GPT or "
                     "a Hugging Face model: their attention takes the per-document mask")


def _router_aux_loss(model: nn.Module) -> bool:
    """Whether a transformers mixture-of-experts model's config asks for the router's
    load-balancing loss in its loss (``output_router_logits``: Mixtral, Qwen2-MoE)."""
    config = getattr(_base(model), "config", None)
    return bool(getattr(config, "output_router_logits", False)) and hasattr(
        config, "router_aux_loss_coef")


def _with_router_aux_loss(coef: float):
    """The cross-entropy plus ``coef`` (``router_aux_loss_coef``) x the model's
    load-balancing loss in training mode, as the model's own loss with labels is (not under
    pp: refused by `check_model_source`); evaluation gives the cross-entropy alone. The aux
    loss is over the tokens of this call (a micro-batch on this rank; under tensor parallel
    the router sees the whole replicated micro-batch)."""
    from meshfit.parallel.tp import tp_cross_entropy

    def loss(m, x, y, positions=None):
        out = packed_forward(m, x, positions, use_cache=False,
                             output_router_logits=m.training)
        ce = tp_cross_entropy(out.logits, y)
        loss.last_aux = None
        if m.training and out.aux_loss is not None:
            aux = coef * out.aux_loss.to(ce.device)
            loss.last_aux = aux.detach()  # the trainer reports the cross-entropy apart
            return ce + aux
        return ce

    loss.last_aux = None
    return loss


_base = adapted_model  # the model under LoRA adapters (a peft.PeftModel), or `model`


def is_hf(model: nn.Module) -> bool:
    """Whether `model` (under LoRA adapters too) is a transformers model."""
    hf = sys.modules.get("transformers")
    return hf is not None and isinstance(_base(model), hf.PreTrainedModel)


def write_final_model(acc, trained_module, model: nn.Module, cfg, tokenizer,
                      out_dir: Path, vocab_size: int) -> list[Path]:
    """The run's final weights, gathered from the layout's shards (a collective: call on
    every rank): ``OUT/model/`` (safetensors + config.json + tokenizer; a transformers
    model's folder loads with ``from_pretrained``), or with LoRA ``OUT/adapter/`` (a PEFT
    folder ``PeftModel.from_pretrained`` loads) and, with ``peft.merge``, ``OUT/model/``
    with the adapters folded in. Returns the folders written (on the main process)."""
    state = acc.get_state_dict(trained_module)
    written: list[Path] = []
    if acc.is_main_process:
        factory = cfg.model.factory or None
        kwargs = None
        if factory:
            kwargs = _factory_kwargs(import_object(factory, "model.factory"), cfg, vocab_size)
        if cfg.peft.method in ("lora", "qlora"):
            written += _write_lora(cfg, state, vocab_size, tokenizer, out_dir, factory, kwargs)
        else:
            written.append(save_model_folder(out_dir / "model", state, model,
                                             tokenizer=tokenizer, factory=factory,
                                             factory_kwargs=kwargs))
    acc.wait_for_everyone()
    return written


def _write_lora(cfg, state: dict, vocab_size: int, tokenizer, out_dir: Path,
                factory, kwargs) -> list[Path]:
    """A CPU copy of the LoRA model holding the gathered weights: its adapter as a PEFT
    folder, and with peft.merge the merged model."""
    from meshfit.peft import merge, save_adapter

    with torch.device("meta"):
        copy = build_model(cfg, vocab_size, meta=True)
    prefix = "base_model.model."  # a pipeline's stages hold the adapted model's own names
    if state and not any(k.startswith(prefix) for k in state):
        state = {prefix + k: v for k, v in state.items()}
    copy.load_state_dict(state, strict=True, assign=True)
    folders = [save_adapter(copy, out_dir / "adapter")]
    if tokenizer is not None:
        tokenizer.save(out_dir / "adapter")
    if cfg.peft.merge:
        merged = merge(copy)
        folders.append(save_model_folder(out_dir / "model", merged.state_dict(), merged,
                                         tokenizer=tokenizer, factory=factory,
                                         factory_kwargs=kwargs))
    return folders
