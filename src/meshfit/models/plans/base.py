"""The two kinds of plan, as plain data a model can state without any parallel code.

- `TPPlan`: module-name pattern -> `Style` (how tensor parallel splits that module), plus the
  sizes the TP degree must divide and the attributes holding per-rank head counts;
  `meshfit.parallel.tp` turns each `Style` into PyTorch's `ParallelStyle`.
- `PipelinePlan`: where the transformer blocks are, what comes before them (first stage
  only) and after them (last stage only), what a stage puts in place of what it drops, and
  how a stage runs; `meshfit.parallel.pp` cuts stages from it.

Placements are written as strings: ``"replicate"``, ``"shard(0)"``, ``"shard(1)"``,
``"shard(-1)"``; a tuple gives one per positional input (None for a non-tensor argument).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal, Union

import torch
from torch import nn

__all__ = ["PipelinePlan", "Style", "TPPlan", "colwise", "divisibility_problem",
           "gather_input", "gather_sequence", "prepare_input", "replicate", "replicate_local",
           "rowwise", "sequence"]

Placement = str  # "replicate" | "shard(<dim>)"
Layouts = Union[Placement, tuple[Union[Placement, None], ...], None]
StyleKind = Literal["colwise", "rowwise", "replicate", "sequence", "prepare_input",
                    "conv1d_colwise", "conv1d_rowwise", "replicate_local", "gather_sequence",
                    "gather_input"]
REPLICATE, SHARD_SEQ, SHARD_FIRST, SHARD_LAST = "replicate", "shard(1)", "shard(0)", "shard(-1)"


@dataclass(frozen=True, kw_only=True)
class Style:
    """How tensor parallel treats one module (Megatron-LM, Shoeybi et al. 2019):

    - ``colwise``: a linear's output features split (embedding: its width); input replicated.
    - ``rowwise``: a linear's input features split, output all-reduced (or reduce-scattered
      to ``output="shard(1)"`` under sequence parallel); an embedding's vocabulary split.
    - ``replicate``: parameters replicated (norms, position tables), the output redistributed
      to `output`.
    - ``sequence``: a norm or dropout on a sequence shard (Korthikanti et al. 2022);
      ``input="shard(2)"``: a norm on a shard of dim 2 instead, the heads of [B, T, H, hd]
      (Qwen3's per-head q/k norms after a column-parallel q/k: each rank normalises its own
      heads, the weight's gradient is summed over the ranks).
    - ``prepare_input``: no parameters; the module's inputs redistributed from `input` to
      `desired` (e.g. the sequence all-gather before attention).
    - ``conv1d_colwise`` / ``conv1d_rowwise``: the same for Hugging Face's transposed
      `Conv1D` (GPT-2); `fused=3` for a fused q|k|v projection.
    - ``replicate_local``: parameters replicated, but the module computes on their local
      tensors and plain inputs (a mixture-of-experts router or experts module, whose
      data-dependent indexing DTensor cannot run); every tp rank computes the same.
      ``output="shard(1)"``: its output handed back as each rank's sequence shard (a whole
      attention kept replicated under sequence parallel).
    - ``gather_input``: no parameters; under sequence parallel the module's hidden-state
      input (first positional argument or ``hidden_states`` keyword) all-gathered.
    - ``gather_sequence``: no parameters; under sequence parallel a module that needs the
      whole sequence (a mixture-of-experts block) gets its sequence-sharded input gathered
      as a plain tensor and hands back its slice of the output (`local_output`: plain or
      DTensor); backward all-gathers the output's gradient, so every rank's replicated
      parameters get the same gradient.

    Unset fields take PyTorch's defaults for the style."""

    kind: StyleKind
    input: Layouts = None
    """Layout of the (first) input as it arrives."""
    output: Placement | None = None
    """Layout of the output as it leaves."""
    local_output: bool | None = None
    """Return plain local tensors (True) or DTensors (False) from the module."""
    desired: Layouts = None
    """prepare_input: the layouts the module's forward needs."""
    input_kwargs: Mapping[str, Placement] | None = None
    """prepare_input: layouts of keyword inputs as they arrive."""
    desired_kwargs: Mapping[str, Placement] | None = None
    """prepare_input: the layouts the module needs for those keywords."""
    fused: int = 1
    """conv1d_colwise: number of projections fused along the output columns (q|k|v: 3)."""


def _maker(kind: str) -> Callable[..., Style]:
    """``maker(**fields)`` = ``Style(kind=kind, **fields)``, named after `kind`."""

    def make(**kw) -> Style:
        return Style(kind=kind, **kw)

    make.__name__ = make.__qualname__ = kind
    return make


(colwise, rowwise, replicate, replicate_local, gather_sequence, sequence, prepare_input,
 gather_input) = map(_maker, ("colwise", "rowwise", "replicate", "replicate_local",
                              "gather_sequence", "sequence", "prepare_input", "gather_input"))


@dataclass(frozen=True, kw_only=True)
class TPPlan:
    """A tensor-parallel plan and the facts `apply_tp` checks before applying it."""

    styles: Mapping[str, object]
    """Module-name pattern ("layers.*.attn.wq", fnmatch per dotted atom) -> `Style` (or a
    PyTorch `ParallelStyle`), applied in order by `parallelize_module`."""
    divisible: tuple[tuple[str, int, str], ...] = ()
    """(field, size, kind) that must divide by the TP degree; kind is "heads", "width" or
    "vocab" and picks the advice in the error."""
    local_attrs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Module pattern -> attributes holding a global head count or width that the module's
    forward uses; `apply_tp` divides them by the TP degree (absent attributes are skipped)."""
    input_kwarg: str = "input_ids"
    """Keyword of the token ids (else the first positional argument): checked under sequence
    parallel for a length that divides by the TP degree."""
    targets_arg: tuple[int, str] | None = None
    """(position, keyword) of the argument from which the model computes its own mean
    cross-entropy on its logits as returned (GPT's `targets`); under loss_parallel,
    `apply_tp` computes that loss with `tp_cross_entropy` instead."""
    labels_kwarg: str | None = None
    """Keyword of a loss argument that cannot work on vocabulary-sharded logits (HF's
    `labels`, shifted inside the model); refused with advice under loss_parallel."""

    def check_divisible(self, tp: int) -> None:
        """One-line ValueError listing every size that does not divide by `tp`, with a fix."""
        problem = divisibility_problem(self.divisible, tp)
        if problem:
            raise ValueError(problem)


def divisibility_problem(divisible, tp: int) -> str | None:
    """The message for every (field, size, kind) of `divisible` that `tp` does not divide
    (None when all do): each rank holds whole heads and equal slices of widths and
    vocabulary."""
    problems = [_advice(name, size, kind, tp) for name, size, kind in divisible if size % tp]
    if problems:
        return f"tensor parallel tp={tp} does not fit the model: " + "; ".join(problems)
    return None


def _advice(name: str, size: int, kind: str, tp: int) -> str:
    up = -(-size // tp) * tp
    if kind == "vocab":
        m = math.lcm(64, tp)  # 64: tensor-core friendly, as nanoGPT's 50304
        return (f"{name}={size} does not divide by tp={tp}; pad it to {up} "
                f"(or {-(-size // m) * m} for tensor cores)")
    if kind == "heads":
        divisors = [d for d in range(2, size + 1) if size % d == 0]
        return (f"{name}={size} does not divide by tp={tp} (each rank holds whole heads); use "
                f"tp in {divisors or [1]} or a model with {name.rsplit('.', 1)[-1]}={up}")
    return f"{name}={size} does not divide by tp={tp}; pad it to {up}"


@dataclass(frozen=True, kw_only=True)
class PipelinePlan:
    """Where a model's pipeline stages can be cut (GPipe, Huang et al. 2019): between its
    transformer blocks, with the parts before the blocks on the first stage and the parts
    after them on the last. Parameter names stay those of the full model on every stage."""

    blocks: str
    """Dotted path of the `ModuleList` / `ModuleDict` of transformer blocks."""
    first: tuple[str, ...] = ()
    """Modules only the first stage keeps (token and position embeddings)."""
    last: tuple[str, ...] = ()
    """Modules only the last stage keeps (final norm, output head)."""
    stand_ins: Mapping[str, Callable[[], nn.Module]] = field(default_factory=dict)
    """What a stage puts in place of a `first`/`last` module it does not keep, by path;
    absent: None, for a forward that skips missing modules (the reference GPT's)."""
    forward: Callable[[Callable, torch.Tensor], torch.Tensor] | None = None
    """``forward(model_forward, x)``: how a stage runs on its input (token ids on the first
    stage, hidden states [B, T, d] after it) through the model's own forward, returning hidden
    states or, on the last stage, logits; None: the model's forward takes `x` as it is."""
    init_weights: Callable[[nn.Module, torch.Generator], None] | None = None
    """Fills a stage built on the meta device with exactly the full model's values for its
    slice (for a meta-device model); None: such models are refused."""

    def blocks_of(self, model: nn.Module) -> nn.Module:
        """The block container of `model`; ValueError naming the path when it has none."""
        try:
            blocks = model.get_submodule(self.blocks)
        except AttributeError:
            blocks = None
        if not isinstance(blocks, (nn.ModuleList, nn.ModuleDict)):
            raise ValueError(f"{type(model).__name__} has no ModuleList/ModuleDict at "
                             f"{self.blocks!r}, where its pipeline plan puts the blocks; pass "
                             "a PipelinePlan(blocks=..., first=..., last=...) that matches it")
        return blocks
