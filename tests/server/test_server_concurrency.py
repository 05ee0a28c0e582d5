"""32 concurrent streaming clients on one live server, some hanging up part-way through."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import openai
from server_live import LiveServer

from sonar_core.sampling_params import SamplingParams

NUM_CLIENTS = 32
MAX_TOKENS = 24
# A client that hangs up asks for a long answer, so that the server is still streaming when the
# client goes: with MAX_TOKENS a fast machine can finish every request before it notices a hang-up,
# and then no abort is left to check.
HANG_UP_MAX_TOKENS = 96
PROMPTS = [
    "The quick brown fox jumps",
    "one two three four five six",
    "def add(a, b):\n    return",
    "Little robot loved",
    "Speculative decoding inference engine",
    "for i in range(10):\n",
    "River mountain city garden",
    "Count story began when",
]


async def one_client(client: openai.AsyncOpenAI, prompt: str, hang_up_after: int | None) -> str | None:
    """The streamed text, or None when this client hangs up after ``hang_up_after`` chunks."""
    hangs_up = hang_up_after is not None
    stream = await client.completions.create(
        model="tiny", prompt=prompt, max_tokens=HANG_UP_MAX_TOKENS if hangs_up else MAX_TOKENS, temperature=0,
        stream=True, extra_body={"ignore_eos": True} if hangs_up else None,
    )
    pieces: list[str] = []
    async for chunk in stream:
        pieces.append(chunk.choices[0].text if chunk.choices else "")
        if hang_up_after is not None and len(pieces) >= hang_up_after:
            await stream.close()
            return None
    return "".join(pieces)


def test_concurrent_streams_with_disconnects_stay_correct_and_free_every_block(
    live: LiveServer, offline: Any
) -> None:
    expected = {
        prompt: output.outputs[0].text
        for prompt, output in zip(
            PROMPTS, offline.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False),
            strict=True,
        )
    }
    rng = random.Random(1234)
    plan = [(PROMPTS[i % len(PROMPTS)], rng.choice([None, None, 1, 2, 5, 10])) for i in range(NUM_CLIENTS)]
    live.wait_idle()
    before = live.metrics()

    async def main() -> list[str | None | BaseException]:
        async with live.async_client() as client:
            return await asyncio.gather(
                *(one_client(client, prompt, cut) for prompt, cut in plan), return_exceptions=True
            )

    results = asyncio.run(main())
    failures = [r for r in results if isinstance(r, BaseException)]
    assert not failures, failures  # no 5xx, no broken stream
    completed = [(prompt, text) for (prompt, _), text in zip(plan, results, strict=True) if text is not None]
    assert len(completed) == sum(cut is None for _, cut in plan)
    for prompt, text in completed:
        assert text == expected[prompt], prompt

    live.wait_idle()  # every request finished or aborted, every KV block back
    after = live.metrics()

    def delta(reason: str) -> float:
        key = ("aphrodite:request_success_total", (("finished_reason", reason),))
        return after[key] - before[key]

    hung_up = NUM_CLIENTS - len(completed)
    assert delta("stop") + delta("length") + delta("abort") == NUM_CLIENTS
    # A client may hang up after its request already finished; the others were aborted.
    assert 0 < delta("abort") <= hung_up
    assert after[("aphrodite:kv_cache_usage_perc", ())] == 0
