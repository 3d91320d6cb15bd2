"""Tensor-parallel styles meshfit adds to PyTorch's, and the translation of a plan's `Style`
data into PyTorch `ParallelStyle` objects.

    ReplicateParallel           parameters replicated, broadcast from the first rank
    ReplicateLocal              the same, the module computing on local tensors
    GatherInput                 a module's hidden-state input gathered from its sequence shard
    GatherSequence              a whole-sequence module under sequence parallel (MoE block)
    SequenceParallelBroadcast   torch's SequenceParallel, parameters broadcast too
    Conv1DColwiseParallel       column split of Hugging Face's transposed Conv1D (GPT-2),
                                with the fused q|k|v regrouping
    Conv1DRowwiseParallel       row split of the same
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, \
    distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, \
    PrepareModuleInputOutput, PrepareModuleOutput, RowwiseParallel, SequenceParallel

from meshfit._compat import nn as nn_internals
from meshfit._compat import tensor_parallel as tp_internals
from meshfit.models.plans.base import Style
from meshfit.models.plans.regroup import group_columns, mark_regrouped

__all__ = ["Conv1DColwiseParallel", "Conv1DRowwiseParallel", "GatherInput", "ReplicateLocal",
           "ReplicateParallel", "SequenceParallelBroadcast", "planned_placement",
           "to_torch_style"]


# ---------------------------------------------------------------------------- styles
class ReplicateParallel(tp_internals.Hooks, ParallelStyle):
    """Parameters replicated on the mesh (broadcast from the first rank) for modules that TP
    does not split: norms outside sequence parallel, learned position tables.

    The first input is taken as `input_layouts` (a plain tensor is wrapped, not moved) and
    replicated; the output is redistributed to `output_layouts` (e.g. Shard(0) hands each rank
    its slice of a position table under sequence parallel) and returned as a local tensor
    when `use_local_output`.
    """

    def __init__(self, *, input_layouts: Placement = Replicate(),
                 output_layouts: Placement = Replicate(), use_local_output: bool = True) -> None:
        self.input_layouts, self.output_layouts = (input_layouts,), (output_layouts,)
        self.use_local_output = use_local_output

    def _partition(self, name, module, mesh) -> None:
        for p_name, p in list(module.named_parameters(recurse=False)):
            _distribute(module, p_name, p, mesh, Replicate(), self.src_data_rank)

    def _prepare_input(self, module, inputs, mesh):
        x, *rest = inputs
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, self.input_layouts, run_check=False)
        return (x.redistribute(placements=(Replicate(),)), *rest)

    def _prepare_output(self, module, out, mesh):
        out = out.redistribute(placements=self.output_layouts)
        return out.to_local() if self.use_local_output else out

    def apply_to(self, module: nn.Module, device_mesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._partition, self._prepare_input,
                                 self._prepare_output)


def _distribute(module: nn.Module, name: str, p: torch.Tensor, mesh, placement: Placement,
                src_data_rank, full: torch.Tensor | None = None) -> None:
    """Replace parameter `name` of `module` by a DTensor of `full` (default: `p`) placed on
    `mesh` from `src_data_rank`, keeping `p`'s requires_grad."""
    module.register_parameter(name, nn.Parameter(
        distribute_tensor(p if full is None else full, mesh, [placement],
                          src_data_rank=src_data_rank), requires_grad=p.requires_grad))


def _own_parameters(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """`module`'s own parameters by name, a tensor registered under two names twice."""
    return list(module.named_parameters(recurse=False, remove_duplicate=False))


def _local(x):
    if isinstance(x, DTensor):
        return x.redistribute(placements=[Replicate()] * x.device_mesh.ndim).to_local()
    return x


class ReplicateLocal(tp_internals.Hooks, ParallelStyle):
    """Parameters replicated on the mesh (broadcast from the first rank, so `apply_tp` finds
    DTensors only), while each forward of the module sees their local tensors and plain
    inputs (a DTensor input is replicated first): for a module DTensor cannot run
    (data-dependent indexing: a mixture-of-experts router or experts), or a module kept
    whole on every rank (DeepSeek's latent attention). Every tp rank computes what one
    process would; gradients reach the DTensors through ``to_local``, equal on every rank.
    `output_layouts`: the module's (first) output, replicated on every rank, handed back as
    a DTensor with that placement (``Shard(1)``: each rank's sequence shard of it, under
    sequence parallel); None: as the module returns it."""

    def __init__(self, *, output_layouts: Placement | None = None) -> None:
        self.output_layouts = output_layouts

    def apply_to(self, module: nn.Module, device_mesh) -> nn.Module:
        for owner in module.modules():
            for name, p in _own_parameters(owner):
                if not isinstance(p, DTensor):
                    _distribute(owner, name, p, device_mesh, Replicate(), self.src_data_rank)
        held: list[list] = []  # a stack: one entry per call in flight (re-entrant)

        def swap_in(mod, args, kwargs):
            swapped = []
            for owner in mod.modules():
                for name, p in _own_parameters(owner):
                    if isinstance(p, DTensor):
                        nn_internals.put_parameter(owner, name, p.to_local())
                        swapped.append((owner, name, p))
            held.append(swapped)
            return tuple(_local(a) for a in args), {k: _local(v) for k, v in kwargs.items()}

        def swap_out(mod, args, kwargs, out):
            for owner, name, p in held.pop():
                nn_internals.put_parameter(owner, name, p)
            if self.output_layouts is not None:
                return _map_first(out, lambda t: DTensor.from_local(
                    t, device_mesh, (Replicate(),), run_check=False).redistribute(
                        placements=(self.output_layouts,)))
            return None

        module.register_forward_pre_hook(swap_in, with_kwargs=True)
        module.register_forward_hook(swap_out, with_kwargs=True, always_call=True)
        return module


def _map_first(out, fn):
    """`out` with `fn` applied to its tensor, or to the first element of a tuple (transformers'
    attention returns (output, weights))."""
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        return (fn(out[0]), *out[1:])
    return fn(out) if isinstance(out, torch.Tensor) else out


class GatherInput(tp_internals.Hooks, ParallelStyle):
    """No parameters: under sequence parallel, the module's hidden-state input -- its first
    positional argument, or its ``hidden_states`` keyword, whichever the caller used (a
    transformers decoder layer calls its attention by keyword, GPT-NeoX's positionally) --
    all-gathered from its sequence shard (``Shard(1)``) to a replicated DTensor; other
    arguments untouched. (torch's PrepareModuleInput needs the calling convention fixed in
    advance.)"""

    def apply_to(self, module: nn.Module, device_mesh) -> nn.Module:
        def gather(x):
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, (Shard(1),), run_check=False)
            return x.redistribute(placements=(Replicate(),))

        def hook(mod, args, kwargs):
            if args and isinstance(args[0], torch.Tensor):
                return (gather(args[0]), *args[1:]), kwargs
            if isinstance(kwargs.get("hidden_states"), torch.Tensor):
                return args, {**kwargs, "hidden_states": gather(kwargs["hidden_states"])}
            return None

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


class SequenceParallelBroadcast(tp_internals.SequenceParallelHooks):
    """torch's `SequenceParallel`, except that the replicated parameters are broadcast from
    the first rank instead of assumed equal (torch's assumes a norm's ones-init)."""

    def replicate_module(self, name, module, device_mesh) -> None:
        ReplicateParallel._partition(self, name, module, device_mesh)


def _is_conv1d(module: nn.Module) -> bool:
    # Hugging Face's transposed linear (GPT-2); only imported when such a model exists.
    pytorch_utils = sys.modules.get("transformers.pytorch_utils")
    return pytorch_utils is not None and isinstance(module, pytorch_utils.Conv1D)


class Conv1DColwiseParallel(tp_internals.Hooks, ColwiseParallel):
    """ColwiseParallel for Hugging Face's `Conv1D` (weight [in, out]: Shard(1); bias Shard(0)).
    `fused=3`: a fused q|k|v projection (GPT-2's `c_attn`), its columns regrouped rank-major
    first (`meshfit.models.plans.regroup`), so each rank receives q, k and v of its own heads
    and the module's `split(d / T)` works on the local output."""

    def __init__(self, *, fused: int = 1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fused = fused

    def _partition_conv1d(self, name, module, mesh) -> None:
        tp = mesh.size()
        for p_name, p in list(module.named_parameters(recurse=False)):
            dim = p.ndim - 1  # weight [in, out] -> out is dim 1; bias [out] -> dim 0
            with torch.no_grad():
                full = group_columns(p.detach(), self.fused, tp, dim)
            _distribute(module, p_name, p, mesh, Shard(dim), self.src_data_rank, full)
        if self.fused > 1:  # the parameters' global layout now depends on the TP degree
            mark_regrouped(module, self.fused, tp)

    def apply_to(self, module: nn.Module, device_mesh) -> nn.Module:
        if not _is_conv1d(module):
            raise ValueError(f"Conv1DColwiseParallel needs a transformers Conv1D, got "
                             f"{type(module).__name__}; use ColwiseParallel for nn.Linear")
        return _distribute_conv1d(self, module, device_mesh)


def _distribute_conv1d(style, module: nn.Module, device_mesh) -> nn.Module:
    return distribute_module(module, device_mesh, style._partition_conv1d,
                             tp_internals.input_hook(style), tp_internals.output_hook(style))


class Conv1DRowwiseParallel(tp_internals.Hooks, RowwiseParallel):
    """RowwiseParallel for Hugging Face's `Conv1D` (weight [in, out]: Shard(0); bias
    Replicate)."""

    def _partition_conv1d(self, name, module, mesh) -> None:
        for p_name, p in list(module.named_parameters(recurse=False)):
            placement = Shard(0) if p_name == "weight" else Replicate()
            _distribute(module, p_name, p, mesh, placement, self.src_data_rank)

    def apply_to(self, module: nn.Module, device_mesh) -> nn.Module:
        if not _is_conv1d(module):
            raise ValueError(f"Conv1DRowwiseParallel needs a transformers Conv1D, got "
                             f"{type(module).__name__}; use RowwiseParallel for nn.Linear")
        self.desired_input_layouts = (Shard(-1),)
        return _distribute_conv1d(self, module, device_mesh)


NO_PARAMS = (PrepareModuleInput, PrepareModuleOutput, GatherInput)


def planned_placement(style: ParallelStyle, module: nn.Module, p_name: str) -> Placement:
    """The placement `style` gives parameter `p_name` of `module` (checked before applying)."""
    weight = p_name == "weight"
    if isinstance(style, (ReplicateParallel, SequenceParallel, ReplicateLocal)):
        return Replicate()
    if isinstance(style, Conv1DColwiseParallel):
        return Shard(1) if weight else Shard(0)
    if isinstance(style, Conv1DRowwiseParallel):
        return Shard(0) if weight else Replicate()
    if isinstance(style, ColwiseParallel):
        return Shard(1) if isinstance(module, nn.Embedding) else Shard(0)
    if isinstance(style, RowwiseParallel):
        if isinstance(module, nn.Embedding):
            return Shard(0)
        return Shard(1) if weight else Replicate()
    raise ValueError(f"cannot tell how {type(style).__name__} lays out {p_name} of "
                     f"{type(module).__name__}; tied or unplanned parameters need a known style")


# ---------------------------------------------------------------------------- plan data
def _placement(text: str | None) -> Placement | None:
    if text is None:
        return None
    if text == "replicate":
        return Replicate()
    if text.startswith("shard(") and text.endswith(")"):
        return Shard(int(text[6:-1]))
    raise ValueError(f"placement {text!r} is not 'replicate' or 'shard(<dim>)'")


def _layouts(value):
    if isinstance(value, tuple):
        return tuple(_placement(v) for v in value)
    return _placement(value)


def _kwargs(value):
    return None if value is None else {k: _placement(v) for k, v in value.items()}


_SPLIT = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
          "conv1d_colwise": None, "conv1d_rowwise": None}


def to_torch_style(style) -> ParallelStyle:
    """The PyTorch `ParallelStyle` of a plan's `Style` (a `ParallelStyle` passes through)."""
    if isinstance(style, ParallelStyle):
        return style
    if not isinstance(style, Style):
        raise ValueError(f"a TP plan value must be a meshfit Style or a torch ParallelStyle, "
                         f"got {type(style).__name__}")
    kw = {}
    if style.local_output is not None:
        kw["use_local_output"] = style.local_output
    if style.kind in _SPLIT:
        if style.input is not None:
            kw["input_layouts"] = _layouts(style.input)
        if style.output is not None:
            kw["output_layouts"] = _layouts(style.output)
        if style.kind == "colwise":
            return ColwiseParallel(**kw)
        if style.kind == "rowwise":
            return RowwiseParallel(**kw)
        if style.kind == "conv1d_colwise":
            return Conv1DColwiseParallel(fused=style.fused, **kw)
        return Conv1DRowwiseParallel(**kw)
    if style.kind == "replicate":
        return ReplicateParallel(output_layouts=_placement(style.output or "replicate"),
                                 input_layouts=_placement(style.input or "replicate"), **kw)
    if style.kind == "sequence":
        # input "shard(2)": a per-head norm on [B, T, heads, head_dim] (Qwen3's q/k norms)
        dim = _placement(style.input).dim if style.input else 1
        return SequenceParallelBroadcast(sequence_dim=dim, **kw)
    if style.kind == "replicate_local":
        return ReplicateLocal(output_layouts=_placement(style.output))
    if style.kind == "gather_input":
        return GatherInput()
    if style.kind == "gather_sequence":
        return PrepareModuleInputOutput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
            use_local_input=True, output_layouts=(Replicate(),),
            desired_output_layouts=(Shard(1),),
            use_local_output=bool(style.local_output))
    if style.kind == "prepare_input":
        return PrepareModuleInput(input_layouts=_layouts(style.input),
                                  desired_input_layouts=_layouts(style.desired),
                                  input_kwarg_layouts=_kwargs(style.input_kwargs),
                                  desired_input_kwarg_layouts=_kwargs(style.desired_kwargs))
    raise ValueError(f"Style kind {style.kind!r} is unknown")
