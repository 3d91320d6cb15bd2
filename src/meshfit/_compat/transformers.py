"""transformers' internals: the attention implementation a model runs.

Context parallel (`meshfit.parallel.cp`) registers its ring attention in transformers'
attention interface (public) and makes the model use it. ``PreTrainedModel.
set_attn_implementation`` (public) does that on the transformers releases that have it; on
earlier ones the model's config is written directly, ``config._attn_implementation``, which
every attention layer reads.

Public replacement: ``set_attn_implementation`` itself, once meshfit's oldest supported
transformers has it (then the fallback goes).
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


def missing() -> list[str]:
    try:
        import transformers
    except ImportError:
        return []  # (an optional dependency: nothing here is reached without it)
    if hasattr(transformers.PreTrainedModel, "set_attn_implementation"):
        return []
    return _probe.absent("transformers",
                         ("transformers.PretrainedConfig._attn_implementation",))
