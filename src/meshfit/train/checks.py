"""The value checks of a run's config sections (`meshfit.train.config`) and of `meshfit
generate`'s sampling flags, and how `meshfit train`'s errors spell the layout's fields
(`meshfit.train.preflight` names them too). No torch: a bad value is refused before torch
loads. Each check raises a one-line ValueError naming the key (or flag), the value and what
it must be.
"""

from __future__ import annotations

import math
from typing import Any

from meshfit.distributed.dims import AXES

# The layout's fields as `meshfit train`'s errors spell them (see `meshfit.parallel.layout`).
LAYOUT_NAMES = {
    **{k: f"parallel.{k}" for k in (*AXES, "zero_stage", "offload", "sync_each_batch",
                                     "sequence_parallel", "loss_parallel", "schedule",
                                     "microbatches", "virtual_stages")},
    "parallel": "parallel", "mixed_precision": "train.mixed_precision",
    "find_batch_size": "train.find_batch_size", "seq_len": "train.seq_len"}


def check_positive(section: str, name: str, value: Any, *, allow_zero: bool = False) -> None:
    """An integer >= 1 (>= 0 with `allow_zero`; True and False are not integers here)."""
    ok = isinstance(value, int) and not isinstance(value, bool) and (
        value >= 0 if allow_zero else value >= 1)
    if not ok:
        bound = ">= 0" if allow_zero else ">= 1"
        raise ValueError(f"{section}.{name}={value!r} must be an integer {bound}")


def check_number(section: str, name: str, value: Any, lo: float, hi: float) -> None:
    """A number in [lo, hi] (not NaN, not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            lo <= value <= hi) or math.isnan(value):
        raise ValueError(f"{section}.{name}={value!r} must be a number in [{lo}, {hi}]")


def check_choice(section: str, name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{section}.{name}={value!r} is not one of {', '.join(choices)}")


def check_bool(section: str, name: str, value: Any) -> None:
    """true or false (TOML's booleans, not 0 and 1)."""
    if not isinstance(value, bool):
        raise ValueError(f"{section}.{name}={value!r} must be true or false")


def check_sampling(max_new_tokens: int, temperature: float, top_k: int | None) -> None:
    """`meshfit generate`'s and `meshfit.train.generate.generate_ids`' settings."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
            or max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens={max_new_tokens!r} must be an integer >= 0")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature)
            and temperature >= 0):
        raise ValueError(f"--temperature={temperature!r} must be a number >= 0 (0: greedy)")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise ValueError(f"--top-k={top_k!r} must be an integer >= 0 (0: no top-k cut)")
