"""The background engine loop: continuous batching, failure isolation, aborts and shutdown."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from server_fakes import FakeEngine

from sonar_core.engine.request_errors import RequestError
from sonar_core.entrypoints.openai.async_engine import (
    AsyncEngine,
    EngineShutdownError,
    EngineStepError,
    RequestStream,
)
from sonar_core.entrypoints.openai.metrics import ServerMetrics, StatsRecorder
from sonar_core.outputs import RequestOutput
from sonar_core.sampling_params import SamplingParams


def make_async_engine(engine: FakeEngine) -> AsyncEngine:
    recorder = StatsRecorder(ServerMetrics("fake", 2), engine.spec_stats, log_stats=False)
    return AsyncEngine(engine, recorder)


async def drain(stream: RequestStream) -> list[RequestOutput]:
    return [output async for output in stream]


def run(engine: FakeEngine, scenario: Any) -> Any:
    """Run ``scenario(async_engine)`` with a started engine loop; stop it afterwards."""
    async_engine = make_async_engine(engine)
    async_engine.start()
    try:
        return asyncio.run(scenario(async_engine))
    finally:
        async_engine.stop()


def all_blocks_free(engine: FakeEngine) -> bool:
    return engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_outputs_arrive_in_order_and_end_with_the_finished_one(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer)

    async def scenario(async_engine: AsyncEngine) -> list[RequestOutput]:
        stream = await async_engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=5))
        return await drain(stream)

    outputs = run(engine, scenario)
    assert [o.outputs[0].token_ids for o in outputs][-1] == [5, 6, 7, 5, 6]
    assert [o.finished for o in outputs] == [False] * 4 + [True]
    assert all_blocks_free(engine)


def test_a_request_arriving_mid_generation_joins_the_running_batch(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer, step_delay_s=0.005)

    async def scenario(async_engine: AsyncEngine) -> tuple[list[RequestOutput], list[RequestOutput]]:
        long = await async_engine.add_request("long", [1, 2], SamplingParams(max_tokens=40))
        first = await long.__anext__()
        short = await async_engine.add_request("short", [3], SamplingParams(max_tokens=3))
        short_outputs, long_outputs = await asyncio.gather(drain(short), drain(long))
        return [first, *long_outputs], short_outputs

    long_outputs, short_outputs = run(engine, scenario)
    # The short request finished while the long one was still generating: one shared batch.
    assert short_outputs[-1].metrics.finished_time < long_outputs[-1].metrics.finished_time
    assert long_outputs[-1].outputs[0].token_ids == [1, 2] * 20


def test_a_refused_request_raises_and_leaves_others_alone(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer, max_model_len=16)

    async def scenario(async_engine: AsyncEngine) -> list[RequestOutput]:
        good = await async_engine.add_request("good", [1, 2, 3], SamplingParams(max_tokens=4))
        with pytest.raises(RequestError, match="max_model_len"):
            await async_engine.add_request("too-long", list(range(20)), SamplingParams(max_tokens=4))
        return await drain(good)

    assert run(engine, scenario)[-1].outputs[0].token_ids == [1, 2, 3, 1]
    assert all_blocks_free(engine)


def test_a_failing_step_fails_its_requests_and_the_loop_keeps_serving(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer, step_delay_s=0.002)

    async def scenario(async_engine: AsyncEngine) -> list[RequestOutput]:
        doomed = await async_engine.add_request("doomed", [1, 2], SamplingParams(max_tokens=50))
        await doomed.__anext__()
        engine.fail_next_step = True
        with pytest.raises(EngineStepError, match="injected step failure"):
            await drain(doomed)
        assert all_blocks_free(engine)
        after = await async_engine.add_request("after", [4, 5], SamplingParams(max_tokens=3))
        return await drain(after)

    assert run(engine, scenario)[-1].outputs[0].token_ids == [4, 5, 4]
    assert all_blocks_free(engine)


def test_abort_frees_the_request_and_ends_its_stream(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer, step_delay_s=0.002)

    async def scenario(async_engine: AsyncEngine) -> list[RequestOutput]:
        stream = await async_engine.add_request("gone", [1, 2], SamplingParams(max_tokens=50))
        await stream.__anext__()
        stream.abort()
        rest = await drain(stream)
        for _ in range(200):
            if all_blocks_free(engine) and not engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        return rest

    assert run(engine, scenario) == []
    assert all_blocks_free(engine)


def test_stop_aborts_requests_in_flight_and_refuses_new_ones(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer, step_delay_s=0.002)
    async_engine = make_async_engine(engine)
    async_engine.start()

    async def scenario() -> None:
        stream = await async_engine.add_request("inflight", [1, 2], SamplingParams(max_tokens=60))
        await stream.__anext__()
        await asyncio.to_thread(async_engine.stop)
        with pytest.raises(EngineShutdownError):
            await drain(stream)
        with pytest.raises(EngineShutdownError):
            await async_engine.add_request("late", [1], SamplingParams(max_tokens=2))

    asyncio.run(scenario())
    assert not async_engine.is_running
    assert all_blocks_free(engine)
    assert not engine.has_unfinished_requests()


def test_metrics_follow_the_outputs(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer)
    metrics = ServerMetrics("fake", 2)
    async_engine = AsyncEngine(engine, StatsRecorder(metrics, engine.spec_stats, log_stats=False))
    async_engine.start()

    async def scenario() -> None:
        await drain(await async_engine.add_request("m", [7, 8, 9], SamplingParams(max_tokens=4)))

    try:
        asyncio.run(scenario())
    finally:
        async_engine.stop()
    registry = metrics.registry
    assert registry.get_sample_value("aphrodite:generation_tokens_total", {"model_name": "fake"}) == 4
    assert registry.get_sample_value("aphrodite:prompt_tokens_total", {"model_name": "fake"}) == 3
    assert registry.get_sample_value(
        "aphrodite:request_success_total", {"model_name": "fake", "finished_reason": "length"}
    ) == 1
    assert registry.get_sample_value("aphrodite:time_to_first_token_seconds_count", {"model_name": "fake"}) == 1
    assert registry.get_sample_value("aphrodite:inter_token_latency_seconds_count", {"model_name": "fake"}) == 3
    # The fake engine drafts 2 tokens and accepts 1 at every request-step.
    assert registry.get_sample_value("aphrodite:spec_decode_num_drafts_total", {"model_name": "fake"}) == 4
    assert registry.get_sample_value(
        "aphrodite:spec_decode_num_accepted_tokens_per_pos_total", {"model_name": "fake", "position": "0"}
    ) == 4
    assert registry.get_sample_value(
        "aphrodite:spec_decode_num_accepted_tokens_per_pos_total", {"model_name": "fake", "position": "1"}
    ) == 0
