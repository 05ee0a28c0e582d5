"""Appending sampled tokens to a request and deciding when it stops."""

from __future__ import annotations

from sonar_core.engine.sequence import Sequence


def apply_stop_conditions(seq: Sequence, tokens: list[int]) -> list[int]:
    """Append ``tokens`` one by one until a stop condition fires; return the tokens kept.

    Verification can emit several tokens in one step; a stop (EOS, a stop token, max_tokens or a
    stop string) in the middle discards the rest, so output with speculation ends exactly where it
    would without it.
    """
    params = seq.params
    kept: list[int] = []
    for token in tokens:
        seq.output_token_ids.append(token)
        kept.append(token)
        text_before = len(seq.detokenizer.text)
        seq.detokenizer.append([token])
        num_out = len(seq.output_token_ids)
        may_stop = num_out >= params.min_tokens
        if may_stop and not params.ignore_eos and token in seq.eos_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", None
        elif may_stop and token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif may_stop and params.stop and _truncate_at_stop_string(seq, text_before):
            seq.finish_reason = "stop"
        elif params.max_tokens is not None and num_out >= params.max_tokens:
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            break
    return kept


def _truncate_at_stop_string(seq: Sequence, text_before: int) -> bool:
    """Cut the text at the earliest stop string that the newest text completed; True if found."""
    text = seq.detokenizer.text
    longest = max(len(s) for s in seq.params.stop)
    # A stop string completed now must end inside the new text, so it starts after this point.
    search_from = max(0, text_before - longest + 1)
    found = [(index, stop) for stop in seq.params.stop if (index := text.find(stop, search_from)) != -1]
    if not found:
        return False
    index, stop = min(found)
    end = index + len(stop) if seq.params.include_stop_str_in_output else index
    seq.detokenizer.text = text[:end]
    seq.stop_reason = stop
    return True
