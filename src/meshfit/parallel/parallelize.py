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
   so that the recomputation lives inside what is compiled next (mode "budget": the
   partitioner of that compile chooses, `apply_memory_budget`), and **activation offload**
   around each block's whole call (`apply_activation_offload`: what checkpointing keeps
   goes to host memory; the layout's own hooks run inside it);
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

from meshfit._compat.ops import is_view
from meshfit.distributed.collectives import apply_to_tensors
from meshfit.models.moe import MoE
from meshfit.parallel.activation import apply_activation_checkpointing
from meshfit.parallel.activation_offload import apply_activation_offload
from meshfit.parallel.compile import apply_compile
from meshfit.parallel.cp import apply_cp
from meshfit.parallel.ddp import apply_ddp
from meshfit.parallel.ep import apply_ep
from meshfit.parallel.ep_hf import (AUX_LOSS_FAMILIES, apply_hf_ep, global_aux_loss_hook,
                                    hf_experts, record_routing)
from meshfit.parallel.float8 import apply_float8
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
    # The fixed order (the module docstring says why each step needs the one before it).
    if not layout.is_fsdp:  # 1. place (FSDP2 places each unit's shard itself)
        model = model.to(device)
    tp_mesh = layout.axis_mesh(mesh, "tp")
    _tensor_parallel(model, tp_mesh, layout, options)          # 2. parameters: DTensors
    experts = _expert_parallel(model, layout, mesh, device)    # 2b. this rank's experts
    _context_parallel(model, layout, mesh, options)            # 2c. attention: a ring
    _float8(model, options, tp_mesh, device)                   # 2d. torchao's linear layers
    _checkpointing(model, options, device)                     # 3. inside what is compiled
    _compile(model, options)                                   # 4. before any DP hook exists
    return _data_parallel(model, layout, options, mesh, device,  # 5. outermost
                          tp=tp_mesh is not None, experts=experts)


def _tensor_parallel(model: nn.Module, tp_mesh, layout: Layout, options: ModelOptions) -> None:
    """Tensor parallel on ``mesh["tp"]``: `apply_tp` needs the plain module."""
    if tp_mesh is None:
        return
    # deferred: tp/ loads torch.distributed.tensor.parallel, ~0.5 s at import (-X importtime,
    # after the trainer's imports), which a run without tp does not need
    from meshfit.parallel.tp import apply_tp

    apply_tp(model, tp_mesh, plan=options.tp_plan, sequence_parallel=layout.sequence_parallel,
             loss_parallel=layout.loss_parallel)


def _expert_parallel(model: nn.Module, layout: Layout, mesh, device: torch.device):
    """Expert parallel on ``mesh["ep"]``: each MoE block keeps its own experts (DTensor
    shards) and exchanges tokens by all-to-all; returns the experts modules (None without
    ep), which FSDP2 shards on their own mesh. A transformers MoE (`meshfit.parallel.ep_hf`)
    also records its routing for `routing_metrics` and, with its router loss on, under
    context parallel takes that loss's statistics over the cp ranks (which hold parts of the
    same sequences: together, the tokens one process's forward sees)."""
    ep_mesh = layout.axis_mesh(mesh, "ep")
    hf = bool(hf_experts(model))  # (a pipeline stage of one too: no config of its own)
    if hf:
        record_routing(model)
        # the router loss of a family whose loss is the one `load_balancing_loss` computes
        if getattr(getattr(model, "config", None), "model_type", None) in AUX_LOSS_FAMILIES:
            group = layout.axis_mesh(mesh, "cp") if mesh is not None else None
            global_aux_loss_hook(model, None if group is None else group.get_group(),
                                 1 if group is None else group.size())
    if ep_mesh is None:
        return None
    if hf:
        return apply_hf_ep(model, ep_mesh, device=device)
    return apply_ep(model, ep_mesh, device=device)


def _context_parallel(model: nn.Module, layout: Layout, mesh, options: ModelOptions) -> None:
    """Context parallel on ``mesh["cp"]``: each rank takes its part of every sequence."""
    cp_mesh = layout.axis_mesh(mesh, "cp")
    if cp_mesh is None:
        return
    apply_cp(model, cp_mesh, balanced=options.cp_load_balance)
    for module in model.modules():  # (the auxiliary losses over each sequence's parts)
        if isinstance(module, MoE):
            module.sequence_group = cp_mesh.get_group()


def _float8(model: nn.Module, options: ModelOptions, tp_mesh, device: torch.device) -> None:
    """torchao's float8 linear layers, before they are checkpointed and compiled."""
    if not options.float8:
        return
    if tp_mesh is not None:
        raise ValueError("float8=True with tensor parallel (tp > 1) is not available yet; "
                         "use float8 with data parallel, ZeRO/FSDP or pipeline layouts")
    apply_float8(model, options.float8_recipe, device=device)


def _checkpointing(model: nn.Module, options: ModelOptions, device: torch.device) -> None:
    """Activation checkpointing of each transformer block, then activation offload."""
    if options.activation_checkpointing != "none":
        apply_activation_checkpointing(model, options.activation_checkpointing,
                                       every=options.activation_checkpointing_every,
                                       policy=options.activation_checkpointing_policy,
                                       budget=options.activation_checkpointing_budget)
    if options.activation_offload:
        apply_activation_offload(model, device=device)


def _compile(model: nn.Module, options: ModelOptions) -> None:
    """torch.compile of each (checkpointed) block, or of the whole model."""
    if not options.compile:
        return
    apply_compile(model, backend=options.compile_backend, mode=compile_mode(options.compile_mode),
                  scope=options.compile_scope)


def _data_parallel(model: nn.Module, layout: Layout, options: ModelOptions, mesh,
                   device: torch.device, *, tp: bool, experts) -> nn.Module:
    """The data-parallel wrapper: DDP over the ranks whose gradients are averaged (ZeRO 0
    and 1), or FSDP2 (ZeRO 2/3, and every data-parallel layout with tp or pp); the model
    itself where neither applies."""
    if layout.engine in (Engine.DDP, Engine.ZERO1):
        if not any(p.requires_grad for p in model.parameters()):
            return model  # nothing to synchronise (e.g. an evaluation-only model)
        return apply_ddp(model, layout.grad_mesh(mesh), device=device, **options.ddp_kwargs)
    if not layout.is_fsdp:
        return model
    # deferred: FSDP2 (torch.distributed.fsdp) adds ~0.6 s to the trainer's import (-X
    # importtime), which a DDP or one-device run does not need
    from meshfit.parallel.fsdp import apply_fsdp

    if tp:
        model.register_forward_hook(_fresh_outputs)  # runs before FSDP2's own hook
    return apply_fsdp(model, layout.fsdp_mesh(mesh),
                      reshard_after_forward=layout.reshard_after_forward,
                      param_dtype=layout.param_dtype, offload=layout.host_offload,
                      experts=experts, expert_mesh=layout.expert_fsdp_mesh(mesh))


def _fresh_outputs(module: nn.Module, args, output):
    """FSDP2 starts a unit's backward from a hook on each output tensor of its forward. An
    in-place op on an output that is a view (`logits /= t`) replaces the view's autograd
    node, dropping that hook, and the backward all-gather is silently skipped. Tensor
    parallel's `to_local()` returns views (the gathered logits, for one), so such an output
    is copied once, here, before FSDP2 registers its hook."""
    return apply_to_tensors(lambda t: t.clone() if t.requires_grad and is_view(t) else t, output)
