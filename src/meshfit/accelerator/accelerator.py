"""`Accelerator`: a thin facade for users' own training loops, speaking Hugging Face
Accelerate's calls (``prepare``, ``backward``, ``accumulate``, ``gather_for_metrics``, ...)
over ``torch.distributed`` itself. The `Layout` is decided once, in the constructor; each
method delegates to the module that does the work (see `meshfit.accelerator`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from meshfit import distributed as mdist
from meshfit._compat.dynamo import uncompiled
from meshfit.accelerator import export, models, processes, sequence, state, trackers
from meshfit.accelerator.attributes import AcceleratorAttributes
from meshfit.accelerator.shared_state import AcceleratorState
from meshfit.accelerator.arguments import UNSET, Arguments, read_arguments, resolve_layout
from meshfit.accelerator.compat import (AutocastKwargs, DataLoaderConfiguration,
                                        FullyShardedDataParallelPlugin, GradientAccumulationPlugin,
                                        ProjectConfiguration)
from meshfit.accelerator.compat.utilities import pad_across_processes, release_memory
from meshfit.accelerator.loader import PreparedDataLoader
from meshfit.accelerator.precision import Precision, empty_device_cache, set_tf32
from meshfit.accelerator.processes import ProcessControl
from meshfit.accelerator.prepared import (GradientState, PreparedOptimizer, PreparedScheduler,
                                          kind_of, rebuild_optimizer, repoint_scheduler,
                                          unscale_gradients)
from meshfit.accelerator.registry import Registry
from meshfit.accelerator.runtime import Runtime, runtime_for
from meshfit.accelerator.shuffle import sync_global_generators
from meshfit.distributed import DistEnv, ParallelDims
from meshfit.parallel.request import LayoutRequest
from meshfit.parallel.clip import clip_grad_norm_

__all__ = ["Accelerator"]

log = logging.getLogger("meshfit")


class Accelerator(AcceleratorAttributes, ProcessControl):
    """Runs a user's training loop on one device or data parallel across processes; the
    arguments are Accelerate 1.15's, then meshfit's own (`meshfit.accelerator.arguments`)."""

    def __init__(self, device_placement: bool = True, split_batches: Any = UNSET,
                 mixed_precision: str | None = None, gradient_accumulation_steps: int = 1,
                 cpu: bool | None = None, dataloader_config: DataLoaderConfiguration | None = None,
                 deepspeed_plugin=None, fsdp_plugin: FullyShardedDataParallelPlugin | None = None,
                 torch_tp_plugin=None, megatron_lm_plugin=None, rng_types: list | None = None,
                 log_with=None, project_dir: str | os.PathLike | None = None,
                 project_config: ProjectConfiguration | None = None,
                 gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
                 step_scheduler_with_optimizer: bool = True, kwargs_handlers: list | None = None,
                 dynamo_backend=None, dynamo_plugin=None, deepspeed_plugins=None,
                 parallelism_config=None, *, step_scheduler_per_process: bool = True,
                 tf32: bool | None = None, activation_checkpointing: str = "none",
                 activation_checkpointing_every: int = 2,
                 activation_checkpointing_policy: str = "block",
                 activation_checkpointing_budget: float = 0.5, activation_offload: bool = False,
                 compile: bool = False,
                 compile_backend: str = "inductor", compile_mode: str = "default",
                 compile_scope: str = "block", float8: bool = False,
                 float8_recipe: str = "rowwise", empty_cache_steps: int = 0,
                 parallel: ParallelDims | LayoutRequest | None = None,
                 zero_stage: int | None = None,
                 offload: str = "none", sync_each_batch: bool | str = False,
                 sequence_parallel: bool = False, loss_parallel: bool = False,
                 tp_plan=None, ddp_kwargs: dict | None = None, cp_load_balance: bool = True,
                 offload_dir: str | os.PathLike | None = None, offload_params: bool = False,
                 env: DistEnv | None = None):
        given = dict(locals())  # every argument by name: the translation reads them
        del given["self"], given["env"]
        # Checked and translated before any process group or model work.
        arguments = read_arguments(given)
        for message in arguments.warnings:
            warnings.warn(f"meshfit: {message}", UserWarning, stacklevel=2)
        self._keep_options(arguments)
        self.env = env or mdist.init(cpu=arguments.process.cpu, **arguments.process.init_kwargs)
        self.layout = resolve_layout(arguments, self.env)
        self.parallel = self.layout.dims
        for message in self.layout.warnings:
            warnings.warn(f"meshfit: {message}", UserWarning, stacklevel=2)
        options = arguments.precision
        self.precision = Precision(options.mode, self.env.device,
                                   scaler_kwargs=options.scaler_kwargs,
                                   autocast_kwargs=options.autocast_kwargs)
        mesh = self.layout.build_mesh(self.env.device.type) if self.env.is_distributed else None
        self.runtime: Runtime = runtime_for(self.layout, self.env, mesh,
                                            offload_dir=self.offload_dir)
        AcceleratorState.attach(self)
        if self.tf32 is not None:
            set_tf32(self.tf32)
        self._start_registries(arguments)

    def _keep_options(self, arguments: Arguments) -> None:
        """The translated arguments, as the attributes Accelerate's Accelerator has."""
        handlers, loop = arguments.handlers, arguments.loop
        self.ddp_handler, self.init_handler = handlers.ddp, handlers.init
        self.scaler_handler, self.autocast_handler = handlers.scaler, handlers.autocast
        self.profile_handler = handlers.profile
        self.fsdp_plugin = arguments.fsdp_plugin
        self.parallelism_config = arguments.parallelism_config
        self.offload_dir = arguments.offload_dir
        self.offload_params = arguments.layout.offload_params
        self.dataloader_config = loop.dataloader_config
        self.rng_types = list(loop.rng_types)
        self.project_configuration = arguments.project_configuration
        self.log_with = list(arguments.log_with)
        self.trackers: list = []
        self.step_scheduler_with_optimizer = loop.step_scheduler_with_optimizer
        self.step_scheduler_per_process = loop.step_scheduler_per_process
        self.flag_tensor = None
        self.model_options = arguments.model
        self.device_placement = arguments.process.device_placement
        self.empty_cache_steps = loop.empty_cache_steps
        # "auto" is decided when the first model is prepared (it needs the model's size).
        self.sync_each_batch: bool | str = arguments.layout.sync_each_batch
        self.tf32 = arguments.precision.tf32

    def _start_registries(self, arguments: Arguments) -> None:
        """The accumulation state, and what the accelerator keeps of the objects it prepares
        (`meshfit.accelerator.registry`)."""
        loop = arguments.loop
        self.grad_state = GradientState(num_steps=loop.gradient_accumulation_steps,
                                        sync_with_dataloader=loop.sync_with_dataloader,
                                        adjust_scheduler=loop.adjust_scheduler)
        self._registry = Registry()

    # ----------------------------------------------------------------- prepare
    def prepare(self, *objects: Any, device_placement=None) -> Any:
        """Prepare models, optimizers, dataloaders and LR schedulers, in any order; returns them
        (other objects as they are) in that order, a single one alone."""
        self.state.env  # noqa: B018 - raises Accelerate's error after a state reset
        if device_placement is not None and not device_placement and \
                self.device.type != "cpu":
            raise ValueError("prepare(device_placement=False) is available on the CPU only")
        # Models first so that wrapping happens before optimizers and schedulers are wrapped;
        # results are put back in the caller's order.
        kinds = [kind_of(obj) for obj in objects]
        out: list[Any] = list(objects)
        for kind in ("model", "optimizer", "dataloader", "scheduler"):
            for i, obj in enumerate(objects):
                if kinds[i] == kind:
                    out[i] = getattr(self, f"prepare_{kind}")(obj)
        return out[0] if len(out) == 1 else tuple(out)

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Apply the layout to `model` and return the module to train; its weights must be
        initialised, or it must come from `meta_model` (`meshfit.accelerator.models`)."""
        folder = models.check_model(model, self.layout)
        before = dict(model.named_parameters())
        wrapped = self._prepare_module(model) if folder is None else models.load_pretrained(
            model, folder, layout=self.layout, runtime=self.runtime, device=self.device,
            lay_out=self._prepare_module)
        self._registry.params.record(before,
                                     dict(self.runtime.unwrap(wrapped).named_parameters()))
        self.runtime.prepare_model(wrapped)  # (offload_params: the loaded shards to files)
        if self.ddp_handler is not None and isinstance(
                wrapped, torch.nn.parallel.DistributedDataParallel):
            self.ddp_handler.register_comm_hook(wrapped)
        if self.sync_each_batch == "auto":
            self._decide_sync_each_batch(wrapped)
        self._registry.models.append(wrapped)
        return wrapped

    def _prepare_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return models.lay_out(module, self.layout, self.model_options, mesh=self.mesh,
                              device=self.device, precision=self.precision)

    def prepare_pipeline(self, model: torch.nn.Module, *, microbatches: int | None = None,
                         schedule: str | None = None, virtual_stages: int | None = None,
                         points=None, balance: str = "params", times=None, loss_fn=None,
                         record_timings: bool = False, init_seed: int = 0, plan=None):
        """Cut `model` into pipeline stages over ``mesh["pp"]`` and prepare this rank's; returns
        a `meshfit.parallel.pp.Pipeline` (how to drive it: `meshfit.accelerator.models`).
        `microbatches`, `schedule` and `virtual_stages` default to the layout request's
        (``parallel=LayoutRequest(pp=2, schedule="gpipe", microbatches=8)``); micro-batches
        must be given one way or the other."""
        request = self.layout.request
        microbatches = microbatches if microbatches is not None else request.microbatches
        if microbatches is None:
            raise ValueError("prepare_pipeline needs microbatches=N (micro-batches per "
                             "pipeline step), here or in the layout request "
                             "(parallel=LayoutRequest(pp=..., microbatches=N))")
        pipeline = models.build(
            model, self.layout, self.model_options, mesh=self.mesh,
            lay_out=self._prepare_module, microbatches=microbatches,
            schedule=schedule or request.schedule,
            virtual_stages=virtual_stages or request.virtual_stages, plan=plan, points=points,
            balance=balance, times=times, loss_fn=loss_fn, record_timings=record_timings,
            init_seed=init_seed)
        self._registry.models.append(pipeline)
        self._registry.pipeline_params.update(id(p) for p in pipeline.parameters())
        return pipeline

    def _decide_sync_each_batch(self, model: torch.nn.Module) -> None:
        self.sync_each_batch, reason = self.runtime.auto_sync_each_batch(model)
        message = f"meshfit: sync_each_batch='auto' -> {self.sync_each_batch}: {reason}"
        log.info(message)
        self.print(message)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> PreparedOptimizer:
        """Wrap `optimizer` so that it steps on accumulation boundaries only, re-pointed at
        sharded parameters if need be (`meshfit.accelerator.prepared`)."""
        if isinstance(optimizer, PreparedOptimizer):
            return optimizer
        registry = self._registry
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if registry.pipeline_params and not any(id(p) in registry.pipeline_params
                                                for p in params):
            raise ValueError("prepare(optimizer): none of its parameters belong to the prepared "
                             "pipeline's stages (an optimizer built before prepare_pipeline "
                             "holds the full model's); build it on pipeline.parameters()")
        # (offload="disk": the runtime puts its state in files)
        inner = self.runtime.prepare_optimizer(rebuild_optimizer(optimizer, registry.params))
        if inner is not optimizer:
            registry.replace(optimizer, inner)
        prepared = PreparedOptimizer(inner, self.grad_state, self.precision.scaler,
                                     on_step=self._after_optimizer_step,
                                     before_step=lambda _: self.runtime.check_files())
        registry.optimizers.append(prepared)
        return prepared

    def _after_optimizer_step(self, optimizer: PreparedOptimizer) -> None:
        registry = self._registry
        self.runtime.files_written(step=True)  # (offload_params: the update in the files)
        if registry.count_step(optimizer) and self.empty_cache_steps and \
                registry.optimizer_steps % self.empty_cache_steps == 0:
            empty_device_cache(self.device)

    def prepare_scheduler(self, scheduler) -> PreparedScheduler:
        if isinstance(scheduler, PreparedScheduler):
            return scheduler
        replacement = self._registry.replacement(getattr(scheduler, "optimizer", None))
        if replacement is not None:  # built on an optimizer prepare replaced
            repoint_scheduler(scheduler, replacement)
        per_step = 1 if self.split_batches or not self.step_scheduler_per_process \
            else self.runtime.dp_size
        prepared = PreparedScheduler(scheduler, self._registry.optimizers, self.grad_state,
                                     with_optimizer=self.step_scheduler_with_optimizer,
                                     steps_per_optimizer_step=per_step)
        self._registry.schedulers.append(prepared)
        return prepared

    def prepare_dataloader(self, loader: DataLoader) -> PreparedDataLoader:
        if isinstance(loader, PreparedDataLoader):
            return loader
        config = self.dataloader_config
        prepared = PreparedDataLoader(
            loader, device=self.device, num_replicas=self.runtime.dp_size,
            rank=self.runtime.dp_rank, on_iter=self._set_active_loader,
            on_end=self.grad_state.leave, even_batches=config.even_batches,
            split_batches=config.split_batches, seedable=config.use_seedable_sampler,
            data_seed=config.data_seed, sync_generator="generator" in self.rng_types,
            dispatch=bool(config.dispatch_batches))
        self._registry.loaders.append(prepared)
        return prepared

    def _set_active_loader(self, loader: PreparedDataLoader) -> None:
        if self.env.is_distributed and self.env.world_size > 1:
            sync_global_generators(self.rng_types, self.device)
        self.grad_state.loaders.append(loader)

    def unwrap_model(self, model: torch.nn.Module, keep_fp32_wrapper: bool = True,
                     keep_torch_compile: bool = True) -> torch.nn.Module:
        """The user's module without the data-parallel wrapper (FSDP2's parameters stay sharded:
        use `get_state_dict`); `keep_torch_compile=False` also removes a whole-model compile;
        `keep_fp32_wrapper` is accepted (meshfit's autocast wrapper is part of the module)."""
        module = self.runtime.unwrap(model)
        return module if keep_torch_compile else uncompiled(module)

    # ----------------------------------------------------------------- checkpoints
    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and load these objects (with ``state_dict`` and ``load_state_dict``) with
        `save_state` / `load_state`, in the order registered."""
        for obj in objects:
            state.check_registrable(obj)
            self._registry.custom.append(obj)

    def save_state(self, output_dir: str | os.PathLike | None = None,
                   safe_serialization: bool = True, *, step: int | None = None,
                   async_save: bool | str = False, **save_model_func_kwargs) -> Path:
        """Checkpoint all that is prepared and registered; every rank calls it (`state`)."""
        return state.save_state(self, self._registry, output_dir, step=step,
                                async_save=async_save)

    @property
    def checkpoint_in_flight(self) -> Path | None:
        """The temporary folder an asynchronous `save_state` is writing (None: none)."""
        pending = self._registry.pending_save
        return None if pending is None else pending.tmp

    def wait_for_checkpoint(self, *, close: bool = False) -> Path | None:
        """Commit an asynchronous `save_state` (a collective); returns its folder, or None.
        `close`: then also end the writer process of ``async_save="process"`` saves (done by
        `end_training`; a later such save starts another)."""
        return state.finish_save(self, self._registry, close=close)

    def load_state(self, input_dir: str | os.PathLike | None = None,
                   load_kwargs: dict | None = None, **load_model_func_kwargs):
        """Restore what `save_state` wrote, on any layout; every rank calls it (`state`)."""
        return state.load_state(self, self._registry, input_dir,
                                loaders=self.use_stateful_dataloader)

    def skip_first_batches(self, dataloader: PreparedDataLoader, num_batches: int = 0):
        """The prepared `dataloader`, its next iteration without its first `num_batches` batches
        (stateful loaders are already positioned by `load_state`: the same count is a no-op)."""
        if not isinstance(dataloader, PreparedDataLoader):
            raise ValueError("skip_first_batches takes a dataloader returned by prepare()")
        dataloader.skip_first_batches(num_batches)
        return dataloader

    # ----------------------------------------------------------------- the whole model
    def get_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's state dict, on the main process (`meshfit.accelerator.export`)."""
        return export.get_state_dict(model, self.runtime)

    def save_model(self, model: torch.nn.Module, save_directory: str | os.PathLike) -> Path:
        """``save_directory/model.safetensors``, on every rank (`meshfit.accelerator.export`)."""
        return export.save_model(model, save_directory, runtime=self.runtime, env=self.env)

    def save(self, obj: Any, f, safe_serialization: bool = False) -> None:
        """Write `obj` to `f` from the main process (each node's first with
        ``save_on_each_node``): ``torch.save``, or safetensors (`safe_serialization`)."""
        writer = self.is_local_main_process if self.project_configuration.save_on_each_node \
            else self.is_main_process
        export.save(obj, f, writer=writer, safe_serialization=safe_serialization)

    # ----------------------------------------------------------------- training step
    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """``loss.backward()``, divided by the accumulation steps and scaled for fp16."""
        loss = loss / self.grad_state.num_steps
        if self.precision.scaler is not None:
            loss = self.precision.scaler.scale(loss)
        loss.backward(**kwargs)

    @contextlib.contextmanager
    def accumulate(self, *models: torch.nn.Module):
        """One micro-batch of gradient accumulation: gradients sync only on the k-th one and
        on the data loader's last (with sync_each_batch=True, on every one)."""
        self.grad_state.advance()
        with contextlib.ExitStack() as stack:
            if not self.grad_state.sync_gradients and self.sync_each_batch is not True:
                for model in models:
                    stack.enter_context(self.runtime.no_sync(model))
            yield

    def no_sync(self, model: torch.nn.Module):
        """Skip gradient synchronisation for the enclosed forward *and* backward."""
        return self.runtime.no_sync(model)

    @contextlib.contextmanager
    def trigger_sync_in_backward(self, model: torch.nn.Module):
        """The enclosed backward synchronises gradients even after forwards run under
        `no_sync` (several forwards, then several backwards: the last one syncs). DDP only,
        as Accelerate's; elsewhere it does nothing."""
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            yield
            return
        saved = model.require_backward_grad_sync, model.require_forward_param_sync
        model.require_backward_grad_sync = model.require_forward_param_sync = True
        model.reducer.prepare_for_backward([])  # the forward ran with sync off: arm it now
        try:
            yield
        finally:
            model.require_backward_grad_sync, model.require_forward_param_sync = saved

    def autocast(self, autocast_handler: AutocastKwargs | None = None):
        """The mixed-precision context (prepared models' forward already runs in it);
        `autocast_handler` overrides the constructor's."""
        return self.precision.autocast(**({} if autocast_handler is None
                                          else autocast_handler.to_kwargs()))

    def unscale_gradients(self, optimizer=None) -> None:
        """Divide the fp16 loss scale out of gradients (`meshfit.accelerator.prepared`)."""
        if self.precision.scaler is not None and self.grad_state.sync_gradients:
            unscale_gradients(self.precision.scaler, self._registry.optimizers, optimizer)

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2.0
                        ) -> torch.Tensor:
        """Clip the (unscaled, synchronised) gradients' total norm, also sharded (DTensor)
        ones (`meshfit.parallel.clip`) and a whole `Pipeline`'s; returns the norm."""
        self.unscale_gradients()
        # Lazy (as below): the pipeline code loads torch.distributed.pipelining (about a second).
        from meshfit.parallel.pp import Pipeline

        if isinstance(parameters, Pipeline):  # every stage's part of the norm
            return parameters.clip_grad_norm_(max_norm, norm_type=norm_type)
        return clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters, clip_value: float) -> None:
        """Clamp every (unscaled, synchronised) gradient to [-clip_value, clip_value]."""
        self.unscale_gradients()
        from meshfit.parallel.pp import Pipeline

        if isinstance(parameters, Pipeline):
            parameters = parameters.parameters()
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    # ----------------------------------------------------------------- collectives
    def gather(self, tensor: Any) -> Any:
        """Tensors of every data-parallel rank, concatenated (`meshfit.accelerator.processes`)."""
        return processes.gather(tensor, self.runtime.dp_group)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """`gather`, minus the last round's padding (`meshfit.accelerator.processes`)."""
        grad_state = self.grad_state
        return processes.gather_for_metrics(
            input_data, use_gather_object, group=self.runtime.dp_group,
            group_size=self.runtime.dp_size, end_of_dataloader=grad_state.end_of_dataloader,
            remainder=grad_state.remainder)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """All-reduce tensors over the data-parallel ranks; `scale` is applied by Accelerate on
        TPUs only, and ignored here likewise (`meshfit.accelerator.processes`)."""
        return processes.reduce(tensor, reduction, self.runtime.reduce_group)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0,
                             pad_first: bool = False) -> Any:
        """Pad each tensor along `dim` to the largest size any data-parallel rank holds."""
        return pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first,
                                    group=self.runtime.dp_group)

    @property
    def torch_device_mesh(self):
        """The job's `DeviceMesh` (None on one process): its axes by name (``pp``,
        ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``; those of size 1 left out, as
        `meshfit.parallel.layout.Layout.mesh_axes` decides) and the flattened ``dp_cp`` (the
        ranks a loss is averaged over) and, under cp, ``dp_shard_cp``: Accelerate's names."""
        return self.runtime.mesh

    def maybe_context_parallel(self, buffers: list[torch.Tensor] | None = None,
                               buffer_seq_dims: list[int] | None = None,
                               no_restore_buffers: set[torch.Tensor] | None = None):
        """Accelerate's context manager: under context parallel, each tensor of `buffers` is
        cut in place to this rank's part of its sequence dimension (`buffer_seq_dims`, one
        per buffer; `shard_sequence`'s split), and put back on exit unless it is in
        `no_restore_buffers`. Without cp it does nothing. Enter it anew for every batch."""
        return sequence.cut_in_place(buffers, buffer_seq_dims, no_restore_buffers,
                                     cut=None if self.runtime.cp_mesh is None
                                     else self.shard_sequence)

    def shard_sequence(self, *tensors: torch.Tensor, dim: int = 1):
        """Under context parallel (``ParallelDims(cp=C)``): this rank's part of each tensor's
        sequence dimension `dim` (the model's inputs, targets, masks alike; every cp rank of a
        data-parallel rank is fed the same batch), cut as the model's ring attention expects
        (`meshfit.parallel.cp.shard_sequence`, load-balanced unless
        ``cp_load_balance=False``). Without cp the tensors as they are. One tensor in, one
        out; several in, a tuple out."""
        tensors = sequence.shard(tensors, dim, self.runtime.cp_mesh,
                                 load_balance=self.model_options.cp_load_balance)
        return tensors[0] if len(tensors) == 1 else tensors

    @contextlib.contextmanager
    def split_between_processes(self, inputs, apply_padding: bool = False):
        """This data-parallel rank's share of `inputs` (`meshfit.accelerator.processes`)."""
        yield processes.share(inputs, self.runtime.dp_size, self.runtime.dp_rank,
                              apply_padding=apply_padding, device=self.device)

    def join_uneven_inputs(self, joinables, even_batches: bool | None = None):
        """Join for loaders with uneven batches per rank (`meshfit.accelerator.processes`)."""
        return processes.join_uneven_inputs(
            joinables, even_batches, loaders=self._registry.loaders,
            default_even_batches=self.even_batches,
            kind=self.distributed_type, use_distributed=self.use_distributed)

    def free_memory(self, *objects):
        """Forget every prepared object, collect garbage and empty the device cache (between two
        trainings); returns ``[None] * len(objects)`` to assign back."""
        self.wait_for_checkpoint()
        self.runtime.release()  # offload="disk": the files it made go too
        self._registry.forget()  # first: the collection below can then free them
        self.grad_state.step = 0
        return release_memory(*objects)

    def clear(self, *objects):
        """`free_memory`."""
        return self.free_memory(*objects)

    # ----------------------------------------------------------------- trackers
    def init_trackers(self, project_name: str, config: dict | None = None,
                      init_kwargs: dict | None = None) -> None:
        """Start ``log_with``'s trackers on the main process (`meshfit.accelerator.trackers`)."""
        if self.is_main_process:
            trackers.start(self.trackers, self.log_with, project_name, config, init_kwargs,
                           project_dir=self.project_dir, logging_dir=self.logging_dir)

    def get_tracker(self, name: str, unwrap: bool = False):
        """The tracker called `name` (`meshfit.accelerator.trackers`)."""
        return trackers.get_tracker(self.trackers, name, unwrap)

    def log(self, values: dict, step: int | None = None, log_kwargs: dict | None = None) -> None:
        """Log `values` to every tracker, on the main process (`meshfit.accelerator.trackers`)."""
        if self.is_main_process:
            trackers.log(self.trackers, values, step, log_kwargs)

    def end_training(self) -> None:
        """Finish the trackers, commit a checkpoint still being written, then release the
        process group (once, at the end of the script)."""
        for tracker in self.trackers:
            tracker.finish()
        self.wait_for_checkpoint(close=True)
        processes.release(self.env)

    def __repr__(self) -> str:
        return (f"Accelerator(device={self.device}, num_processes={self.num_processes}, "
                f"parallel={self.parallel}, zero_stage={self.zero_stage}, "
                f"mixed_precision={self.mixed_precision!r}, "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps})")

