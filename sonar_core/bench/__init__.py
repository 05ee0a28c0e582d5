"""``aphrodite bench``: the seven figures the documentation asks users to measure (time to first
token, inter-token latency, end-to-end latency, request throughput at a concurrency, memory, mean
acceptance length, per-position acceptance rate), with speculation off and on, side by side with
peer engines on the same prompts.

One job per module: :mod:`workloads` (the shipped prompt sets), :mod:`rows` (what each row runs),
:mod:`launcher` (a row in its own process), :mod:`offline` and :mod:`http_runner` (the two ways of
driving requests), :mod:`figures` (numbers from timings), :mod:`report` and :mod:`chart`
(tables, JSON, PNG), :mod:`suite` (a saved list of runs, such as the one behind
docs/performance.md). Workers and peers live in :mod:`sonar_core.bench.peers`.
"""
