"""ZeRO stages 2 and 3 with PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

ZeRO (Rajbhandari et al., 2020) removes the data-parallel redundancy of the model states:
stage 2 shards gradients and optimizer state over the N data-parallel ranks, stage 3 also the
parameters, gathering each block's parameters just before its forward (and again before its
backward) and freeing them after. FSDP2 implements both as one runtime over DTensor
parameters sharded per element on dim 0 (``Shard(0)``, balanced, padded when dim 0 does not
divide by N):

    stage 3  ``fully_shard(block, reshard_after_forward=True)``: after a block's forward its
             parameters are freed, and all-gathered again for its backward.
    stage 2  ``reshard_after_forward=False``: a block keeps its gathered parameters from
             forward to the end of its backward, so backward needs no second all-gather.
             Note that FSDP2 still reshards after backward: between steps its parameters are
             sharded as in stage 3 (``meshfit.memory.zero_formula(..., fsdp2=True)``). The
             difference to stage 3 is the peak during the step (every block's parameters
             are gathered at the end of forward), not the bytes at rest. ZeRO's stage 2
             proper keeps all parameters replicated at all times.

Each transformer block (``meshfit.parallel.activation.find_blocks``) is one FSDP unit, so one
block's parameters are gathered at a time; the root call takes the rest (embeddings, final
norm, head — a tied head stays in one unit with its embedding, as FSDP2 requires). The root
keeps its parameters gathered after forward (``reshard_after_forward=False``, FSDP2's own
heuristic for the root, and torchtitan's): backward needs them first.

Mesh: a 1-D ``dp_shard`` mesh shards; a 2-D ``(dp_replicate, dp_shard)`` mesh is hybrid
sharding (HSDP): parameters are ``(Replicate(), Shard(0))``, sharded inside each group of
``dp_shard`` ranks and replicated across the ``dp_replicate`` groups, gradients
reduce-scattered inside a group and all-reduced across groups.

Mixed precision is FSDP's policy, not autocast: parameters are all-gathered and computed in
``param_dtype`` (bf16/fp16), gradients reduced in fp32, and the sharded master parameters,
gradients and optimizer state stay fp32. ``output_dtype=fp32`` on the root only: a block
that returned fp32 would feed fp32 activations to the next low-precision block.

Initialise weights before sharding (see `meshfit.parallel.parallelize.parallelize`).
"""

from __future__ import annotations

import os
import warnings

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from meshfit._compat import fsdp as fsdp_internals
from meshfit.parallel.activation import find_blocks

__all__ = ["apply_fsdp", "available_memory_bytes", "held_gradient_bytes",
           "unsharded_gradient_bytes"]


def apply_fsdp(model: nn.Module, mesh, *, reshard_after_forward: bool,
               param_dtype: torch.dtype | None = None, offload: bool = False,
               blocks: list[nn.Module] | None = None,
               experts: list[nn.Module] | None = None, expert_mesh=None) -> nn.Module:
    """Shard `model` in place with FSDP2 over `mesh` (1-D or 2-D, see the module docstring)
    and return it (now an `FSDPModule`). `reshard_after_forward`: True for ZeRO-3, False for
    ZeRO-2; `param_dtype`: the policy's compute dtype (None: the parameters' own).

    `offload`: keep the sharded parameters, gradients and optimizer state in host memory
    (ZeRO-Offload); FSDP2 copies each unit's shard to the device for the all-gather and the
    optimizer steps on the CPU. Pinned memory only where CUDA exists (`CPUOffloadPolicy()`'s
    default pins memory, which fails without an accelerator: "Cannot access accelerator
    device when none is available"). `blocks`: the FSDP units below the root; default:
    `find_blocks(model)` (none found: the whole model is one unit). `experts`: under expert
    parallelism, the MoE blocks' `Experts` modules (already DTensors on the ``ep`` mesh,
    `meshfit.parallel.ep.apply_ep`): each is its own unit on `expert_mesh` (the
    data-parallel ranks holding the same experts), or, with `expert_mesh` None (no such
    ranks), left out of FSDP2 altogether."""
    if blocks is None:
        blocks = _blocks(model)
    _warn_small(model, mesh.size(mesh.ndim - 1))
    common: dict = {"mesh": mesh}
    if offload:
        common["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    block_policy = root_policy = None
    if param_dtype is not None:
        block_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        root_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32,
                                           output_dtype=torch.float32)
    ignored: set[nn.Parameter] = set()
    for module in experts or ():
        if expert_mesh is None:
            ignored.update(module.parameters())
        else:
            fully_shard(module, mesh=expert_mesh, reshard_after_forward=reshard_after_forward,
                        **{k: v for k, v in common.items() if k != "mesh"},
                        **_policy(block_policy))
    skip = {"ignored_params": ignored} if ignored else {}
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward,
                    **common, **_policy(block_policy), **skip)
    fully_shard(model, reshard_after_forward=False, **common, **_policy(root_policy), **skip)
    return model


def _policy(policy: MixedPrecisionPolicy | None) -> dict:
    return {} if policy is None else {"mp_policy": policy}


def _blocks(model: nn.Module) -> list[nn.Module]:
    try:
        return find_blocks(model)
    except ValueError:  # no repeated blocks: the root is the only unit
        return []


def _warn_small(model: nn.Module, shards: int) -> None:
    """FSDP2 splits dim 0 in N chunks of ceil(dim0 / N), padding the last; a parameter with
    dim 0 < N leaves some ranks an empty shard (no saving, and extra padding traffic)."""
    small = [name for name, p in model.named_parameters()
             if p.ndim == 0 or p.shape[0] < shards]
    if small:
        shown = ", ".join(small[:3]) + (", ..." if len(small) > 3 else "")
        warnings.warn(f"apply_fsdp: {len(small)} parameter(s) have dim 0 smaller than the "
                      f"{shards} shard ranks ({shown}); some ranks hold empty shards — the "
                      "model may be too small to shard usefully (use DDP / zero_stage=0)",
                      UserWarning, stacklevel=3)


# ---------------------------------------------------------------- memory for accumulation
def unsharded_gradient_bytes(model: nn.Module) -> int:
    """Bytes of one full, unsharded gradient per rank: what `set_requires_gradient_sync(False)`
    keeps between micro-batches (FSDP2 accumulates unsharded gradients, in fp32 when the
    reduce dtype is fp32 — meshfit's policy — else in the parameters' dtype)."""
    total = 0
    for p in model.parameters():
        if p.requires_grad:
            total += p.numel() * max(p.element_size(), torch.float32.itemsize)
    return total


def available_memory_bytes(device: torch.device) -> int | None:
    """Free memory where `device` computes: CUDA's free bytes (`mem_get_info`); on the CPU
    the host's available memory (psutil, else /proc/meminfo); None when unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        import psutil  # optional (a test dependency, not meshfit's)

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    if hasattr(os, "sysconf"):
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            pass
    return None


def held_gradient_bytes(model: nn.Module) -> int:
    """Gradient bytes this rank holds now, FSDP2's hidden accumulation buffers included.

    `meshfit.memory.rank_report` counts ``p.grad`` of the parameters the module exposes;
    under `set_requires_gradient_sync(False)` FSDP2 keeps the accumulated *unsharded*
    gradients on its internal unsharded parameters, which that does not see. This reads
    them (FSDP2's internals: `meshfit._compat.fsdp.held_gradients`) plus the sharded
    gradients' local shards; each storage once. Plain (non-FSDP) parameters count their
    ``.grad``."""
    seen: set[tuple[str, int]] = set()
    total = 0

    def add(t: torch.Tensor | None) -> None:
        nonlocal total
        if t is None:
            return
        local = t.to_local() if hasattr(t, "to_local") else t
        key = (str(local.device), local.untyped_storage().data_ptr())
        if key not in seen and local.untyped_storage().nbytes():
            seen.add(key)
            total += local.untyped_storage().nbytes()

    managed: set[int] = set()
    for fp in fsdp_internals.fsdp_params(model):
        managed.add(id(fsdp_internals.sharded_parameter(fp)))
        for grad in fsdp_internals.held_gradients(fp):
            add(grad)
    for p in model.parameters():
        if id(p) not in managed:
            add(p.grad)
    return total
