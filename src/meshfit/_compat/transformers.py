"""transformers' internals: the attention implementation a model runs, and the Trainer
methods the Trainer bridge overrides.

Context parallel (`meshfit.parallel.cp`) registers its ring attention in transformers'
attention interface (public) and makes the model use it. ``PreTrainedModel.
set_attn_implementation`` (public) does that on the transformers releases that have it; on
earlier ones the model's config is written directly, ``config._attn_implementation``, which
every attention layer reads.

Packed rows (`meshfit.models.packing`) give the model its documents in the form its
attention implementation takes (a boolean mask for SDPA, an additive one for eager, the
positions alone for flash), so they read which implementation that is: the config's
``_attn_implementation``, what transformers itself reads (``is_flash_attention_requested``
too). transformers has no public getter for it.

The Trainer bridge (`meshfit.transformers`) subclasses transformers' ``Trainer`` and
overrides four of its private methods -- ``_save`` (the weights gathered from a sharded
layout), ``_save_optimizer_and_scheduler`` / ``_load_optimizer_and_scheduler`` (the optimizer
state as meshfit's sharded checkpoint) and ``_load_best_model`` -- and runs transformers' loop
with the module's ``Accelerator`` and ``skip_first_batches`` names pointing at meshfit's:
there are no public hooks for either. `missing` probes each, so a transformers release that
renames one fails this package's check instead of silently skipping an override. Public
replacement: a Trainer argument taking an accelerator (or a checkpoint-IO hook), once
transformers has one.

For the attention implementation, the public replacement: ``set_attn_implementation``
itself, once meshfit's oldest supported transformers has it (then the fallback goes); a
public getter of the implementation, once transformers has one
(``is_flash_attention_requested`` answers only "flash or not").
"""

from __future__ import annotations

from meshfit._compat import _probe


def set_attention(model, name: str) -> None:
    """Make `model` (a ``PreTrainedModel``, its sub-models included) run the attention
    implementation registered as `name`."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name


def attention_implementation(model) -> str | None:
    """The name of the attention implementation `model` (a ``PreTrainedModel``) runs:
    "sdpa", "eager", "flash_attention_2", "flex_attention", a registered one...; None when
    it has no config or the config names none (transformers then runs its default)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def missing() -> list[str]:
    try:
        import transformers
    except ImportError:
        return []  # (an optional dependency: nothing here is reached without it)
    return _probe.absent("transformers",
                         ("transformers.PretrainedConfig._attn_implementation",
                          "transformers.Trainer._save",
                          "transformers.Trainer._save_optimizer_and_scheduler",
                          "transformers.Trainer._load_optimizer_and_scheduler",
                          "transformers.Trainer._load_best_model",
                          "transformers.trainer.Accelerator",
                          "transformers.trainer.skip_first_batches"))
