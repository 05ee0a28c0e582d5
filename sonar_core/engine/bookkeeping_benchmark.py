"""Host time of the engine's per-step bookkeeping, without a model: what a step costs on top of the
forward pass as a request's output grows.

Each step runs, for every request of the batch, what :meth:`LLMEngine.step` does after the target
sampled one token: :meth:`LLMEngine._update` (stop conditions, detokenization, logprobs), then
:meth:`LLMEngine._output`, and the model runner's read of the request's newest token
(``all_token_ids[start:end]``). The tokens are a fixed text's, cycled; the logprobs random.

    python -m sonar_core.engine.bookkeeping_benchmark                      # this checkout
    python -m sonar_core.engine.bookkeeping_benchmark --baseline /tmp/old  # next to another one

``--baseline`` names a source tree of Sonar (e.g. ``git worktree add /tmp/old <commit>``): the same
measurements run there in a subprocess, through the engine methods of that tree, and the table
shows both. The default tokenizer is the embedded model's (SmolLM2, read from its GGUF file).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from sonar_core.cpu_features import cpu_model

TEXT = (
    "The engine schedules requests, runs the model over their new tokens, samples, and then does "
    "its bookkeeping: stop conditions, detokenization, outputs. Café, naïve, déjà vu; 日本語; 😀🎉. "
    "def add(a, b):\n    return a + b\n"
)


def load_tokenizer(path: str | None) -> Any:
    if path is not None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    from sonar_core.model_files import default_model_path
    from sonar_core.models.gguf import gguf_tokenizer

    return gguf_tokenizer(default_model_path())


def measure(tokenizer: Any, length: int, batch: int, logprobs: bool, seed: int = 0) -> dict[str, float]:
    """Run ``batch`` requests to ``length`` output tokens; per-step host seconds (mean over the
    run, and mean over its last tenth)."""
    from sonar_core.engine.detokenizer import IncrementalDetokenizer
    from sonar_core.engine.llm_engine import LLMEngine
    from sonar_core.engine.sequence import Sequence
    from sonar_core.outputs import RequestMetrics
    from sonar_core.sampling_params import SamplingParams
    from sonar_core.spec_decode.metrics import SpecDecodingStats

    engine = LLMEngine.__new__(LLMEngine)  # the bookkeeping methods only, no model
    engine.spec_stats = SpecDecodingStats(num_speculative_tokens=0)
    engine.speculator = None
    stream = tokenizer.encode(TEXT, add_special_tokens=False)
    prompt = stream[:32]
    params = SamplingParams(max_tokens=length, ignore_eos=True, logprobs=0 if logprobs else None)
    seqs = [
        Sequence(
            request_id=str(i), prompt=None, prompt_token_ids=list(prompt), params=params,
            metrics=RequestMetrics(arrival_time=time.monotonic()),
            detokenizer=IncrementalDetokenizer(tokenizer, prompt), generator=None, eos_token_ids=frozenset(),
        )
        for i in range(batch)
    ]
    rng = random.Random(seed)
    sched = SimpleNamespace(
        scheduled=[SimpleNamespace(seq=seq, num_new_tokens=1, samples=True, draft_token_ids=[], draft_branches=[]) for seq in seqs]
    )
    accepted = [0] * batch
    times = []
    gc.collect()
    for step in range(length):
        token = stream[(32 + step) % len(stream)]
        emitted = [[token] for _ in seqs]
        step_logprobs = [[-rng.expovariate(1.0)] for _ in seqs] if logprobs else [None] * batch
        start = time.perf_counter()
        updates = engine._update(sched, emitted, accepted, step_logprobs)
        outputs = [engine._output(seq, kept, delta) for seq, kept, delta in updates]
        for seq in seqs:
            position = seq.num_tokens - 1
            seq.all_token_ids[position : position + 1]
        times.append(time.perf_counter() - start)
        assert len(outputs) == batch
    assert all(seq.finish_reason == "length" for seq in seqs)
    tail = times[-max(1, length // 10) :]
    return {"mean_s": statistics.fmean(times), "tail_s": statistics.fmean(tail)}


def decodes_per_token(tokenizer: Any, length: int = 1000) -> float:
    """How many times the detokenizer decodes per token, over ``length`` tokens of the text."""
    from sonar_core.engine.detokenizer import IncrementalDetokenizer

    count = [0]

    def decode(ids: Any, **kwargs: Any) -> str:
        count[0] += 1
        return tokenizer.decode(ids, **kwargs)

    stream = tokenizer.encode(TEXT, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(SimpleNamespace(decode=decode), stream[:32])
    for step in range(length):
        detokenizer.append([stream[(32 + step) % len(stream)]])
    return count[0] / length


def run_all(tokenizer_path: str | None, lengths: list[int], batch: int, repeats: int) -> dict[str, Any]:
    import sonar_core

    tokenizer = load_tokenizer(tokenizer_path)
    rows = []
    for logprobs in (False, True):
        for length in lengths:
            runs = [measure(tokenizer, length, batch, logprobs, seed=r) for r in range(repeats)]
            best = min(runs, key=lambda run: run["mean_s"])  # the least disturbed run
            rows.append({"logprobs": logprobs, "length": length, **best})
    return {
        "sonar_core": str(Path(sonar_core.__file__).parent),
        "rows": rows,
        "decodes_per_token": decodes_per_token(tokenizer),
    }


def _baseline(tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The same measurements through the Sonar source tree ``tree``, in a subprocess."""
    argv = ["--json", "--batch", str(args.batch), "--repeats", str(args.repeats), "--lengths",
            ",".join(map(str, args.lengths))]
    if args.tokenizer:
        argv += ["--tokenizer", args.tokenizer]
    code = (
        "import runpy, sys; sys.path.insert(0, sys.argv[1]); sys.argv = [sys.argv[2], *sys.argv[3:]]; "
        "runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tree), __file__, *argv], check=True, capture_output=True, text=True
    ).stdout
    result = json.loads(out.strip().splitlines()[-1])
    if Path(result["sonar_core"]).resolve() != (tree / "sonar_core").resolve():
        raise SystemExit(f"the baseline ran {result['sonar_core']}, not {tree / 'sonar_core'}")
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[100, 1000, 4000])
    parser.add_argument("--batch", type=int, default=8, help="requests in every step")
    parser.add_argument("--repeats", type=int, default=3, help="runs per cell; the fastest counts")
    parser.add_argument("--tokenizer", help="a tokenizer folder (default: the embedded model's)")
    parser.add_argument("--baseline", type=Path, help="a Sonar source tree to measure next to this one")
    parser.add_argument("--json", action="store_true", help="print the measurements as JSON")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()[0]
    baseline = _baseline(args.baseline, args) if args.baseline else None
    current = run_all(args.tokenizer, args.lengths, args.batch, args.repeats)
    if args.json:
        print(json.dumps(current))
        return
    print(f"CPU: {cpu_model()}; Python {platform.python_version()}; 1-minute load {load_before:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after; batch {args.batch}, fastest of {args.repeats} runs")
    print()
    if baseline is None:
        print("| logprobs | output tokens | µs/step (mean) | µs/step (last 10%) |")
        print("|---|---|---|---|")
        for row in current["rows"]:
            print(f"| {'yes' if row['logprobs'] else 'no'} | {row['length']:,} | {row['mean_s'] * 1e6:.0f} | "
                  f"{row['tail_s'] * 1e6:.0f} |")
        print(f"\nDetokenizer decodes per token: {current['decodes_per_token']:.2f}")
        return
    print("| logprobs | output tokens | before µs/step (mean / last 10%) | after µs/step (mean / last 10%) | "
          "speed-up (mean / last 10%) |")
    print("|---|---|---|---|---|")
    for old, new in zip(baseline["rows"], current["rows"], strict=True):
        print(f"| {'yes' if new['logprobs'] else 'no'} | {new['length']:,} | "
              f"{old['mean_s'] * 1e6:.0f} / {old['tail_s'] * 1e6:.0f} | {new['mean_s'] * 1e6:.0f} / {new['tail_s'] * 1e6:.0f} | "
              f"{old['mean_s'] / new['mean_s']:.1f}x / {old['tail_s'] / new['tail_s']:.1f}x |")
    print(f"\nDetokenizer decodes per token: {baseline['decodes_per_token']:.2f} before, "
          f"{current['decodes_per_token']:.2f} after")


if __name__ == "__main__":
    main()
