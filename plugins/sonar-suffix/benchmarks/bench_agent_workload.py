"""Suffix decoding vs n-gram vs no speculation on a multi-turn, agent-like workload.

An agent answers every turn with a tool call in one fixed JSON shape, so its responses repeat
across turns and across sessions. Each request is one turn: a system prompt listing the tools, the
session's earlier turns (user request, the agent's tool call, the tool's result) and a new user
request; the model writes the next tool call. The prompts are fixed in advance (earlier turns are
scripted), so every method gets exactly the same requests, sent one at a time, as an agent loop
sends them. The three engines run side by side and take turns request by request, so a change in
machine load during a pass affects all of them alike.

The embedded model (SmolLM2-135M-Instruct) runs in bfloat16, where verifying several drafted
tokens costs little more than one forward pass on a CPU with bf16 support.

Timing on a shared machine is noisy, so the workload runs in several passes, each with fresh
engines (suffix starts each pass with an empty tree), and each request's fastest pass counts.

Columns: method, output tokens, output tokens/s over the whole workload (warm-up excluded), mean
acceptance length (1 + accepted / drafts, the bonus token included; a step without a draft is not
a draft), the speed ratio to no speculation, drafted and accepted draft tokens, and how many
responses equal those without speculation. In bfloat16 a step that verifies several tokens rounds
differently from a one-token step and can flip near-ties, so some responses differ (and the
methods then decode slightly different text); ``--dtype float32`` makes them all equal, at a
higher verification cost.

Run: python plugins/sonar-suffix/benchmarks/bench_agent_workload.py [--sessions 4] [--turns 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from typing import Any

from aphrodite import LLM, SamplingParams

SYSTEM = (
    "You are a travel agent that acts only through tools. Answer every request with exactly one "
    "tool call as a JSON object with the keys \"tool\", \"arguments\" and \"reason\", and nothing "
    "else. Tools: get_weather(city, unit), search_flights(origin, destination, date, cabin), "
    "book_hotel(city, check_in, nights, guests), convert_currency(amount, source, target)."
)

# Each session plans one trip; each turn asks for one tool call.
SESSIONS = [
    ("Lisbon", "Madrid", "2025-06-03", "EUR"),
    ("Oslo", "Berlin", "2025-07-14", "NOK"),
    ("Osaka", "Tokyo", "2025-09-21", "JPY"),
    ("Denver", "Chicago", "2025-10-02", "USD"),
    ("Cairo", "Athens", "2025-11-11", "EGP"),
    ("Lima", "Bogota", "2025-12-05", "PEN"),
]


def turn(index: int, city: str, origin: str, date: str, currency: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """The user request, the scripted tool call and the tool's result of turn ``index`` of a session."""
    turns = [
        (
            f"What is the weather in {city} on {date}?",
            {"tool": "get_weather", "arguments": {"city": city, "unit": "celsius"}, "reason": "check the weather"},
            {"city": city, "forecast": "sunny", "high": 24, "low": 15},
        ),
        (
            f"Find me a flight from {origin} to {city} on {date}.",
            {
                "tool": "search_flights",
                "arguments": {"origin": origin, "destination": city, "date": date, "cabin": "economy"},
                "reason": "find a flight",
            },
            {"flights": [{"number": "XA101", "departs": "08:15", "price": 129}]},
        ),
        (
            f"Book a hotel in {city} from {date} for 3 nights for 2 guests.",
            {
                "tool": "book_hotel",
                "arguments": {"city": city, "check_in": date, "nights": 3, "guests": 2},
                "reason": "book a hotel",
            },
            {"hotel": "Central Plaza", "confirmation": "H-5521", "total": 420},
        ),
        (
            f"How much is 420 USD in {currency}?",
            {
                "tool": "convert_currency",
                "arguments": {"amount": 420, "source": "USD", "target": currency},
                "reason": "convert the price",
            },
            {"amount": 420, "converted": 391.2, "target": currency},
        ),
        (
            f"And the weather in {origin} on {date}?",
            {"tool": "get_weather", "arguments": {"city": origin, "unit": "celsius"}, "reason": "check the weather"},
            {"city": origin, "forecast": "cloudy", "high": 18, "low": 11},
        ),
    ]
    return turns[index % len(turns)]


def build_prompts(tokenizer: Any, sessions: int, turns: int) -> list[str]:
    """One chat prompt per (session, turn): the system prompt, the scripted history, a new request."""
    prompts = []
    for city, origin, date, currency in SESSIONS[:sessions]:
        messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
        for index in range(turns):
            request, call, result = turn(index, city, origin, date, currency)
            messages.append({"role": "user", "content": request})
            prompts.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
            messages.append({"role": "assistant", "content": json.dumps(call)})
            messages.append({"role": "user", "content": "Tool result: " + json.dumps(result)})
    return prompts


@dataclass
class Acceptance:
    """Speculation figures of one method over one pass of the workload."""

    drafted: int
    accepted: int
    mean_acceptance_length: float


@dataclass
class Pass:
    """What one method produced in one pass: the responses, each request's time, its acceptance."""

    outputs: list[list[int]] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    acceptance: Acceptance | None = None


def build(speculative_config: dict[str, Any] | None, args: argparse.Namespace) -> LLM:
    llm = LLM(
        dtype=args.dtype,
        device="cpu",
        max_model_len=args.max_model_len,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        speculative_config=speculative_config,
    )
    # Warm-up on an unrelated request: first-call costs stay out of the timing.
    llm.generate(["Say hello."], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    return llm


def run_pass(
    configs: list[tuple[str, dict[str, Any] | None]], args: argparse.Namespace
) -> tuple[dict[str, Pass], Any]:
    """One pass: fresh engines (suffix starts with an empty tree), every prompt sent to every method.

    Requests go one at a time and the methods take turns request by request, in a rotating order,
    so a change in machine load during the pass affects all of them alike. Returns each method's
    pass and the tokenizer.
    """
    engines = {name: build(config, args) for name, config in configs}
    tokenizer = engines["none"].get_tokenizer()
    prompts = build_prompts(tokenizer, args.sessions, args.turns)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    before = {name: llm.get_spec_decode_metrics() for name, llm in engines.items() if name != "none"}
    passes = {name: Pass() for name in engines}
    names = list(engines)
    for index, prompt in enumerate(prompts):  # an agent loop: one turn at a time
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            (output,) = engines[name].generate([prompt], params, use_tqdm=False)
            passes[name].seconds.append(time.perf_counter() - start)
            passes[name].outputs.append(list(output.outputs[0].token_ids))
    for name, summary in before.items():
        after = engines[name].get_spec_decode_metrics()
        drafts = after.num_drafts - summary.num_drafts
        accepted = after.num_accepted_tokens - summary.num_accepted_tokens
        passes[name].acceptance = Acceptance(
            drafted=after.num_draft_tokens - summary.num_draft_tokens,
            accepted=accepted,
            mean_acceptance_length=1.0 + accepted / drafts if drafts else 1.0,
        )
    return passes, tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=4, help=f"trips to plan (at most {len(SESSIONS)})")
    parser.add_argument("--turns", type=int, default=4, help="requests per session")
    parser.add_argument("--max-tokens", type=int, default=80)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-memory-gb", type=float, default=0.5, help="per engine (three run side by side)")
    parser.add_argument("--suffix-depth", type=int, default=32, help="num_speculative_tokens of suffix (a maximum)")
    parser.add_argument("--ngram-depth", type=int, default=5, help="num_speculative_tokens of ngram")
    parser.add_argument("--repeats", type=int, default=3, help="passes; each request's fastest is kept")
    parser.add_argument("--show", type=int, default=0, help="print the first N responses of each method")
    args = parser.parse_args()
    if not 1 <= args.sessions <= len(SESSIONS):
        parser.error(f"--sessions must be between 1 and {len(SESSIONS)}")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

    configs: list[tuple[str, dict[str, Any] | None]] = [
        ("none", None),
        ("ngram", {"method": "ngram", "num_speculative_tokens": args.ngram_depth,
                   "prompt_lookup_min": 2, "prompt_lookup_max": 5}),
        ("suffix", {"method": "suffix", "num_speculative_tokens": args.suffix_depth}),
    ]
    runs = []
    for _ in range(args.repeats):
        passes, tokenizer = run_pass(configs, args)
        runs.append(passes)
    first = runs[0]
    for name, _ in configs:
        for tokens in first[name].outputs[: args.show]:
            print(f"[{name}] {tokenizer.decode(tokens)!r}")
        if any(run[name].outputs != first[name].outputs for run in runs[1:]):
            print(f"note: {name} did not answer identically in every pass; figures are from the first")
    num_requests = len(first["none"].outputs)
    print(
        f"\n{num_requests} requests ({args.sessions} sessions x {args.turns} turns), one at a time, "
        f"embedded SmolLM2-135M-Instruct, {args.dtype}, greedy, max_tokens={args.max_tokens}, "
        f"fastest of {args.repeats} passes per request\n"
    )
    print(
        f"{'method':<8} {'tokens':>7} {'tokens/s':>9} {'mean acc. len':>14} {'vs none':>8} "
        f"{'drafted':>8} {'accepted':>9} {'same output':>12}"
    )
    rates: dict[str, float] = {}
    for name, _ in configs:
        # Other processes only ever add time, so each request's fastest pass is its truest time.
        seconds = sum(min(run[name].seconds[i] for run in runs) for i in range(num_requests))
        tokens = sum(len(output) for output in first[name].outputs)
        rates[name] = tokens / seconds
        figure = first[name].acceptance
        length, drafted, accepted = (
            (f"{figure.mean_acceptance_length:.2f}", str(figure.drafted), str(figure.accepted)) if figure else ("-",) * 3
        )
        same = sum(a == b for a, b in zip(first[name].outputs, first["none"].outputs, strict=True))
        print(
            f"{name:<8} {tokens:>7} {rates[name]:>9.2f} {length:>14} {rates[name] / rates['none']:>7.2f}x "
            f"{drafted:>8} {accepted:>9} {same:>7}/{num_requests}"
        )


if __name__ == "__main__":
    main()
