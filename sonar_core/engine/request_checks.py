"""Whether a prompt can be served: the checks every engine front runs before it queues a request.

They need only the vocabulary size and the request length limit, so a front that does not hold
the model (the data-parallel server, which routes requests to replica processes) refuses a bad
request at once, with the same message an engine gives, instead of after a round trip.
"""

from __future__ import annotations

from sonar_core.engine.request_errors import RequestError
from sonar_core.sampling_params import SamplingParams


def check_request(token_ids: list[int], params: SamplingParams, *, vocab_size: int, max_model_len: int) -> None:
    """Raise :class:`RequestError` when the prompt is empty, holds an id outside the vocabulary,
    or leaves no room (or less than ``max_tokens``) under ``max_model_len``."""
    if not token_ids:
        raise RequestError("the prompt is empty; send at least one token")
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    budget = max_model_len - len(token_ids)
    if budget < 1:
        raise RequestError(
            f"the prompt has {len(token_ids)} tokens; this model's max_model_len is "
            f"{max_model_len}: shorten the prompt"
        )
    if params.max_tokens is not None and params.max_tokens > budget:
        raise RequestError(
            f"max_tokens={params.max_tokens} plus the prompt's {len(token_ids)} tokens exceeds "
            f"max_model_len={max_model_len}: lower max_tokens to at most {budget}"
        )
