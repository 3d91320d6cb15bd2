"""`parallelize`: apply a `Layout` to a model, every technique in one fixed order.

    model = parallelize(model, layout, options, mesh=mesh, device=device)

The order is torchtitan's, and each step needs the one before it:

1. **place** the model on this rank's device — except under FSDP2, which moves each unit's
   shard as it shards it, so the whole unsharded model never has to fit on one device;
2. **tensor parallel** on ``mesh["tp"]`` (`apply_tp` needs the plain module and turns its
   parameters into DTensors), then **expert parallel** on ``mesh["ep"]`` (`apply_ep`: each
   MoE block keeps its own experts, a DTensor shard, and exchanges tokens by all-to-all),
   then **context parallel** on ``mesh["cp"]`` (`apply_cp`: the model takes its part of each
   sequence, its attention a ring over the cp ranks);
   With ``float8``, the linear layers then become torchao's float8 ones (`apply_float8`);
3. **activation checkpointing** of each transformer block (`apply_activation_checkpointing`),
   so that the recomputation lives inside what is compiled next;
4. **compile** each (checkpointed) block, or the whole model (`apply_compile`);
5. the **data-parallel wrapper** outside everything else: DDP over the data-parallel ranks
   (ZeRO stage 0 and 1; ZeRO-1's optimizer is built later, on the wrapped parameters), or
   FSDP2 over ``(dp_replicate, dp_shard)`` (stages 2/3, and every data-parallel layout with
   tp or pp). FSDP2 then shards the compiled blocks, which keeps them compiled: compiling a
   sharded model instead can silently run eager (a graph break on FSDP's hooks skips the
   whole frame; see `meshfit.parallel.compile`).

`Accelerator.prepare` calls it on a whole model, `Accelerator.prepare_pipeline` on every
pipeline stage; nothing else applies a technique to a model.
"""

from __future__ import annotations

import torch
from torch import nn

from meshfit.parallel.layout import Engine, Layout
from meshfit.parallel.options import ModelOptions, compile_mode

__all__ = ["parallelize"]


def parallelize(model: nn.Module, layout: Layout, options: ModelOptions = ModelOptions(), *,
                mesh=None, device: torch.device | None = None) -> nn.Module:
    """Apply `layout` to `model` (in place where the techniques allow it) and return the
    module to train: the model itself, or its DDP wrapper.

    `mesh`: the layout's device mesh (`layout.build_mesh`), None for a single process;
    `device`: this rank's device (default: the CPU). The weights must be initialised
    before: sharding a meta-device model and initialising the shards afterwards gives every
    rank the same random shard on CPU meshes (torch only warns "DTensor random operators
    may not have complete support on cpu device mesh").
    """
    device = device or torch.device("cpu")
    # 1. Place (FSDP2 places each unit's shard itself).
    if not layout.is_fsdp:
        model = model.to(device)
    # 2. Tensor parallel: parameters become DTensors on mesh["tp"].
    tp_mesh = layout.axis_mesh(mesh, "tp")
    if tp_mesh is not None:
        from meshfit.parallel.tp import apply_tp

        apply_tp(model, tp_mesh, plan=options.tp_plan,
                 sequence_parallel=layout.sequence_parallel, loss_parallel=layout.loss_parallel)
    # 2b. Expert parallel: this rank's experts, as DTensors on mesh["ep"].
    experts = None
    ep_mesh = layout.axis_mesh(mesh, "ep")
    if ep_mesh is not None:
        from meshfit.parallel.ep import apply_ep

        experts = apply_ep(model, ep_mesh, device=device)
    # 2c. Context parallel: each rank takes its part of every sequence; attention is a ring.
    cp_mesh = layout.axis_mesh(mesh, "cp")
    if cp_mesh is not None:
        from meshfit.parallel.cp import apply_cp

        apply_cp(model, cp_mesh, balanced=options.cp_load_balance)
    # 2d. float8 linear layers (torchao), before they are checkpointed and compiled.
    if options.float8:
        if tp_mesh is not None:
            raise ValueError("float8=True with tensor parallel (tp > 1) is not available yet; "
                             "use float8 with data parallel, ZeRO/FSDP or pipeline layouts")
        from meshfit.parallel.float8 import apply_float8

        apply_float8(model, options.float8_recipe, device=device)
    # 3. Activation checkpointing, inside what is compiled.
    if options.activation_checkpointing != "none":
        from meshfit.parallel.activation import apply_activation_checkpointing

        apply_activation_checkpointing(model, options.activation_checkpointing,
                                       every=options.activation_checkpointing_every,
                                       policy=options.activation_checkpointing_policy)
    # 4. Compile, before the data-parallel wrapper's hooks exist.
    if options.compile:
        from meshfit.parallel.compile import apply_compile

        apply_compile(model, backend=options.compile_backend,
                      mode=compile_mode(options.compile_mode),
                      scope=options.compile_scope)
    # 5. The data-parallel wrapper, outermost.
    if layout.engine in (Engine.DDP, Engine.ZERO1):
        if not any(p.requires_grad for p in model.parameters()):
            return model  # nothing to synchronise (e.g. an evaluation-only model)
        from meshfit.parallel.ddp import apply_ddp

        return apply_ddp(model, layout.grad_mesh(mesh), device=device, **options.ddp_kwargs)
    if layout.is_fsdp:
        from meshfit.parallel.fsdp import apply_fsdp

        if tp_mesh is not None:
            model.register_forward_hook(_fresh_outputs)  # runs before FSDP2's own hook
        return apply_fsdp(model, layout.fsdp_mesh(mesh),
                          reshard_after_forward=layout.reshard_after_forward,
                          param_dtype=layout.param_dtype, offload=layout.host_offload,
                          experts=experts, expert_mesh=layout.expert_fsdp_mesh(mesh))
    return model


def _fresh_outputs(module: nn.Module, args, output):
    """FSDP2 starts a unit's backward from a hook on each output tensor of its forward. An
    in-place op on an output that is a view (`logits /= t`) replaces the view's autograd
    node, dropping that hook, and the backward all-gather is silently skipped. Tensor
    parallel's `to_local()` returns views (the gathered logits, for one), so such an output
    is copied once, here, before FSDP2 registers its hook."""
    from meshfit.distributed.collectives import apply_to_tensors

    return apply_to_tensors(
        lambda t: t.clone() if t.requires_grad and t._base is not None else t, output)
