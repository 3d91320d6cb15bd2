"""transformers' internals: the attention implementation a model runs.

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

Public replacement: ``set_attn_implementation`` itself, once meshfit's oldest supported
transformers has it (then the fallback goes); a public getter of the implementation, once
transformers has one (``is_flash_attention_requested`` answers only "flash or not").
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
                         ("transformers.PretrainedConfig._attn_implementation",))
