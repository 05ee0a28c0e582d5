"""The options of the ``suffix`` method: vLLM's names and defaults, so configurations carry over.

They sit at the top level of the speculative configuration, next to the core fields::

    {"method": "suffix", "num_speculative_tokens": 32,
     "suffix_decoding_max_tree_depth": 24, "suffix_decoding_min_token_prob": 0.1}

Core hands the keys it does not know to :class:`SuffixOptions`; an unknown key or a value out of
range is a ``ConfigError`` naming the key, what is wrong and what to write instead.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, field_validator

from sonar_core.errors import ConfigError

# The suffix tree numbers cached responses with non-negative int32 ids (arctic-inference refuses more).
MAX_CACHED_REQUESTS_LIMIT = 0x7FFFFFFF


class SuffixOptions(BaseModel):
    """Suffix decoding's own options. Values are strict: ``true`` is not a depth, ``"24"`` is not a number."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, use_attribute_docstrings=True)

    suffix_decoding_max_tree_depth: int = 24
    """Longest token sequence the prompt and response trees hold. It bounds the context match
    plus the draft, so drafts never exceed ``max_tree_depth - 1`` tokens; deeper trees use more
    memory per cached token."""

    suffix_decoding_max_cached_requests: int = 10000
    """How many responses the shared tree keeps, those of requests in flight included; beyond it
    the oldest is evicted first. 0 disables learning across requests (each request drafts from
    its own prompt and output only)."""

    suffix_decoding_max_spec_factor: float = 1.0
    """Drafts are at most ``max_spec_factor * match_length`` tokens long, where ``match_length``
    is how many of the latest tokens the trees matched: a short, weak match drafts little."""

    suffix_decoding_min_token_prob: float = 0.1
    """A draft stops at the first token whose estimated probability (frequency of that
    continuation in the trees, multiplied along the draft) falls below this value."""

    @field_validator("suffix_decoding_max_tree_depth")
    @classmethod
    def _depth_is_positive(cls, value: int) -> int:
        if value < 1:
            raise ConfigError(
                "suffix_decoding_max_tree_depth",
                f"the suffix trees need a depth of at least 1 token, got {value}",
                "set suffix_decoding_max_tree_depth to 1 or more (default 24), or remove it",
            )
        return value

    @field_validator("suffix_decoding_max_cached_requests")
    @classmethod
    def _cache_size_in_range(cls, value: int) -> int:
        if value < 0:
            raise ConfigError(
                "suffix_decoding_max_cached_requests",
                f"the number of cached responses cannot be negative, got {value}",
                "set suffix_decoding_max_cached_requests to 0 (learn from no earlier response) or more "
                "(default 10000), or remove it",
            )
        if value > MAX_CACHED_REQUESTS_LIMIT:
            raise ConfigError(
                "suffix_decoding_max_cached_requests",
                f"{value} cached responses is more than the suffix tree can number "
                f"({MAX_CACHED_REQUESTS_LIMIT})",
                f"set suffix_decoding_max_cached_requests to at most {MAX_CACHED_REQUESTS_LIMIT}",
            )
        return value

    @field_validator("suffix_decoding_max_spec_factor")
    @classmethod
    def _factor_not_negative(cls, value: float) -> float:
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(
                "suffix_decoding_max_spec_factor",
                f"the speculation factor must be a finite number of 0 or more, got {value}",
                "set suffix_decoding_max_spec_factor to a number such as 1.0 (the default; a draft is "
                "then at most as long as the matched context), or remove it",
            )
        return value

    @field_validator("suffix_decoding_min_token_prob")
    @classmethod
    def _probability_in_unit_range(cls, value: float) -> float:
        if not 0.0 <= value <= 1.0:
            raise ConfigError(
                "suffix_decoding_min_token_prob",
                f"a probability must lie between 0 and 1, got {value}",
                "set suffix_decoding_min_token_prob between 0.0 (draft every continuation) and 1.0 "
                "(draft only continuations never contradicted), default 0.1, or remove it",
            )
        return value
