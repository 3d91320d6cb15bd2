"""`meshfit.transformers.TrainingArguments`' layout argument, in-process (no process group):
``parallel=`` read into a `LayoutRequest`, transformers' ``fsdp=``/``deepspeed=`` translated
to ZeRO stages with one line saying so, and every refusal one line naming the argument."""

from __future__ import annotations

import json
import logging

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from meshfit.parallel.layout import Layout  # noqa: E402
from meshfit.parallel.request import LayoutRequest  # noqa: E402
from meshfit.transformers import TrainingArguments  # noqa: E402
from meshfit.transformers.translate import from_deepspeed, from_fsdp  # noqa: E402


def _args(tmp_path, **kwargs) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                             **kwargs)


def _one_line(err: pytest.ExceptionInfo, *words: str) -> None:
    text = str(err.value)
    assert "\n" not in text, text
    for word in words:
        assert word in text, (word, text)


@pytest.mark.parametrize("value,request_", [
    ("dp_shard=2,zero_stage=3", LayoutRequest(dp_shard=2, zero_stage=3)),
    ("tp=2,sequence_parallel=true", LayoutRequest(tp=2, sequence_parallel=True)),
    (LayoutRequest(cp=2), LayoutRequest(cp=2)),
    ("auto", "auto"),
    (None, None),
])
def test_parallel_is_meshfits_layout_request(tmp_path, value, request_):
    assert _args(tmp_path, parallel=value).parallel == request_


@pytest.mark.parametrize("fsdp,config,stage,offload", [
    (True, None, 3, "none"),
    ("full_shard", None, 3, "none"),
    ("full_shard", {"reshard_after_forward": False}, 2, "none"),
    ("shard_grad_op", None, 2, "none"),
    ("full_shard offload auto_wrap", None, 3, "cpu"),
    (["full_shard"], {"fsdp_cpu_offload": "true"}, 3, "cpu"),
    ("no_shard", None, 0, "none"),
    ("hybrid_shard_zero2", None, 2, "none"),
])
def test_fsdp_becomes_a_zero_stage(tmp_path, caplog, fsdp, config, stage, offload):
    with caplog.at_level(logging.WARNING, logger="meshfit"):
        args = _args(tmp_path, fsdp=fsdp, fsdp_config=config)
    assert (args.parallel.zero_stage, args.parallel.offload) == (stage, offload)
    assert not args.fsdp and args.fsdp_plugin_args is None  # Accelerate's FSDP stays off
    lines = [r.getMessage() for r in caplog.records if "runs as meshfit's" in r.getMessage()]
    assert len(lines) == 1 and f"fsdp={fsdp!r}" in lines[0], lines


@pytest.mark.parametrize("zero,stage,offload", [
    ({"stage": 1}, 1, "none"),
    ({"stage": 2}, 2, "none"),
    ({"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
     3, "cpu"),
    ({}, 0, "none"),
])
def test_deepspeed_zero_config_becomes_a_zero_stage(tmp_path, caplog, zero, stage, offload):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": zero, "train_batch_size": "auto"}))
    with caplog.at_level(logging.WARNING, logger="meshfit"):
        args = _args(tmp_path, deepspeed=str(path))
    assert (args.parallel.zero_stage, args.parallel.offload) == (stage, offload)
    assert args.deepspeed is None  # transformers' DeepSpeed integration stays off
    assert any(f"deepspeed ZeRO stage {stage} runs as meshfit's" in r.getMessage()
               for r in caplog.records)


def test_translated_layouts_resolve_on_two_processes():
    """What fsdp= and deepspeed= give is a layout meshfit builds: the sizes fill the job."""
    for request, _ in (from_fsdp("full_shard", None), from_deepspeed({"zero_optimization": {
            "stage": 1}})):
        layout = Layout.resolve(request, 2, distributed=True)
        assert layout.dims.dp_shard == 2 and layout.zero_stage == request.zero_stage


@pytest.mark.parametrize("kwargs,words", [
    (dict(parallel="pp=2"), ["pp=2", "pipeline", "meshfit train"]),
    (dict(parallel=LayoutRequest(pp=2, dp_shard=1)), ["pp=2", "pipeline"]),
    (dict(parallel=3), ["parallel=3", "LayoutRequest", "'auto'"]),
    (dict(parallel="zero_stage=5"), ["zero_stage=5"]),
    (dict(parallel="dp_shard=2", fsdp="full_shard"), ["fsdp=", "parallel=", "once"]),
    (dict(fsdp="full_shard bogus"), ["'bogus'", "FSDP option"]),
    (dict(fsdp=True, fsdp_config={"xla": True}), ["xla"]),
    (dict(deepspeed={"zero_optimization": {"stage": 2, "offload_optimizer": {
        "device": "cpu"}}}), ["stage 2", "stage 3", "cpu"]),
    (dict(deepspeed={"zero_optimization": {"stage": 3, "offload_param": {
        "device": "nvme"}}}), ["nvme", "offload=disk"]),
    (dict(deepspeed={"zero_optimization": {"stage": 4}}), ["stage=4"]),
    (dict(deepspeed="/nonexistent/ds.json"), ["/nonexistent/ds.json", "JSON"]),
])
def test_bad_layout_arguments_are_one_line(tmp_path, kwargs, words):
    with pytest.raises(ValueError) as err:
        _args(tmp_path, **kwargs)
    _one_line(err, *words)


def test_checkpoints_refused_where_the_layout_shards_them(tmp_path):
    """Trainer's checkpoints hold the optimizer state as process 0 has it: refused (before
    any file) on a layout that shards it, unless they hold the model alone; DDP keeps them."""
    from meshfit.transformers.trainer import _check_checkpoints

    saving = _args(tmp_path, save_strategy="steps")
    for request in (LayoutRequest(dp_shard=2, zero_stage=3), LayoutRequest(tp=2),
                    LayoutRequest(dp_shard=2, zero_stage=1)):
        with pytest.raises(ValueError) as err:
            _check_checkpoints(saving, Layout.resolve(request, 2, distributed=True))
        _one_line(err, "save_strategy='steps'", "save_strategy='no'", "save_only_model=True")
        _check_checkpoints(_args(tmp_path, save_strategy="steps", save_only_model=True),
                           Layout.resolve(request, 2, distributed=True))
    _check_checkpoints(saving, Layout.resolve(LayoutRequest(), 2, distributed=True))
    _check_checkpoints(_args(tmp_path, save_strategy="no"),
                       Layout.resolve(LayoutRequest(dp_shard=2, zero_stage=3), 2,
                                      distributed=True))


def test_parallel_from_the_command_line_and_in_the_logged_dict(tmp_path):
    """``--parallel`` through transformers' HfArgumentParser; ``to_dict`` (what trackers
    log) holds the layout in words."""
    from transformers import HfArgumentParser

    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_cpu", "--report_to", "none",
         "--parallel", "dp_shard=2,zero_stage=3"])
    assert args.parallel == LayoutRequest(dp_shard=2, zero_stage=3)
    assert args.to_dict()["parallel"] == "dp_shard 2, ZeRO-3"
    json.loads(args.to_json_string())


def test_auto_is_the_planners_first_choice(tmp_path, monkeypatch):
    """parallel='auto': `meshfit.plan.search`'s first layout for the job (2 processes on this
    CPU); a model the planner cannot read is one line."""
    import torch
    import transformers

    from meshfit.memory import ModelShape
    from meshfit.plan.devices import DEVICES
    from meshfit.plan.search import Cluster, search
    from meshfit.transformers.planned import planned_layout

    args = _args(tmp_path, per_device_train_batch_size=4, optim="adamw_torch")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    # (after the arguments: with WORLD_SIZE set, transformers would join a process group)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    rows = [{"input_ids": torch.zeros(16, dtype=torch.long)}]
    chosen = planned_layout(model, args, rows)
    first = search(ModelShape.from_module(model), Cluster(gpus_per_node=2, device=DEVICES["cpu"]),
                   seq_len=16, global_batch_size=8, dtype="fp32", optimizer="adamw",
                   checkpointing=("none",)).plans[0].layout
    assert chosen == LayoutRequest(**{k: getattr(first, k) for k in LayoutRequest.field_names()})
    with pytest.raises(ValueError) as err:
        planned_layout(torch.nn.Linear(4, 4), args, rows)
    _one_line(err, "parallel='auto'", "cannot read", "dp_shard=2,zero_stage=3")


def test_on_meshfit_takes_trainer_classes_only():
    from meshfit.transformers import on_meshfit

    with pytest.raises(ValueError) as err:
        on_meshfit(dict)
    _one_line(err, "on_meshfit", "transformers.Trainer")
