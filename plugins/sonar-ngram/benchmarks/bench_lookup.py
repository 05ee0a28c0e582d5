"""Micro-benchmark of prompt lookup: milliseconds per request per step, batch of 64.

Columns:
  naive python     pure-Python scan of the token list (longest n first, most recent match first)
  numpy, reconvert find_draft after converting the whole token list to numpy every step
  ngram            NgramProposer.propose (incremental numpy buffer, one vectorised search per request)
  ngram_gpu (cpu)  NgramGPUProposer.propose with torch on the CPU (the batched device search)

Each step appends 1 to 3 tokens to every request, as accepted drafts would. Two workloads:
text-like (random tokens of a 32k vocabulary with copied spans; most steps find few candidates) and
low-entropy (a 64-token vocabulary, so every step has hundreds of candidate matches to extend).

Run: python plugins/sonar-ngram/benchmarks/bench_lookup.py [--steps 20] [--batch 64]
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

import numpy as np
import torch
from sonar_ngram.proposer import NgramGPUProposer, NgramProposer

from sonar_core.spec_decode.prompt_lookup import LookupBounds, find_draft
from sonar_core.spec_decode.proposer import ProposalRequest, ProposeBatch, Proposer

MIN_N, MAX_N, K = 2, 5, 5


def make_sequence(rng: random.Random, length: int, vocab: int) -> list[int]:
    tokens: list[int] = []
    while len(tokens) < length:
        if tokens and rng.random() < 0.1:
            start = rng.randrange(len(tokens))
            tokens.extend(tokens[start : start + rng.randint(4, 32)])
        else:
            tokens.append(rng.randrange(vocab))
    return tokens[:length]


def naive_draft(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == pattern:
                return tokens[start + n : start + n + k]
    return []


def run_steps(
    sequences: list[list[int]], vocab: int, steps: int, step_fn: Callable[[list[list[int]], list[int]], None]
) -> float:
    """Milliseconds per request per step; ``step_fn(sequences, num_new)`` drafts for the whole batch."""
    rng = random.Random(0)
    sequences = [list(s) for s in sequences]
    num_new = [len(s) for s in sequences]
    step_fn(sequences, num_new)  # first step converts whole prompts; not what a decode step costs
    elapsed = 0.0
    for _ in range(steps):
        num_new = []
        for sequence in sequences:
            added = rng.randint(1, 3)
            sequence.extend(rng.randrange(vocab) for _ in range(added))
            num_new.append(added)
        begin = time.perf_counter()
        step_fn(sequences, num_new)
        elapsed += time.perf_counter() - begin
    return 1000.0 * elapsed / (steps * len(sequences))


def proposer_step(proposer: Proposer) -> Callable[[list[list[int]], list[int]], None]:
    def step(sequences: list[list[int]], num_new: list[int]) -> None:
        requests = [
            ProposalRequest(
                request_id=str(i), token_ids=s, num_new_tokens=n, max_draft_tokens=K, block_table=[]
            )
            for i, (s, n) in enumerate(zip(sequences, num_new, strict=True))
        ]
        proposer.propose(
            ProposeBatch(
                requests=requests, block_size=16, kv_caches=[], device=torch.device("cpu")
            )
        )

    return step


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the ngram_gpu column")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bounds = LookupBounds(MIN_N, MAX_N)
    print(f"prompt lookup, n={MIN_N}..{MAX_N}, k={K}, batch {args.batch}, ms per request per step")
    header = (
        "workload",
        "length",
        "naive python",
        "numpy, reconvert",
        "ngram",
        "ngram_gpu (cpu)",
        "speed-up",
    )
    print(
        f"{header[0]:<12} {header[1]:>6} {header[2]:>13} {header[3]:>17} {header[4]:>8} {header[5]:>16} {header[6]:>9}"
    )
    for workload, vocab in (("text-like", 32000), ("low-entropy", 64)):
        for length in (512, 2048, 8192):
            rng = random.Random(length)
            sequences = [make_sequence(rng, length, vocab) for _ in range(args.batch)]
            naive = run_steps(
                sequences,
                vocab,
                max(2, args.steps // 5),
                lambda seqs, _: [naive_draft(s, MIN_N, MAX_N, K) for s in seqs],
            )
            reconvert = run_steps(
                sequences,
                vocab,
                args.steps,
                lambda seqs, _: [find_draft(np.asarray(s, dtype=np.int32), MIN_N, MAX_N, K)[0] for s in seqs],
            )
            host = run_steps(sequences, vocab, args.steps, proposer_step(NgramProposer(bounds)))
            device = run_steps(
                sequences,
                vocab,
                args.steps,
                proposer_step(NgramGPUProposer(bounds, K, max_model_len=16384, device=torch.device("cpu"))),
            )
            print(
                f"{workload:<12} {length:>6} {naive:>13.4f} {reconvert:>17.4f} {host:>8.4f} {device:>16.4f}"
                f" {naive / host:>8.0f}x"
            )


if __name__ == "__main__":
    main()
