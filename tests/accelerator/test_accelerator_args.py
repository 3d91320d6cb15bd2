"""The Accelerator's arguments, translated in-process by `meshfit.accelerator.arguments`
(pure functions: no process group, no model), against independent expectations: Hugging Face
Accelerate 1.15's own parsing of the same objects and environment variables where the
translation mirrors it, and the numbers the arguments' meaning fixes otherwise."""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Mapping
from datetime import timedelta

import pytest
import torch

from meshfit import Accelerator, ParallelDims
from meshfit.accelerator.arguments import (Handlers, LayoutRequest, init_kwargs, read_arguments,
                                           resolve_layout, sort_handlers)
from meshfit.distributed import DistEnv
from meshfit.parallel.layout import Engine
from meshfit.utils import (AutocastKwargs, DataLoaderConfiguration, DistributedDataParallelKwargs,
                           DynamoBackend, FullyShardedDataParallelPlugin,
                           GradientAccumulationPlugin, GradScalerKwargs, InitProcessGroupKwargs,
                           LoggerType, ProfileKwargs, ProjectConfiguration)

accelerate = pytest.importorskip("accelerate")
from accelerate import utils as hf  # noqa: E402

# Every argument of the constructor with its default: what the facade hands the translation.
DEFAULTS = {name: p.default
            for name, p in inspect.signature(Accelerator.__init__).parameters.items()
            if name not in ("self", "env")}


def read(environ: Mapping[str, str] | None = None, **given):
    """The translation of ``Accelerator(**given)`` in an environment of `environ` only."""
    return read_arguments({**DEFAULTS, **given}, environ={} if environ is None else environ)


def env_of(world: int, device: str = "cpu") -> DistEnv:
    """Rank 0 of a `world`-process gloo job (no process group is made: only described)."""
    return DistEnv(rank=0, world_size=world, local_rank=0, local_world_size=world,
                   device=torch.device(device), backend="gloo" if world > 1 else None)


# ---------------------------------------------------------------- the whole
def test_accelerates_arguments_keep_its_names_order_and_defaults():
    ours = inspect.signature(Accelerator.__init__).parameters
    theirs = inspect.signature(accelerate.Accelerator.__init__).parameters
    assert list(ours)[:len(theirs)] == list(theirs)
    # split_batches: both a private "not given" sentinel; cpu: None reads MESHFIT_CPU first.
    differ = {n for n, p in theirs.items() if p.default != ours[n].default}
    assert differ == {"split_batches", "cpu"}
    assert theirs["cpu"].default is False and ours["cpu"].default is None


def test_every_argument_is_read():
    seen = set()

    class Watched(dict):
        def __getitem__(self, key):
            seen.add(key)
            return super().__getitem__(key)

    read_arguments(Watched(DEFAULTS), environ={})
    assert seen == set(DEFAULTS)


def test_defaults():
    args = read()
    assert args.layout == LayoutRequest()
    assert (args.precision.mode, args.precision.tf32) == ("no", None)
    assert args.precision.scaler_kwargs is None and args.precision.autocast_kwargs is None
    loop = args.loop
    assert (loop.gradient_accumulation_steps, loop.sync_with_dataloader,
            loop.adjust_scheduler) == (1, True, False)
    assert loop.rng_types == ("generator",)  # Accelerate's default for rng_types=None
    assert loop.dataloader_config == DataLoaderConfiguration()
    assert (args.process.device_placement, args.process.cpu, args.process.init_kwargs) == (
        True, None, {})
    assert args.handlers == Handlers() and args.fsdp_plugin is None
    assert args.log_with == () and args.warnings == ()
    assert not args.model.compile and args.model.ddp_kwargs == {}


def test_options_are_frozen():
    args = read()
    for part in (args, args.layout, args.precision, args.loop, args.process, args.handlers):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(part, dataclasses.fields(part)[0].name, None)


def test_nothing_joins_a_process_group_and_only_environ_is_read(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    args = read(environ={})
    assert args.precision.mode == "no" and args.process.cpu is None
    assert read_arguments(DEFAULTS).precision.mode == "fp16"  # default: os.environ
    assert not torch.distributed.is_initialized()


def test_the_first_wrong_argument_in_the_constructors_order_is_named():
    with pytest.raises(ValueError, match="deepspeed_plugin"):
        read(deepspeed_plugin=object(), device_placement="no")
    with pytest.raises(ValueError, match="gradient_accumulation_steps=0"):
        read(gradient_accumulation_steps=0, mixed_precision="fp4")
    with pytest.raises(ValueError, match="rng_types"):
        read(rng_types=["numpy"], zero_stage=5)


@pytest.mark.parametrize("kwargs", [
    dict(gradient_accumulation_steps=1.5), dict(empty_cache_steps=-1), dict(tf32="yes"),
    dict(mixed_precision="fp4"), dict(zero_stage=5), dict(offload="disk"),
    dict(float8="yes"), dict(float8_recipe="delayed"),
    dict(sync_each_batch="sometimes"), dict(activation_checkpointing="half"),
    dict(compile_scope="layer"), dict(cpu="yes"), dict(log_with=[5]),
    dict(kwargs_handlers=[5]), dict(project_dir=5), dict(ddp_kwargs=["x"]),
    dict(dataloader_config={"even_batches": False}),
])
def test_refusals_are_the_constructors(kwargs, monkeypatch):
    monkeypatch.setenv("MESHFIT_CPU", "1")
    with pytest.raises(ValueError) as direct:
        read(**kwargs)
    with pytest.raises(ValueError) as through:
        Accelerator(**kwargs)
    assert str(direct.value) == str(through.value)


def test_split_batches_is_ignored_with_a_warning():
    assert read(split_batches=True).warnings == (
        "Accelerator(split_batches=...) is ignored, as by Accelerate 1.15; pass "
        "dataloader_config=DataLoaderConfiguration(split_batches=...)",)
    assert read(split_batches=False).warnings != ()


# ---------------------------------------------------------------- environment variables
@pytest.mark.parametrize("value", ["no", "bf16", "fp16"])
def test_accelerate_mixed_precision_from_the_environment(value, monkeypatch):
    from accelerate.utils.environment import parse_choice_from_env

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", value)
    expected = parse_choice_from_env("ACCELERATE_MIXED_PRECISION", "no")  # Accelerate's read
    assert read({"ACCELERATE_MIXED_PRECISION": value}).precision.mode == expected
    assert read({"ACCELERATE_MIXED_PRECISION": value}, mixed_precision="no").precision.mode == "no"
    assert read().precision.mode == "no"  # unset: Accelerate's default


@pytest.mark.parametrize("value", ["1", "true", "True", "yes", "0", "false", "no"])
def test_accelerate_use_cpu_from_the_environment(value, monkeypatch):
    from accelerate.utils.environment import parse_flag_from_env

    monkeypatch.setenv("ACCELERATE_USE_CPU", value)
    expected = parse_flag_from_env("ACCELERATE_USE_CPU")  # what `accelerate launch --cpu` sets
    got = read({"ACCELERATE_USE_CPU": value}, cpu=None).process.cpu
    assert got is (True if expected else None)  # None: left to MESHFIT_CPU
    assert read({"ACCELERATE_USE_CPU": value}, cpu=False).process.cpu is (
        True if expected else False)


# ---------------------------------------------------------------- accumulation
@pytest.mark.parametrize("fields", [
    {}, {"num_steps": 4}, {"num_steps": 2, "sync_with_dataloader": False},
    {"num_steps": 3, "adjust_scheduler": False}, {"num_steps": 3, "adjust_scheduler": True},
])
def test_gradient_accumulation_plugin_as_accelerates_gradient_state(fields):
    from accelerate.state import GradientState

    try:
        theirs = GradientState(gradient_accumulation_plugin=hf.GradientAccumulationPlugin(**fields))
        expected = (theirs.num_steps, theirs.sync_with_dataloader, theirs.adjust_scheduler)
    finally:
        GradientState._reset_state()
    loop = read(gradient_accumulation_plugin=GradientAccumulationPlugin(**fields)).loop
    assert (loop.gradient_accumulation_steps, loop.sync_with_dataloader,
            loop.adjust_scheduler) == expected


def test_gradient_accumulation_plugin_sync_each_batch_is_meshfits():
    plugin = GradientAccumulationPlugin(num_steps=2, sync_each_batch=True)
    assert read(gradient_accumulation_plugin=plugin).layout.sync_each_batch is True
    assert read(gradient_accumulation_plugin=plugin,
                sync_each_batch="auto").layout.sync_each_batch == "auto"
    assert read(gradient_accumulation_steps=4).loop.gradient_accumulation_steps == 4


# ---------------------------------------------------------------- kwargs handlers
def test_handlers_by_kind():
    ddp, init = DistributedDataParallelKwargs(), InitProcessGroupKwargs()
    scaler, cast, prof = GradScalerKwargs(), AutocastKwargs(), ProfileKwargs()
    assert sort_handlers([prof, cast, scaler, init, ddp]) == Handlers(
        ddp=ddp, init=init, scaler=scaler, autocast=cast, profile=prof)
    assert sort_handlers(None) == Handlers()
    with pytest.raises(ValueError) as err:
        sort_handlers([GradScalerKwargs(), GradScalerKwargs(init_scale=2.0)])
    # Accelerate's message, naming the class where scripts import it from.
    assert str(err.value) == ("You can only pass one <class 'meshfit.accelerator.compat."
                              "GradScalerKwargs'> in `kwargs_handlers`.")


def test_ddp_kwargs_as_accelerates_handler_and_the_explicit_ones_win():
    fields = {"find_unused_parameters": True, "bucket_cap_mb": 50, "static_graph": True}
    theirs = hf.DistributedDataParallelKwargs(**fields).to_kwargs()
    args = read(kwargs_handlers=[DistributedDataParallelKwargs(**fields)])
    assert args.model.ddp_kwargs == theirs == fields
    args = read(kwargs_handlers=[DistributedDataParallelKwargs(**fields)],
                ddp_kwargs={"bucket_cap_mb": 10})
    assert args.model.ddp_kwargs == {**theirs, "bucket_cap_mb": 10}
    assert read(ddp_kwargs={"gradient_as_bucket_view": True}).model.ddp_kwargs == {
        "gradient_as_bucket_view": True}


def test_scaler_and_autocast_keywords_as_accelerates():
    scaler = {"init_scale": 1024.0, "growth_interval": 10}
    args = read(kwargs_handlers=[GradScalerKwargs(**scaler), AutocastKwargs(cache_enabled=True)])
    assert args.precision.scaler_kwargs == hf.GradScalerKwargs(**scaler).to_kwargs() == scaler
    assert args.precision.autocast_kwargs == hf.AutocastKwargs(
        cache_enabled=True).to_kwargs() == {"cache_enabled": True}


@pytest.mark.parametrize("fields", [
    {}, {"backend": "gloo"}, {"timeout": timedelta(seconds=60)},
    {"backend": "gloo", "timeout": timedelta(minutes=5)},
])
def test_process_group_keywords_as_accelerates(fields):
    theirs = hf.InitProcessGroupKwargs(**fields)
    expected = {}
    if theirs.backend != "nccl":  # Accelerate's default backend: meshfit picks by device
        expected["backend"] = theirs.backend
    if theirs.timeout != hf.InitProcessGroupKwargs().timeout:
        expected["timeout_s"] = theirs.timeout.total_seconds()
    handler = InitProcessGroupKwargs(**fields)
    assert init_kwargs(handler) == expected
    assert read(kwargs_handlers=[handler]).process.init_kwargs == expected
    assert init_kwargs(None) == {}


def test_gloos_default_timeout_is_accelerates_half_hour():
    assert init_kwargs(InitProcessGroupKwargs(backend="gloo")) == {
        "backend": "gloo", "timeout_s": 1800.0}
    with pytest.raises(ValueError, match=r"init_method=\.\.\.\) is not available"):
        init_kwargs(InitProcessGroupKwargs(init_method="tcp://127.0.0.1:1"))


# ---------------------------------------------------------------- the FSDP plugin
STAGES = {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2, "NO_SHARD": 0}  # ZeRO stage of torch's strategies


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "2", "3"])
def test_fsdp_sharding_strategy_as_accelerate_parses_it(strategy, monkeypatch):
    for name in [k for k in os.environ if k.startswith("FSDP_")]:
        monkeypatch.delenv(name)
    parsed = hf.FullyShardedDataParallelPlugin(sharding_strategy=strategy).sharding_strategy
    stage = STAGES[parsed.name]
    for given in (strategy, parsed):  # the string, and Accelerate's parsed enum member
        args = read(fsdp_plugin=FullyShardedDataParallelPlugin(sharding_strategy=given))
        assert args.layout == LayoutRequest()  # the world size decides (resolve_layout)
        layout = resolve_layout(args, env_of(4))
        assert layout.zero_stage == stage
        assert (layout.dims.dp_shard, layout.dims.dp_replicate) == ((4, 1) if stage else (1, 4))
        assert layout.engine is (Engine.FSDP2 if stage else Engine.DDP)


@pytest.mark.parametrize("reshard", [True, False])
def test_fsdp2_reshard_after_forward_as_accelerate_parses_it(reshard, monkeypatch):
    for name in [k for k in os.environ if k.startswith("FSDP_")]:
        monkeypatch.delenv(name)
    parsed = hf.FullyShardedDataParallelPlugin(fsdp_version=2,
                                               reshard_after_forward=reshard)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2,
                                            reshard_after_forward=parsed.reshard_after_forward)
    assert resolve_layout(read(fsdp_plugin=plugin), env_of(2)).zero_stage == (3 if reshard else 2)


def test_fsdp_plugin_on_one_process_asks_for_nothing():
    # Not even its sharding strategy is read (HYBRID_SHARD is refused on several processes).
    args = read(fsdp_plugin=FullyShardedDataParallelPlugin(sharding_strategy="HYBRID_SHARD"))
    layout = resolve_layout(args, env_of(1))
    assert (layout.zero_stage, layout.engine) == (0, Engine.NONE)
    with pytest.raises(ValueError, match="HYBRID_SHARD is not available"):
        resolve_layout(args, env_of(2))


def test_fsdp_plugin_precision_offload_and_checkpointing_from_accelerates_objects(monkeypatch):
    for name in [k for k in os.environ if k.startswith("FSDP_")]:
        monkeypatch.delenv(name)
    theirs = hf.FullyShardedDataParallelPlugin(mixed_precision_policy="bf16", cpu_offload=True)
    plugin = FullyShardedDataParallelPlugin(mixed_precision_policy=theirs.mixed_precision_policy,
                                            cpu_offload=theirs.cpu_offload,
                                            activation_checkpointing=True)
    args = read(fsdp_plugin=plugin)
    assert args.precision.mode == "bf16" and args.layout.offload == "cpu"
    assert args.model.activation_checkpointing == "full"
    layout = resolve_layout(args, env_of(2))
    assert (layout.zero_stage, layout.host_offload, layout.mixed_precision) == (3, True, "bf16")
    assert read(fsdp_plugin=plugin, activation_checkpointing="selective"
                ).model.activation_checkpointing == "selective"
    assert read(fsdp_plugin=plugin, mixed_precision="bf16").precision.mode == "bf16"
    with pytest.raises(ValueError, match="disagree"):
        read(fsdp_plugin=plugin, mixed_precision="fp16")
    with pytest.raises(ValueError, match="either fsdp_plugin or parallel="):
        read(fsdp_plugin=plugin, zero_stage=2)
    # Accelerate's own plugin is read as meshfit's (`meshfit.accelerator.compat.foreign`)
    args = read(fsdp_plugin=theirs)
    assert args.precision.mode == "bf16" and args.layout.offload == "cpu"
    assert isinstance(args.fsdp_plugin, FullyShardedDataParallelPlugin)
    with pytest.raises(TypeError, match="FullyShardedDataParallelPlugin object"):
        read(fsdp_plugin=object())


# ---------------------------------------------------------------- compile
@pytest.mark.parametrize("backend", ["inductor", "EAGER", "aot_eager", DynamoBackend.AOT_EAGER])
def test_dynamo_backend_compiles_the_whole_model_as_accelerate(backend):
    expected = hf.TorchDynamoPlugin(backend=str(backend)).to_dict()["backend"]
    model = read(dynamo_backend=backend).model
    assert (model.compile, model.compile_backend, model.compile_scope) == (
        True, expected, "model")


@pytest.mark.parametrize("backend", [None, "no", "NO", DynamoBackend.NO])
def test_dynamo_backend_no_compiles_nothing(backend):
    model = read(dynamo_backend=backend).model
    assert (model.compile, model.compile_backend, model.compile_scope) == (
        False, "inductor", "block")
    assert read(dynamo_backend=backend, compile=True, compile_backend="eager").model.compile


# ---------------------------------------------------------------- the layout request
def test_the_layout_request_carries_the_layout_arguments():
    dims = ParallelDims(dp_shard=2, tp=2)
    args = read(parallel=dims, zero_stage=2, offload="none", sync_each_batch="auto",
                sequence_parallel=True, loss_parallel=True)
    assert args.layout == LayoutRequest(dp_shard=2, tp=2, zero_stage=2, offload="none",
                                        sync_each_batch="auto", sequence_parallel=True,
                                        loss_parallel=True)
    layout = resolve_layout(args, env_of(4))
    assert (layout.dims.dp_shard, layout.dims.tp, layout.zero_stage) == (2, 2, 2)
    assert layout.sequence_parallel and layout.loss_parallel and layout.engine is Engine.FSDP2


@pytest.mark.parametrize("world,dims,stage,engine", [
    (1, None, 0, Engine.NONE), (4, None, 0, Engine.DDP),
    (4, ParallelDims(dp_shard=4), 3, Engine.FSDP2),  # default stage with dp_shard > 1: 3
    (4, ParallelDims(dp_replicate=2, dp_shard=2), 3, Engine.FSDP2),
])
def test_resolve_layout_on_the_jobs_processes(world, dims, stage, engine):
    layout = resolve_layout(read(parallel=dims), env_of(world))
    assert (layout.zero_stage, layout.engine, layout.dims.world_size) == (stage, engine, world)


def test_zero_stage_1_and_ddp_kwargs():
    args = read(parallel=ParallelDims(dp_shard=2), zero_stage=1,
                ddp_kwargs={"find_unused_parameters": True})
    layout = resolve_layout(args, env_of(2))
    assert (layout.zero_stage, layout.engine) == (1, Engine.ZERO1)


def test_device_placement_off_the_cpu_is_refused_for_the_device():
    args = read(device_placement=False)
    assert resolve_layout(args, env_of(1)).engine is Engine.NONE
    with pytest.raises(ValueError, match="available on the CPU only; this process runs on cuda"):
        resolve_layout(args, env_of(1, "cuda"))


# ---------------------------------------------------------------- loop, project, trackers
def test_loop_options():
    config = DataLoaderConfiguration(even_batches=False)
    loop = read(dataloader_config=config, rng_types=["torch", "generator"],
                step_scheduler_with_optimizer=False, step_scheduler_per_process=False,
                empty_cache_steps=3).loop
    assert loop.dataloader_config is config  # the user's object (even_batches is settable)
    assert loop.rng_types == ("torch", "generator")
    assert (loop.step_scheduler_with_optimizer, loop.step_scheduler_per_process,
            loop.empty_cache_steps) == (False, False, 3)


def test_project_configuration_as_accelerate_fills_it(tmp_path):
    theirs = hf.ProjectConfiguration(project_dir=str(tmp_path))
    ours = read(project_dir=str(tmp_path)).project_configuration
    assert (ours.project_dir, ours.logging_dir) == (theirs.project_dir, theirs.logging_dir)
    given = ProjectConfiguration(automatic_checkpoint_naming=True)
    out = read(project_dir=str(tmp_path), project_config=given).project_configuration
    assert out is given and (given.project_dir, given.logging_dir) == (str(tmp_path),) * 2
    assert read().project_configuration.project_dir is None


def test_log_with():
    class Tracker:
        name = "mine"

        def log(self, values, step=None):
            pass

    mine = Tracker()
    assert read(log_with=[LoggerType.TENSORBOARD, "WandB", mine]).log_with == (
        "tensorboard", "wandb", mine)
    assert read(log_with="all").log_with == ("all",)


@pytest.mark.parametrize("kwargs, wanted", [
    (dict(rng_types="torch"), "rng_types='torch' must be a list of names, e.g. ['torch']"),
    (dict(dataloader_config="even"), "dataloader_config='even' must be a "
                                     "DataLoaderConfiguration"),
])
def test_arguments_of_the_wrong_kind_are_one_line(kwargs, wanted):
    with pytest.raises(ValueError) as err:
        read(**kwargs)
    assert wanted in str(err.value) and "\n" not in str(err.value)


def test_rng_type_members_are_accepted():
    from meshfit.utils import RNGType

    assert read(rng_types=[RNGType.TORCH, "generator"]).loop.rng_types == ("torch", "generator")


def test_a_loader_without_batch_size_is_refused_for_what_it_is(monkeypatch):
    from torch.utils.data import DataLoader, TensorDataset

    monkeypatch.setenv("MESHFIT_CPU", "1")
    acc = Accelerator()
    with pytest.raises(ValueError, match=r"batch_size=None \(the dataset yields whole batches\) "
                                         "is not supported yet"):
        acc.prepare(DataLoader(TensorDataset(torch.zeros(4)), batch_size=None))


def test_a_layout_request_is_taken_whole(tmp_path):
    """``parallel=LayoutRequest(...)`` is the request as given (every field, disk offload's
    folder checked against the request's offload); the option keywords say the same thing
    again, so one beside it is refused; sizes alone (`ParallelDims`) with keywords build the
    same request."""
    request = LayoutRequest(dp_shard=2, zero_stage=3, offload="disk", offload_params=True,
                            sequence_parallel=False, schedule="gpipe")
    args = read(parallel=request, offload_dir=str(tmp_path))
    assert args.layout == request and args.offload_dir == str(tmp_path)
    flat = read(parallel=ParallelDims(dp_shard=2), zero_stage=3, offload="disk",
                offload_params=True, offload_dir=str(tmp_path))
    assert flat.layout.fields_dict() == dataclasses.replace(request, schedule="1f1b"
                                                             ).fields_dict()
    with pytest.raises(ValueError, match=r"the request holds zero_stage already"):
        read(parallel=request, zero_stage=3, offload_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"offload='disk' needs offload_dir"):
        read(parallel=request)
    with pytest.raises(ValueError, match=r"^parallel=3 must be a meshfit.ParallelDims"):
        read(parallel=3)
    # the gradient-accumulation plugin's sync_each_batch joins the request
    plugin = GradientAccumulationPlugin(num_steps=2, sync_each_batch=True)
    assert read(parallel=LayoutRequest(dp_shard=2), gradient_accumulation_plugin=plugin
                ).layout.sync_each_batch is True
