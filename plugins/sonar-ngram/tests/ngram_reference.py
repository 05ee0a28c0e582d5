"""A deliberately plain statement of the prompt-lookup rule, and random repetitive sequences to test it on."""

from __future__ import annotations

import random


def reference_draft(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Longest n first; the most recent earlier occurrence (ending before the last token); k tokens after it."""
    if k <= 0:
        return []
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        pattern = tokens[length - n :] if n <= length else None
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == pattern:
                # Copy what follows, continuing from the copy itself past the end (LZ77-style).
                extended = list(tokens)
                for i in range(k):
                    extended.append(extended[start + n + i])
                return extended[length:]
    return []


def repetitive_sequence(rng: random.Random, length: int) -> list[int]:
    """Tokens from a small vocabulary with copied spans and periodic runs, so matches of every length occur."""
    vocab = rng.choice([2, 3, 5, 20])
    tokens: list[int] = []
    while len(tokens) < length:
        roll = rng.random()
        if tokens and roll < 0.4:
            start = rng.randrange(len(tokens))
            tokens.extend(tokens[start : start + rng.randint(1, 12)])
        elif roll < 0.55:
            period = [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
            tokens.extend(period * rng.randint(1, 5))
        else:
            tokens.append(rng.randrange(vocab))
    return tokens[:length]
