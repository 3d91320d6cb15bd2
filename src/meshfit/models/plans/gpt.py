"""Plans for meshfit's reference `GPT` (GELU or SwiGLU, learned or rotary positions, GQA,
tied or untied head; a pipeline stage too: modules it lacks are left out)."""

from __future__ import annotations

from meshfit.models.gpt import GPT
from meshfit.models.moe import MoE
from meshfit.models.plans.base import (REPLICATE, SHARD_FIRST, SHARD_LAST, SHARD_SEQ,
                                       PipelinePlan, Style, TPPlan, colwise, gather_sequence,
                                       prepare_input, replicate, replicate_local, rowwise,
                                       sequence)

__all__ = ["gpt_pipeline_plan", "gpt_plan"]


def head(loss_parallel: bool, **kw) -> Style:
    """The vocabulary-parallel output head: logits sharded on V for loss_parallel (kept as a
    DTensor for `tp_cross_entropy`), else gathered."""
    return colwise(output=SHARD_LAST if loss_parallel else REPLICATE,
                   local_output=not loss_parallel, **kw)


def gpt_plan(model: GPT, *, sequence_parallel: bool = False,
             loss_parallel: bool = False) -> TPPlan:
    """The residual stream is a local tensor, as in torchtitan: replicated [B, T, d], or
    [B, T/T_tp, d] under sequence parallel."""
    sp = sequence_parallel
    seq = SHARD_SEQ if sp else REPLICATE  # the residual stream between blocks
    styles = _embedding_styles(model, sp)
    mlp = {"w_in": "col", "w_out": "row"} if model.config.mlp == "gelu" else \
        {"w1": "col", "w3": "col", "w2": "row"}
    parts = (("attn", {"wq": "col", "wk": "col", "wv": "col", "wo": "row"}, "resid_drop"),
             ("mlp", mlp, "drop"))
    for part, linears, out_drop in parts if len(model.layers) else ():
        styles.update(_block_styles(model, part, linears, out_drop, sp))
    if model.norm is not None:
        styles["norm"] = sequence() if sp else replicate()
    if model.lm_head is not None:
        styles["lm_head"] = head(loss_parallel, input=seq)
    return TPPlan(styles=styles, divisible=_divisible(model.config), input_kwarg="idx",
                  targets_arg=(1, "targets"))


def _embedding_styles(model: GPT, sp: bool) -> dict[str, Style]:
    """The token and position embeddings (and the dropout after them, under SP)."""
    styles: dict[str, Style] = {}
    if model.tok_emb is not None:
        styles["tok_emb"] = rowwise(input=REPLICATE, output=SHARD_SEQ if sp else REPLICATE)
    if model.pos_emb is not None:
        # forward adds pos_emb(arange(T)) [T, d] to the embedding: under SP each rank takes
        # its rows, which are the positions of its sequence shard.
        styles["pos_emb"] = replicate(output=SHARD_FIRST if sp else REPLICATE)
    if sp and model.config.dropout > 0:
        styles["drop"] = sequence(local_output=True)
    return styles


def _block_styles(model: GPT, part: str, linears: dict[str, str], out_drop: str,
                  sp: bool) -> dict[str, Style]:
    """One part ("attn" or "mlp") of every block: its norm, its linears (colwise in,
    rowwise out), its output dropout under SP.

    A mixture-of-experts block's router and routed experts stay whole on every tp rank
    (replicate_local: their indexing cannot run on DTensors); every tp rank routes and
    computes the same tokens — under sequence parallel the block gathers the sequence on
    the way in and hands back its slice. Its shared expert is split as a dense MLP,
    all-reduced inside the block. Only the dense blocks' MLPs follow the pattern."""
    seq = SHARD_SEQ if sp else REPLICATE
    moe = [i for i, b in model.layers.items() if isinstance(b.mlp, MoE)]
    owners = ["*"] if part == "attn" or not moe else [i for i in model.layers if i not in moe]
    styles: dict[str, Style] = {f"layers.*.{part}_norm": sequence() if sp else replicate()}
    if sp:
        # attn(x, rope): x sequence-sharded -> all-gathered; rope tables pass through.
        ins = (SHARD_SEQ, None) if part == "attn" else (SHARD_SEQ,)
        outs = (REPLICATE, None) if part == "attn" else (REPLICATE,)
        for i in owners:
            styles[f"layers.{i}.{part}"] = prepare_input(input=ins, desired=outs)
    for name, kind in linears.items():
        for i in owners:
            styles[f"layers.{i}.{part}.{name}"] = colwise() if kind == "col" else \
                rowwise(output=seq)
    for i in moe if part == "mlp" else ():
        styles.update(_moe_styles(model, i, linears, sp))
    if sp and model.config.dropout > 0:
        for i in owners:
            styles[f"layers.{i}.{part}.{out_drop}"] = sequence(local_output=True)
    return styles


def _moe_styles(model: GPT, i: str, linears: dict[str, str], sp: bool) -> dict[str, Style]:
    """Block `i`'s mixture of experts (see `_block_styles`)."""
    styles: dict[str, Style] = {}
    if sp:
        styles[f"layers.{i}.mlp"] = gather_sequence(local_output=True)
    styles[f"layers.{i}.mlp.router"] = replicate_local()
    styles[f"layers.{i}.mlp.experts"] = replicate_local()
    if model.layers[i].mlp.shared is not None:
        for name, kind in linears.items():
            styles[f"layers.{i}.mlp.shared.{name}"] = colwise() if kind == "col" \
                else rowwise(output=REPLICATE)
    return styles


def _divisible(cfg) -> tuple[tuple[str, int, str], ...]:
    """The sizes the tp degree must divide: (field, value, what is split)."""
    divisible = [("GPTConfig.n_head", cfg.n_head, "heads")]
    if cfg.kv_heads != cfg.n_head:
        divisible.append(("GPTConfig.n_kv_head", cfg.kv_heads, "heads"))
    divisible += [("GPTConfig.d_model", cfg.d_model, "width"),
                  ("GPTConfig.d_ff", cfg.d_ff, "width"),
                  ("GPTConfig.vocab_size", cfg.vocab_size, "vocab")]
    return tuple(divisible)


def gpt_pipeline_plan(model: GPT) -> PipelinePlan:
    """Blocks in ``layers`` (a ModuleDict keyed by global index); embeddings first, final
    norm and head last. A stage is a `GPT` whose forward skips the parts set to None: it
    takes hidden states when it has no embedding and returns them when it has no head;
    `GPT.init_weights` fills a stage with exactly its slice of the full model's values."""
    return PipelinePlan(blocks="layers", first=("tok_emb", "pos_emb"),
                        last=("norm", "lm_head"), init_weights=GPT.init_weights)
