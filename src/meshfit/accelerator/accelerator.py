"""`Accelerator`: a thin facade for users' own training loops.

It speaks Hugging Face Accelerate's calls (``prepare``, ``backward``, ``accumulate``,
``no_sync``, ``gather_for_metrics``, ...), but it is a layer over ``torch.distributed``
itself: the `Layout` (decided once, in the constructor) says how the job is laid out,
`parallelize` applies it to each model or pipeline stage, the engine's `Runtime` answers for
it while the loop runs (groups, ``no_sync``, export), `Precision` handles autocast and loss
scaling, and the prepared optimizer/scheduler/dataloader objects implement accumulation
boundaries and sharding.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from meshfit import distributed as mdist
from meshfit.accelerator.loader import PreparedDataLoader
from meshfit.accelerator.precision import Precision, empty_device_cache, set_tf32
from meshfit.accelerator.prepared import (GradientState, ParameterMap, PreparedOptimizer,
                                          PreparedScheduler, rebuild_optimizer,
                                          repoint_scheduler)
from meshfit.accelerator.runtime import Runtime, runtime_for
from meshfit.distributed import DistEnv, ParallelDims
from meshfit.checkpoint.export import write_safetensors
from meshfit.distributed import collectives as ops
from meshfit.parallel.clip import clip_grad_norm_
from meshfit.parallel.layout import Layout, check_options
from meshfit.parallel.parallelize import ModelOptions, parallelize

log = logging.getLogger("meshfit")


def _is_scheduler(obj: Any) -> bool:
    return isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or (
        hasattr(obj, "step") and hasattr(obj, "get_last_lr") and hasattr(obj, "optimizer"))


class Accelerator:
    """Runs a user's training loop on one device or data parallel across processes.

    Args:
        gradient_accumulation_steps: micro-batches per optimizer step (k). Inside
            `accumulate`, `backward` divides the loss by k and gradients are synchronised
            only on every k-th micro-batch (or the dataloader's last one).
        mixed_precision: ``"no"``, ``"bf16"`` (autocast) or ``"fp16"`` (autocast + dynamic
            loss scaling). Master weights and optimizer state stay fp32.
        tf32: True/False switch TF32 tensor cores for fp32 matrix products on or off
            (NVIDIA Ampere and newer; no effect elsewhere); None leaves PyTorch's
            process-wide setting as it is.
        activation_checkpointing: ``"none"``, ``"full"`` (every transformer block recomputes
            its activations in backward) or ``"selective"`` (every
            ``activation_checkpointing_every``-th block with policy ``"block"``, or every block
            keeping matrix-product outputs with policy ``"op"``); see
            `meshfit.parallel.activation`.
        compile: ``torch.compile`` prepared models, per transformer block
            (``compile_scope="block"``, the default) or whole (``"model"``), with
            ``compile_backend`` and ``compile_mode``; see `meshfit.parallel.compile`.
        empty_cache_steps: release the device allocator's cached blocks every this many
            optimizer steps (0: never), as Transformers' ``torch_empty_cache_steps``.
        parallel: the layout (`ParallelDims`); default: every process a DDP replica.
            ``ParallelDims(dp_shard=N)`` shards over N ranks (ZeRO); with ``dp_replicate=M``
            too, M groups of N (hybrid sharding, HSDP). All M x N ranks see different data.
            ``tp=T`` splits every block over T ranks (Megatron-style, `apply_tp`), composed
            with any data-parallel axes (see `meshfit.parallel.layout`); ``pp=P`` cuts the
            model into stages: use `prepare_pipeline` instead of ``prepare(model)``. The
            layout is decided once, here (`self.layout`, a `meshfit.Layout`).
        zero_stage: with dp_shard > 1, what is sharded over the dp_shard ranks (ZeRO,
            Rajbhandari et al. 2020); default 3 when dp_shard > 1, else 0.
            0: nothing (DDP). 1: optimizer state (DDP + ZeroRedundancyOptimizer, applied in
            `prepare_optimizer`). 2: gradients and optimizer state (FSDP2 with
            reshard_after_forward=False; FSDP2 also keeps parameters sharded between steps,
            see `meshfit.parallel.fsdp`). 3: parameters too, gathered per block just in time
            (FSDP2). Under 2 and 3, mixed precision is FSDP's MixedPrecisionPolicy
            (parameters gathered and computed in bf16/fp16, gradients reduced in fp32, fp32
            master weights and outputs) instead of autocast. With tp or pp > 1 every
            data-parallel stage runs on FSDP2 (0: replicate-only, 1: whole gradients until the
            boundary, sharded optimizer state), so FSDP's mixed-precision policy applies to
            all of them (see `meshfit.parallel.layout`).
        offload: ``"cpu"`` keeps the sharded parameters, gradients and optimizer state in
            host memory (ZeRO-Offload; zero_stage=3 only); ``"none"``.
        sync_each_batch: under accumulation with zero_stage 2/3, False skips the
            reduce-scatter on non-boundary micro-batches (fewer collectives; FSDP then holds
            full unsharded gradients, Ψ·4 bytes per rank, until the boundary); True
            reduce-scatters every micro-batch (sharded gradients accumulate: Ψ·4/N bytes);
            ``"auto"`` picks True when the unsharded gradients would take more than a quarter
            of the free memory (CUDA free memory, host available memory on CPU) on any rank,
            and logs the choice once (when the first model is prepared; the
            ``sync_each_batch`` attribute then holds it). Under DDP and ZeRO-1 gradients are
            full-size anyway, so "auto" means False there.
        sequence_parallel: with tp > 1, split the residual stream on the sequence dimension
            between the tensor-parallel blocks (norms and dropout run on T/tp positions;
            Korthikanti et al. 2022); the sequence length must divide by tp.
        loss_parallel: with tp > 1, the output head keeps its logits sharded on the
            vocabulary and the reference GPT's ``model(idx, targets)`` loss is computed
            without gathering them (`meshfit.parallel.tp.tp_cross_entropy` for other
            losses). See `meshfit.parallel.tp.apply_tp`.
        tp_plan: with tp > 1, how to split a model that has no built-in plan: a
            `meshfit.models.plans.TPPlan` or ``{module pattern: Style or ParallelStyle}``
            (see `meshfit.parallel.tp.apply_tp`); None: the model type's built-in plan.
        ddp_kwargs: extra keyword arguments for DistributedDataParallel
            (``bucket_cap_mb``, ``find_unused_parameters``, ``static_graph``, ...).
        cpu: run on the CPU (gloo) even where CUDA is available; also ``MESHFIT_CPU=1``.
        env: an existing `DistEnv`; default: `meshfit.distributed.init()`.
    """

    def __init__(self, *, gradient_accumulation_steps: int = 1, mixed_precision: str = "no",
                 tf32: bool | None = None, activation_checkpointing: str = "none",
                 activation_checkpointing_every: int = 2,
                 activation_checkpointing_policy: str = "block", compile: bool = False,
                 compile_backend: str = "inductor", compile_mode: str = "default",
                 compile_scope: str = "block", empty_cache_steps: int = 0,
                 parallel: ParallelDims | None = None, zero_stage: int | None = None,
                 offload: str = "none", sync_each_batch: bool | str = False,
                 sequence_parallel: bool = False, loss_parallel: bool = False,
                 tp_plan=None, ddp_kwargs: dict | None = None, cpu: bool | None = None,
                 env: DistEnv | None = None):
        if isinstance(gradient_accumulation_steps, bool) or not isinstance(
                gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
            raise ValueError(f"gradient_accumulation_steps={gradient_accumulation_steps!r} must "
                             "be an integer >= 1 (1 means no accumulation)")
        if isinstance(empty_cache_steps, bool) or not isinstance(empty_cache_steps, int) or \
                empty_cache_steps < 0:
            raise ValueError(f"empty_cache_steps={empty_cache_steps!r} must be an integer >= 0 "
                             "(0: never)")
        if tf32 is not None and not isinstance(tf32, bool):
            raise ValueError(f"tf32={tf32!r} must be True, False or None (leave as it is)")
        # Checked here, before any process group or model work, with the techniques' own rules.
        check_options(parallel=parallel, zero_stage=zero_stage, offload=offload,
                      sync_each_batch=sync_each_batch, mixed_precision=mixed_precision,
                      sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
        self.model_options = ModelOptions(
            activation_checkpointing=activation_checkpointing,
            activation_checkpointing_every=activation_checkpointing_every,
            activation_checkpointing_policy=activation_checkpointing_policy,
            compile=compile, compile_backend=compile_backend, compile_mode=compile_mode,
            compile_scope=compile_scope, tp_plan=tp_plan, ddp_kwargs=dict(ddp_kwargs or {}))
        self.env = env or mdist.init(cpu=cpu)
        local = self.env.local_world_size if self.env.is_distributed else None
        # The one decision of how this job is laid out (every rule lives in Layout).
        self.layout = Layout.resolve(
            parallel, self.env.world_size, distributed=self.env.is_distributed,
            zero_stage=zero_stage, offload=offload, mixed_precision=mixed_precision,
            sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
            ddp_kwargs=ddp_kwargs, local_world_size=local)
        self.parallel = self.layout.dims
        for message in self.layout.warnings:
            warnings.warn(f"meshfit: {message}", UserWarning, stacklevel=2)
        self.precision = Precision(mixed_precision, self.env.device)
        mesh = self.layout.build_mesh(self.env.device.type) if self.env.is_distributed else None
        self.runtime: Runtime = runtime_for(self.layout, self.env, mesh)
        self.empty_cache_steps = empty_cache_steps
        self._optimizer_steps = 0
        # "auto" is decided when the first model is prepared (it needs the model's size).
        self.sync_each_batch: bool | str = sync_each_batch
        self._params = ParameterMap()  # parameters replaced by sharding, for optimizers
        self._pipeline_params: set[int] = set()  # ids of prepared pipeline stages' parameters
        self._replaced: dict[int, tuple[Any, torch.optim.Optimizer]] = {}  # user opt -> new
        self.tf32 = tf32
        if tf32 is not None:
            set_tf32(tf32)
        self.grad_state = GradientState(num_steps=gradient_accumulation_steps)
        self._optimizers: list[PreparedOptimizer] = []
        self._models: list[torch.nn.Module] = []
        # What save_state / load_state cover, in the order prepared (Accelerate's naming).
        self._checkpointed_models: list[Any] = []  # prepared models and pipelines
        self._schedulers: list[PreparedScheduler] = []
        self._loaders: list[PreparedDataLoader] = []
        self._custom: list[Any] = []  # register_for_checkpointing
        self._pending_save = None  # an asynchronous save not yet committed
        self._save_group = None  # the process group asynchronous saves write with
        # Loaders being iterated, innermost last (an evaluation loop inside training): the
        # innermost one's end decides the accumulation boundary, as Accelerate's
        # GradientState does with its active dataloaders.
        self._active_loaders: list[PreparedDataLoader] = []

    # ----------------------------------------------------------------- where we are
    @property
    def device(self) -> torch.device:
        return self.env.device

    @property
    def process_index(self) -> int:
        return self.env.rank

    @property
    def local_process_index(self) -> int:
        return self.env.local_rank

    @property
    def num_processes(self) -> int:
        return self.env.world_size

    @property
    def is_main_process(self) -> bool:
        return self.env.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.env.local_rank == 0

    @property
    def mixed_precision(self) -> str:
        return self.precision.mode

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.grad_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, k: int) -> None:
        """Change k between optimizer steps (e.g. after a batch-size search)."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"gradient_accumulation_steps={k!r} must be an integer >= 1")
        self.grad_state.num_steps = k
        self.grad_state.step = 0

    @property
    def sync_gradients(self) -> bool:
        """True on micro-batches whose backward synchronises gradients (and so on which the
        prepared optimizer steps)."""
        return self.grad_state.sync_gradients

    @property
    def mesh(self):
        """The layout's `DeviceMesh` (None for a single process without a process group)."""
        return self.runtime.mesh

    @property
    def zero_stage(self) -> int:
        """The resolved ZeRO stage (0: DDP or a single process)."""
        return self.layout.zero_stage

    # ----------------------------------------------------------------- prepare
    def prepare(self, *objects: Any) -> Any:
        """Prepare models, optimizers, dataloaders and LR schedulers, in any order; returns
        them in the order given (a single object when one is given)."""
        # Models first so that wrapping happens before optimizers and schedulers are wrapped;
        # results are put back in the caller's order.
        kinds = [self._kind(obj) for obj in objects]
        out: list[Any] = list(objects)
        for kind in ("model", "optimizer", "dataloader", "scheduler"):
            for i, obj in enumerate(objects):
                if kinds[i] == kind:
                    out[i] = getattr(self, f"prepare_{kind}")(obj)
        return out[0] if len(out) == 1 else tuple(out)

    @staticmethod
    def _kind(obj: Any) -> str:
        if isinstance(obj, torch.nn.Module):
            return "model"
        if isinstance(obj, torch.optim.Optimizer):
            return "optimizer"
        if isinstance(obj, (DataLoader, PreparedDataLoader)):
            return "dataloader"
        if _is_scheduler(obj):
            return "scheduler"
        return "other"

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Apply the layout to `model` (`meshfit.parallel.parallelize`: place, tensor
        parallel, checkpoint, compile, then the data-parallel wrapper) and return the module
        to train.

        The weights must be initialised before: sharding a meta-device model and
        initialising the shards afterwards gives every rank the same random shard on CPU
        meshes, so a model with meta parameters is refused."""
        if self.parallel.pp > 1:
            raise ValueError(f"prepare(model) with pp={self.parallel.pp}: a pipeline layout "
                             "splits the model into stages; use "
                             "accelerator.prepare_pipeline(model, schedule=..., microbatches=...)")
        from meshfit.checkpoint.pretrained import pretrained_folder

        if self.parallel.ep > 1:
            from meshfit.parallel.ep import moe_modules
            from meshfit.parallel.layout import ModelFacts

            self.layout.check_model(ModelFacts(n_blocks=1, experts=tuple(
                m.n_experts for m in moe_modules([model]))))
        folder = pretrained_folder(model)
        if folder is None and any(p.is_meta for p in model.parameters()):
            raise ValueError("prepare(model): the model has parameters on the meta device; "
                             "materialise it (to_empty + init_weights) before prepare, or "
                             "build it with meshfit.checkpoint.pretrained.meta_model(folder) to "
                             "load a saved model into each rank's shards")
        before = dict(model.named_parameters())
        wrapped = self._prepare_module(model) if folder is None else \
            self._prepare_pretrained(model, folder)
        self._params.record(before, dict(self.runtime.unwrap(wrapped).named_parameters()))
        if self.sync_each_batch == "auto":
            self._decide_sync_each_batch(wrapped)
        self._models.append(wrapped)
        self._checkpointed_models.append(wrapped)
        return wrapped

    def _prepare_pretrained(self, model: torch.nn.Module, folder: str) -> torch.nn.Module:
        """A meta-device model marked by `meshfit.checkpoint.pretrained.meta_model`: under FSDP2
        (ZeRO-2/3, and every layout with tensor parallel) it is laid out on the meta device
        and each rank then reads only its shard of every tensor; under the layouts that keep
        whole parameters on every rank (one process, DDP, ZeRO-1) each rank reads them
        whole, then the model is laid out as usual."""
        from meshfit.checkpoint.pretrained import load_into, to_empty

        buffers = {n: b.detach().clone() for n, b in model.named_buffers() if not b.is_meta}
        if not self.layout.is_fsdp:
            to_empty(model, self.device)
            load_into(model, folder, buffers=buffers)
            return self._prepare_module(model)
        wrapped = self._prepare_module(model)
        inner = self.runtime.unwrap(wrapped)
        to_empty(inner, "cpu" if self.layout.offload else self.device)
        load_into(inner, folder, buffers=buffers)
        if self.layout.offload:  # sharded parameters stay in host memory; buffers go to the device
            for module in inner.modules():
                for name, buf in module._buffers.items():
                    if buf is not None:
                        module._buffers[name] = buf.to(self.device)
        return wrapped

    def _prepare_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """`parallelize` one module (a whole model or a pipeline stage), then run its forward
        under autocast unless the engine computes in low precision itself (FSDP's policy)."""
        wrapped = parallelize(module, self.layout, self.model_options, mesh=self.mesh,
                              device=self.device)
        if not self.layout.owns_mixed_precision:
            self.precision.wrap_forward(wrapped)
        return wrapped

    def prepare_pipeline(self, model: torch.nn.Module, *, microbatches: int,
                         schedule: str = "1f1b", virtual_stages: int | None = None,
                         points=None, balance: str = "params", times=None, loss_fn=None,
                         record_timings: bool = False, init_seed: int = 0, plan=None):
        """Cut `model` into pipeline stages over ``mesh["pp"]`` and prepare this rank's.

        Returns a `meshfit.parallel.pp.Pipeline`: drive it with ``loss =
        pipeline.step(inputs, targets, scale=1/k)`` inside ``accelerator.accumulate()``
        (k = gradient_accumulation_steps), then the prepared optimizer's ``step``; evaluate
        with ``pipeline.eval_loss``. Build the optimizer afterwards on
        ``pipeline.parameters()`` and prepare it. Each stage module goes through what
        `prepare(model)` does to a model (`meshfit.parallel.parallelize`: tensor parallel on
        ``mesh["tp"]``, activation checkpointing and compile, then the data-parallel wrapper,
        which is FSDP2 for every data-parallel layout with pp: see `meshfit.parallel.layout`),
        so that DP+PP, DP+PP+TP and ZeRO+PP+TP are one call. Arguments as
        `meshfit.parallel.pp.build_pipeline` (schedules gpipe, 1f1b, interleaved_1f1b,
        zero_bubble; `microbatches` per pipeline step: the global batch is micro-batch x
        microbatches x data-parallel degree x k; `plan`: where the blocks are, default the
        built-in plan of the model's type, see `meshfit.models.plans.pipeline_plan_for`).
        Every rank passes the same full model (built from one seed) or a meta-device one
        (materialised per stage from `init_seed`); with data parallel, each data-parallel
        rank feeds its own batch. `record_timings=True` keeps every step's per-micro-batch
        timings in ``pipeline.timings`` (and synchronises CUDA around each): turn it off
        with ``pipeline.record_timings(False)`` after the steps you want to chart."""
        from meshfit.parallel.layout import ModelFacts
        from meshfit.parallel.pp import build_pipeline

        if self.parallel.pp == 1:
            raise ValueError("prepare_pipeline needs a pipeline axis: Accelerator(parallel="
                             "ParallelDims(pp=P, ...)) with P > 1; use prepare(model) otherwise")
        facts = ModelFacts.of(model, pipeline_plan=plan, tp_plan=self.model_options.tp_plan)
        self.layout.check_model(facts, schedule=schedule,
                                microbatches=microbatches, virtual_stages=virtual_stages)
        pipeline = build_pipeline(
            model, self.layout.axis_mesh(self.mesh, "pp"), schedule=schedule,
            microbatches=microbatches, virtual_stages=virtual_stages, loss_fn=loss_fn,
            points=points, balance=balance, times=times, record_timings=record_timings,
            init_seed=init_seed, parallelize=self._prepare_module, plan=plan)
        self._models.extend(pipeline.wrapped_modules)
        self._checkpointed_models.append(pipeline)
        self._pipeline_params.update(id(p) for p in pipeline.parameters())
        return pipeline

    def _decide_sync_each_batch(self, model: torch.nn.Module) -> None:
        choice, reason = self.runtime.auto_sync_each_batch(model)
        self.sync_each_batch = choice
        message = f"meshfit: sync_each_batch='auto' -> {choice}: {reason}"
        log.info(message)
        self.print(message)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> PreparedOptimizer:
        """Wrap `optimizer` so that it steps on accumulation boundaries only.

        Built before `prepare(model)` under zero_stage 2/3, its parameters are the unsharded
        ones that ``fully_shard`` replaced: a new optimizer of the same class is built over
        the sharded parameters of the same names, with the same defaults and per-group
        hyper-parameters (it must not have stepped yet; the old one keeps the old
        parameters alive until you drop it). Built after `prepare(model)`, it already holds
        the sharded parameters and is used as is. Under zero_stage 1 it becomes a
        ZeroRedundancyOptimizer of its class. Pass LR schedulers built on it to `prepare`
        too: they are moved to the new optimizer."""
        if isinstance(optimizer, PreparedOptimizer):
            return optimizer
        if self._pipeline_params and not any(id(p) in self._pipeline_params
                                             for g in optimizer.param_groups for p in g["params"]):
            raise ValueError("prepare(optimizer): none of its parameters belong to the prepared "
                             "pipeline's stages (an optimizer built before prepare_pipeline "
                             "holds the full model's); build it on pipeline.parameters()")
        inner = self.runtime.prepare_optimizer(rebuild_optimizer(optimizer, self._params))
        if inner is not optimizer:
            self._replaced[id(optimizer)] = (weakref.ref(optimizer), inner)
        prepared = PreparedOptimizer(inner, self.grad_state, self.precision.scaler,
                                     on_step=self._after_optimizer_step)
        self._optimizers.append(prepared)
        return prepared

    def _after_optimizer_step(self, optimizer: PreparedOptimizer) -> None:
        if optimizer is not self._optimizers[0]:
            return  # count each optimizer step once when several optimizers are prepared
        self._optimizer_steps += 1
        if self.empty_cache_steps and self._optimizer_steps % self.empty_cache_steps == 0:
            empty_device_cache(self.device)

    def prepare_scheduler(self, scheduler) -> PreparedScheduler:
        if isinstance(scheduler, PreparedScheduler):
            return scheduler
        entry = self._replaced.get(id(getattr(scheduler, "optimizer", None)))
        if entry is not None and entry[0]() is scheduler.optimizer:
            repoint_scheduler(scheduler, entry[1])  # built on an optimizer prepare replaced
        prepared = PreparedScheduler(scheduler, self._optimizers, self.grad_state)
        self._schedulers.append(prepared)
        return prepared

    def prepare_dataloader(self, loader: DataLoader) -> PreparedDataLoader:
        if isinstance(loader, PreparedDataLoader):
            return loader
        prepared = PreparedDataLoader(loader, device=self.device,
                                      num_replicas=self.runtime.dp_size,
                                      rank=self.runtime.dp_rank, on_iter=self._set_active_loader,
                                      on_end=self._end_active_loader)
        self._loaders.append(prepared)
        return prepared

    @property
    def _active_loader(self) -> PreparedDataLoader | None:
        return self._active_loaders[-1] if self._active_loaders else None

    def _set_active_loader(self, loader: PreparedDataLoader) -> None:
        if not self._active_loaders:
            self.grad_state.step = 0  # an accumulation window never spans two epochs
        self._active_loaders.append(loader)

    def _end_active_loader(self, loader: PreparedDataLoader) -> None:
        # An evaluation loader read out inside a training epoch hands the boundary back to
        # the training loader (left as it was, its read-out state made every following
        # micro-batch an optimizer step).
        for i in range(len(self._active_loaders) - 1, -1, -1):
            if self._active_loaders[i] is loader:
                del self._active_loaders[i]
                break

    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The user's original module, without the data-parallel wrapper (under FSDP2 the
        module itself: its parameters stay sharded DTensors; use `get_state_dict`)."""
        return self.runtime.unwrap(model)

    # ----------------------------------------------------------------- checkpoints
    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and load these objects (anything with ``state_dict`` and
        ``load_state_dict``) with `save_state` / `load_state`, in the order registered."""
        for obj in objects:
            if not (callable(getattr(obj, "state_dict", None))
                    and callable(getattr(obj, "load_state_dict", None))):
                raise ValueError(f"register_for_checkpointing: {type(obj).__name__} has no "
                                 "state_dict() and load_state_dict(); register objects that do")
            self._custom.append(obj)

    def save_state(self, output_dir: str | os.PathLike, *, step: int | None = None,
                   async_save: bool = False) -> Path:
        """Write everything prepared (models or pipelines, optimizers, schedulers, data
        loaders' positions, the fp16 scaler, each rank's random generators, the step
        counters) and everything registered into `output_dir`, as a sharded checkpoint
        (`torch.distributed.checkpoint`: each rank writes its own shards) committed
        atomically with a manifest. `async_save=True` copies the state to host memory and
        writes it in the background while training goes on; it is committed by
        `wait_for_checkpoint` (or the next save, `load_state`, `end_training`). Call on
        every rank; see `meshfit.accelerator.state`."""
        from meshfit.accelerator.state import save_state

        return save_state(self, output_dir, step=step, async_save=async_save)

    @property
    def checkpoint_in_flight(self) -> Path | None:
        """The temporary folder an asynchronous `save_state` is writing (None: none)."""
        return None if self._pending_save is None else self._pending_save[0]

    def wait_for_checkpoint(self) -> Path | None:
        """Commit an asynchronous `save_state` once its files are written (a collective);
        returns its folder (None when no save was in flight)."""
        from meshfit.accelerator.state import finish_save

        return finish_save(self)

    def load_state(self, input_dir: str | os.PathLike):
        """Restore what `save_state` wrote, into the objects prepared (and registered) in the
        same order, whatever the layout and number of processes that saved it; returns the
        checkpoint's manifest. Call on every rank after preparing everything."""
        from meshfit.accelerator.state import load_state

        return load_state(self, input_dir)

    def skip_first_batches(self, dataloader: PreparedDataLoader, num_batches: int = 0):
        """The prepared `dataloader`, whose next iteration leaves out its first `num_batches`
        batches (of every rank). `load_state` already positions the loaders it restores."""
        if not isinstance(dataloader, PreparedDataLoader):
            raise ValueError("skip_first_batches takes a dataloader returned by prepare()")
        dataloader.skip_first_batches(num_batches)
        return dataloader

    # ----------------------------------------------------------------- export
    def get_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's state dict, on CPU, on the main process; ``{}`` on the others.

        Call it on every rank: under zero_stage 2/3 it is a collective (each parameter is
        all-gathered, `torch.distributed.checkpoint`'s get_model_state_dict with
        full_state_dict=True, cpu_offload=True, which fills rank 0 only). Names are the
        user's module's (no DDP/FSDP/compile prefixes), values fp32 master weights; it loads
        into a plain single-device model with ``load_state_dict``. A `Pipeline` gives the
        whole model's dict too (every stage's part, gathered to rank 0). Like Accelerate's method
        of that name, except that Accelerate returns the dict on every rank under DDP."""
        from meshfit.parallel.pp import Pipeline

        if isinstance(model, Pipeline):
            return model.full_state_dict()
        return self.runtime.full_state_dict(model)

    def save_model(self, model: torch.nn.Module, save_directory: str | os.PathLike) -> Path:
        """Write `get_state_dict(model)` to ``save_directory/model.safetensors`` from the main
        process (atomically: a temporary file, then os.replace); call on every rank.
        Tensors sharing storage (tied weights) are written as separate copies, which
        safetensors requires; both names load back into the tied model."""
        state = self.get_state_dict(model)
        path = Path(save_directory) / "model.safetensors"
        if self.is_main_process:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_safetensors(state, path)
        self.wait_for_everyone()
        return path

    # ----------------------------------------------------------------- training step
    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """``loss.backward()``, divided by the accumulation steps and scaled for fp16."""
        loss = loss / self.grad_state.num_steps
        if self.precision.scaler is not None:
            loss = self.precision.scaler.scale(loss)
        loss.backward(**kwargs)

    @contextlib.contextmanager
    def accumulate(self, *models: torch.nn.Module):
        """One micro-batch of gradient accumulation: gradients sync only on the k-th one
        (with sync_each_batch=True, on every one: see the constructor)."""
        self._advance_micro_step()
        with contextlib.ExitStack() as stack:
            if not self.grad_state.sync_gradients and self.sync_each_batch is not True:
                for model in models:
                    stack.enter_context(self.runtime.no_sync(model))
            yield

    def _advance_micro_step(self) -> None:
        state = self.grad_state
        state.step += 1
        loader_ends = self._active_loader is not None and \
            self._active_loader.state.end_of_dataloader
        state.sync_gradients = state.step % state.num_steps == 0 or loader_ends
        if state.sync_gradients:
            state.step = 0

    def no_sync(self, model: torch.nn.Module):
        """Skip gradient synchronisation for the enclosed forward *and* backward."""
        return self.runtime.no_sync(model)

    def autocast(self):
        """The mixed-precision context (prepared models already run their forward in it)."""
        return self.precision.autocast()

    def unscale_gradients(self) -> None:
        """Divide the fp16 loss scale out of the gradients (once per optimizer step)."""
        if self.precision.scaler is None or not self.grad_state.sync_gradients:
            return
        for opt in self._optimizers:
            if not opt.unscaled:
                self.precision.scaler.unscale_(opt.optimizer)
                opt.unscaled = True

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2.0
                        ) -> torch.Tensor:
        """Clip the (unscaled, synchronised) gradients' total norm; returns the norm.

        Works on sharded (DTensor) gradients: the norm is completed across the shards, and
        gradients on different meshes are combined per mesh (`meshfit.parallel.clip`).
        Pass a `Pipeline` (from `prepare_pipeline`) to clip the whole pipelined model."""
        self.unscale_gradients()
        from meshfit.parallel.pp import Pipeline

        if isinstance(parameters, Pipeline):  # every stage's part of the norm
            return parameters.clip_grad_norm_(max_norm, norm_type=norm_type)
        return clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    # ----------------------------------------------------------------- collectives
    def gather(self, obj: Any) -> Any:
        """Concatenate tensors from every data-parallel rank along dim 0."""
        return ops.gather(obj, self.runtime.dp_group)

    def gather_for_metrics(self, obj: Any) -> Any:
        """`gather`, minus the samples that padded the dataloader's uneven last round."""
        if not isinstance(obj, torch.Tensor) and not isinstance(obj, (list, tuple, dict)):
            return ops.gather_object(obj, self.runtime.dp_group)
        gathered = self.gather(obj)
        loader = self._active_loader
        if loader is None or not loader.state.end_of_dataloader or loader.state.remainder < 0:
            return gathered
        keep = loader.state.remainder
        return ops.apply_to_tensors(lambda t: t[:keep], gathered)

    def reduce(self, obj: Any, reduction: str = "sum") -> Any:
        return ops.reduce(obj, reduction, self.runtime.dp_group)

    def wait_for_everyone(self) -> None:
        if self.env.is_distributed:
            dist.barrier()

    @contextlib.contextmanager
    def main_process_first(self):
        """The main process runs the block first (e.g. to build a cache), then the others."""
        if not self.is_main_process:
            self.wait_for_everyone()
        yield
        if self.is_main_process:
            self.wait_for_everyone()

    def print(self, *args, **kwargs) -> None:
        if self.is_main_process:
            print(*args, **kwargs)

    def end_training(self) -> None:
        """Commit a checkpoint still being written, then release the process group (call
        once at the end of the script)."""
        self.wait_for_checkpoint()
        if self.env.is_distributed and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    def __repr__(self) -> str:
        return (f"Accelerator(device={self.device}, num_processes={self.num_processes}, "
                f"parallel={self.parallel}, zero_stage={self.zero_stage}, "
                f"mixed_precision={self.mixed_precision!r}, "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps})")
