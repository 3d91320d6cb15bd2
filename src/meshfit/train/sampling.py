"""The sampling settings of `meshfit generate` and `meshfit.train.generate.generate_ids`,
checked without torch (a bad one is refused before torch loads)."""

from __future__ import annotations

import math

__all__ = ["check_sampling"]


def check_sampling(max_new_tokens: int, temperature: float, top_k: int | None) -> None:
    """One-line ValueError naming the flag of a bad setting."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
            or max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens={max_new_tokens!r} must be an integer >= 0")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature)
            and temperature >= 0):
        raise ValueError(f"--temperature={temperature!r} must be a number >= 0 (0: greedy)")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise ValueError(f"--top-k={top_k!r} must be an integer >= 0 (0: no top-k cut)")
