"""The n-gram window bounds and how unset ones default (the rule vLLM applies, so configs carry over).

- neither ``prompt_lookup_min`` nor ``prompt_lookup_max`` set: both are 5;
- only one set: the other takes its value (a single fixed n-gram length);
- both set: used as given.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PROMPT_LOOKUP = 5


@dataclass(frozen=True)
class LookupBounds:
    """Inclusive range of n-gram lengths to match; the longest length that matches wins."""

    min_n: int
    max_n: int


def resolve_lookup_bounds(prompt_lookup_min: int | None, prompt_lookup_max: int | None) -> LookupBounds:
    """Fill unset bounds with vLLM's defaults. Range checks belong to the validation hook."""
    if prompt_lookup_min is None and prompt_lookup_max is None:
        return LookupBounds(DEFAULT_PROMPT_LOOKUP, DEFAULT_PROMPT_LOOKUP)
    if prompt_lookup_min is None:
        return LookupBounds(prompt_lookup_max, prompt_lookup_max)
    if prompt_lookup_max is None:
        return LookupBounds(prompt_lookup_min, prompt_lookup_min)
    return LookupBounds(prompt_lookup_min, prompt_lookup_max)
