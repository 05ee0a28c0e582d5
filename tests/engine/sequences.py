"""Requests made by hand, for tests that drive engine parts without a model."""

from __future__ import annotations

from sonar_core.engine.detokenizer import IncrementalDetokenizer
from sonar_core.engine.sequence import Sequence
from sonar_core.outputs import RequestMetrics
from sonar_core.sampling_params import SamplingParams


class _Letters:
    """A tokenizer stand-in: token i decodes to a letter."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def make_sequence(request_id: str, prompt: list[int]) -> Sequence:
    """A waiting request with default sampling parameters and ``prompt`` as its tokens."""
    return Sequence(
        request_id=request_id, prompt=None, prompt_token_ids=list(prompt), params=SamplingParams(),
        metrics=RequestMetrics(arrival_time=0.0), detokenizer=IncrementalDetokenizer(_Letters(), prompt),
        generator=None, eos_token_ids=frozenset(),
    )
