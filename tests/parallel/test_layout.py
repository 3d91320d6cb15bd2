"""The one layout decision (`meshfit.parallel.layout.Layout`): engines, mesh axes, rules,
warnings, costs and the enumeration of candidates — all in-process, no process group."""

from __future__ import annotations

import pytest
import torch

from meshfit.models import GPT, GPTConfig
from meshfit.parallel.layout import Engine, Layout, ModelFacts
from meshfit.parallel.request import LayoutRequest


def resolve(world: int = 8, **kw) -> Layout:
    """`Layout.resolve` of the request of `kw`'s request fields, the rest the caller's."""
    fields = {k: kw.pop(k) for k in LayoutRequest.field_names() if k in kw}
    return Layout.resolve(LayoutRequest(**fields), world, **kw)


@pytest.mark.parametrize("world, dims, options, engine, stage, axes", [
    (1, {}, dict(distributed=False), Engine.NONE, 0, ("dp_replicate",)),
    (4, {}, {}, Engine.DDP, 0, ("dp_replicate",)),
    (4, dict(dp_shard=4, dp_replicate=1), dict(zero_stage=1), Engine.ZERO1, 1, ("dp_shard",)),
    (4, dict(dp_shard=4, dp_replicate=1), {}, Engine.FSDP2, 3, ("dp_shard",)),
    (4, dict(dp_shard=4, dp_replicate=1, ep=2), dict(zero_stage=1), Engine.FSDP2, 1,
     ("dp_shard", "ep")),
    (4, dict(dp_shard=2), dict(zero_stage=2), Engine.FSDP2, 2, ("dp_replicate", "dp_shard")),
    (4, dict(tp=4, dp_replicate=1), {}, Engine.NONE, 0, ("dp_replicate", "dp_shard", "tp")),
    (4, dict(tp=2), {}, Engine.FSDP2_REPLICATE, 0, ("dp_replicate", "dp_shard", "tp")),
    (8, dict(pp=2, dp_shard=2, tp=2, dp_replicate=1), dict(zero_stage=1), Engine.FSDP2, 1,
     ("pp", "dp_replicate", "dp_shard", "tp")),
    # context parallel: the cp ranks hold the same parameters, so they join the gradient
    # average (DDP over dp x cp) or the sharding (FSDP2 over dp_shard x cp)
    (2, dict(cp=2, dp_replicate=1), {}, Engine.DDP, 0, ("dp_replicate", "cp")),
    (2, dict(cp=2, dp_replicate=1), dict(zero_stage=3), Engine.FSDP2, 3, ("dp_replicate", "cp")),
    (4, dict(cp=2, dp_shard=2, dp_replicate=1), dict(zero_stage=2), Engine.FSDP2, 2,
     ("dp_shard", "cp")),
    (4, dict(cp=2, tp=2, dp_replicate=1), dict(zero_stage=1), Engine.FSDP2, 1,
     ("dp_replicate", "dp_shard", "cp", "tp")),
])
def test_engine_stage_and_mesh_axes(world, dims, options, engine, stage, axes):
    layout = resolve(world, **dims, **options)
    assert (layout.engine, layout.zero_stage, layout.mesh_axes) == (engine, stage, axes)
    assert layout.owns_mixed_precision == (engine in (Engine.FSDP2, Engine.FSDP2_REPLICATE))


def test_costs_are_the_engines_arithmetic():
    ddp = resolve(4).costs
    assert (ddp.param_shards, ddp.grad_shards, ddp.optimizer_shards) == (1, 1, 1)
    assert ddp.grad_reduction == "all_reduce" and ddp.extra_param_copies == 0
    zero1 = resolve(4, dp_shard=4, dp_replicate=1, zero_stage=1).costs
    assert (zero1.param_shards, zero1.grad_shards, zero1.optimizer_shards) == (1, 1, 4)
    assert zero1.optimizer_partition == "whole_parameters"
    zero2 = resolve(4, dp_shard=4, dp_replicate=1, zero_stage=2).costs
    # FSDP2's stage 2 keeps parameters sharded between steps too; it gathers all blocks by
    # the end of forward (stage 3: one block at a time).
    assert (zero2.param_shards, zero2.grad_shards, zero2.optimizer_shards) == (4, 4, 4)
    assert zero2.gathered_params == "all_blocks" and not zero2.whole_grads_until_boundary
    assert resolve(4, dp_shard=4, dp_replicate=1).costs.gathered_params == "one_block"
    hsdp = resolve(4, dp_shard=2, dp_replicate=2).costs
    assert hsdp.grad_reduction == "reduce_scatter+all_reduce"
    replicate = resolve(4, tp=2).costs  # DP+TP: replicate-only FSDP2, one more copy than DDP
    assert replicate.extra_param_copies == 1 and replicate.param_shards == 1
    offload = resolve(4, dp_shard=4, dp_replicate=1, offload="cpu").costs
    assert offload.host_offload
    cp = resolve(4, cp=2, dp_shard=2, dp_replicate=1, zero_stage=3).costs  # over dp_shard x cp
    assert (cp.param_shards, cp.grad_shards, cp.optimizer_shards) == (4, 4, 4)


@pytest.mark.parametrize("kw, match", [
    (dict(cp=2, tp=2, dp_replicate=2), r"zero_stage=0 with cp=2 and tp=2"),
    (dict(ep=2), r"ep=2 must divide dp_shard=1: expert parallelism is carved out"),
    (dict(dp_shard=8, ep=3), r"ep=3 must divide dp_shard=8"),
    (dict(dp_shard=8, ep=2, zero_stage=0), r"zero_stage=0 with ep=2: expert parallelism runs"),
    (dict(zero_stage=2), r"zero_stage=2 shards over the dp_shard axis, which has size 1"),
    (dict(dp_shard=2, zero_stage=0), r"zero_stage=0 \(DDP\) shards nothing, but dp_shard=2"),
    (dict(dp_shard=2, zero_stage=2, offload="cpu"), r"offload='cpu' needs zero_stage=3"),
    (dict(dp_shard=2, offload="cpu", zero_stage=None, pp=2), r"offload='cpu' with pp > 1"),
    (dict(sequence_parallel=True), r"sequence_parallel=true needs tp > 1"),
    (dict(loss_parallel=True), r"loss_parallel=true needs tp > 1"),
    (dict(tp=2, pp=2, loss_parallel=True), r"loss_parallel=true with pp > 1"),
    (dict(pp=2, mixed_precision="fp16"), r"mixed_precision='fp16' with pp > 1"),
    (dict(tp=2, ddp_kwargs={"bucket_cap_mb": 5}), r"ddp_kwargs apply to DDP, which FSDP2"),
    (dict(zero_stage=5), r"zero_stage=5 must be 0 \(DDP\), 1, 2 or 3"),
    (dict(mixed_precision="fp8"), r"mixed_precision='fp8' is not a precision"),
    (dict(offload="nvme"), r"offload='nvme' is not one of 'none', 'cpu', 'disk'"),
    (dict(pp=2, dp_replicate=4, offload="disk"), r"offload='disk' with pp > 1"),
    (dict(dp_shard=8, dp_replicate=1, zero_stage=2, offload="disk", offload_params=True),
     r"offload_params=true needs zero_stage=3 .* resolves to zero_stage=2"),
])
def test_each_rule_refuses_with_one_line(kw, match):
    with pytest.raises(ValueError, match=match) as err:
        resolve(8, **kw)
    assert "\n" not in str(err.value)


def test_ddp_kwargs_only_where_ddp_could_run():
    # One process without a process group takes them (the script runs DDP on more ranks).
    assert Layout.resolve(None, 1, distributed=False, ddp_kwargs={"bucket_cap_mb": 5})
    assert resolve(4, ddp_kwargs={"bucket_cap_mb": 5}).engine is Engine.DDP
    for kw in (dict(dp_shard=4, dp_replicate=1), dict(tp=4, dp_replicate=1)):
        with pytest.raises(ValueError, match=r"ddp_kwargs apply to DDP, which"):
            resolve(4, ddp_kwargs={"bucket_cap_mb": 5}, **kw)


def test_errors_use_the_callers_names():
    names = {"zero_stage": "parallel.zero_stage", "dp_shard": "parallel.dp_shard"}
    with pytest.raises(ValueError, match=r"^parallel.zero_stage=1 shards over the dp_shard axis"
                                         r", which has size 1; set parallel.dp_shard > 1"):
        resolve(4, zero_stage=1, names=names)


def test_warnings_name_the_reason():
    assert resolve(8, pp=2, dp_shard=4, dp_replicate=1, zero_stage=1).warnings == ()
    assert resolve(8, tp=2, dp_shard=4, dp_replicate=1).warnings == ()
    (zero3,) = resolve(8, pp=2, dp_shard=4, dp_replicate=1).warnings
    assert "zero_stage=3 with pp=2" in zero3 and "re-gathers" in zero3
    (cross,) = resolve(8, tp=4, dp_replicate=2, local_world_size=2).warnings
    assert cross.startswith("tp=4 with 2 processes per node: tensor-parallel groups cross nodes")
    assert resolve(8, tp=4, dp_replicate=2).warnings == ()  # processes per node unknown


def test_batch_probe_refused_where_forward_communicates():
    resolve(4, dp_shard=4, dp_replicate=1, zero_stage=1).check_batch_probe()
    for kw, field in ((dict(dp_shard=4, dp_replicate=1), "zero_stage=3"), (dict(tp=2), "tp=2"),
                      (dict(pp=2), "pp=2")):
        with pytest.raises(ValueError, match=f"find_batch_size=true is not supported with "
                                             f"{field}"):
            resolve(4, **kw).check_batch_probe()


def _facts(**cfg) -> ModelFacts:
    with torch.device("meta"):
        return ModelFacts.of(GPT(GPTConfig(vocab_size=256, max_seq_len=32, **cfg)))


def test_model_rules_use_the_models_plans():
    facts = _facts(n_layer=2, n_head=4, d_model=64, d_ff=256)
    assert facts.n_blocks == 2 and ("GPTConfig.n_head", 4, "heads") in facts.divisible
    resolve(4, tp=4, dp_replicate=1).check_model(facts)
    with pytest.raises(ValueError, match=r"GPTConfig.n_head=4 does not divide by tp=8"):
        resolve(8, tp=8, dp_replicate=1).check_model(facts)
    with pytest.raises(ValueError, match=r"pp=4 exceeds the model's 2 blocks"):
        resolve(4, pp=4, dp_replicate=1).check_model(facts)
    with pytest.raises(ValueError, match=r"seq_len=33 does not divide by tp=2"):
        resolve(2, tp=2, dp_replicate=1, sequence_parallel=True).check_model(facts, seq_len=33)


def test_candidates_enumerate_every_split_with_reasons():
    facts = _facts(n_layer=2, n_head=4, d_model=64, d_ff=256)
    cands = list(Layout.candidates(4, facts))
    splits = {(c.dims.pp, c.dims.dp_replicate, c.dims.dp_shard, c.dims.tp) for c in cands}
    # every ordered factorisation of 4 into pp x dp_replicate x dp_shard x tp
    assert len(splits) == 10 and (1, 1, 1, 4) in splits and (4, 1, 1, 1) in splits
    legal = [c for c in cands if c.layout is not None]
    refused = [c for c in cands if c.layout is None]
    assert all(c.refused is None for c in legal) and all(c.refused for c in refused)
    # pp=4 on a 2-block model is refused by the model rule, with its reason
    pp4 = [c for c in cands if c.dims.pp == 4 and c.request.zero_stage == 0]
    assert pp4 and all("exceeds the model's 2 blocks" in c.refused for c in pp4)
    # ZeRO-1 on dp_shard=4 is legal; stage 1 without a shard axis is not
    assert any(c.layout and c.layout.engine is Engine.ZERO1 for c in cands)
    assert all(c.layout is None for c in cands if c.dims.dp_shard == 1 and
               c.request.zero_stage > 0)
    # every legal candidate is exactly what resolve gives for the same request
    for c in legal:
        assert Layout.resolve(c.request, 4) == c.layout
