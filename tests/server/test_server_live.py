"""The official openai client against a live server on a tiny checkpoint.

Greedy outputs must equal the offline ``LLM.generate`` / ``LLM.chat`` outputs token for token,
streamed or not, with speculation on or off.
"""

from __future__ import annotations

import threading
from typing import Any

import openai
import pytest
from server_live import MAX_MODEL_LEN, NGRAM_CONFIG, LiveServer

from sonar_core.sampling_params import SamplingParams

PROMPTS = [
    "The quick brown fox",
    "one two three one two three one two three one",
    "def add(a, b):\n    return a + b\ndef add(a, b):\n",
    "Little robot loved count story",
]
MAX_TOKENS = 12
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story about a robot."}]


def greedy(max_tokens: int = MAX_TOKENS, **fields: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **fields)


@pytest.fixture(scope="module")
def reference(offline: Any) -> list[Any]:
    return offline.generate(PROMPTS, greedy(), use_tqdm=False)


def stream_completion(client: openai.OpenAI, **kwargs: Any) -> tuple[str, list[Any]]:
    chunks = list(client.completions.create(stream=True, **kwargs))
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks


def stream_chat(client: openai.OpenAI, **kwargs: Any) -> tuple[str, list[Any]]:
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


# ----------------------------------------------------------------------------- plain endpoints
def test_models_health_version(live: LiveServer) -> None:
    models = live.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    with live.http() as http:
        assert http.get("/health").status_code == 200
        assert http.get("/version").json()["version"]
        assert http.get("/openapi.json").json()["paths"].keys() >= {"/v1/completions", "/v1/chat/completions"}


# --------------------------------------------------------------------------- greedy == offline
def test_completions_equal_offline_generate(live: LiveServer, reference: list[Any]) -> None:
    client = live.client()
    for prompt, expected in zip(PROMPTS, reference, strict=True):
        response = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        choice = response.choices[0]
        assert choice.text == expected.outputs[0].text
        assert choice.finish_reason == expected.outputs[0].finish_reason
        assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
        assert response.usage.completion_tokens == len(expected.outputs[0].token_ids)
        assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_streamed_completions_equal_offline_generate(live: LiveServer, reference: list[Any]) -> None:
    client = live.client()
    for prompt, expected in zip(PROMPTS, reference, strict=True):
        text, chunks = stream_completion(
            client, model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            stream_options={"include_usage": True},
        )
        assert text == expected.outputs[0].text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.outputs[0].finish_reason
        assert chunks[-1].choices == []
        assert chunks[-1].usage.completion_tokens == len(expected.outputs[0].token_ids)
        assert all(c.usage is None for c in chunks[:-1])


def test_a_batch_of_prompts_and_token_id_prompts(live: LiveServer, reference: list[Any]) -> None:
    client = live.client()
    response = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    assert [c.index for c in response.choices] == list(range(len(PROMPTS)))
    assert [c.text for c in response.choices] == [r.outputs[0].text for r in reference]
    assert response.usage.completion_tokens == sum(len(r.outputs[0].token_ids) for r in reference)

    text, chunks = stream_completion(client, model="tiny", prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    for index, expected in enumerate(reference):
        streamed = "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == index)
        assert streamed == expected.outputs[0].text

    by_ids = client.completions.create(
        model="tiny", prompt=reference[0].prompt_token_ids, max_tokens=MAX_TOKENS, temperature=0
    )
    assert by_ids.choices[0].text == reference[0].outputs[0].text


def test_chat_equals_offline_chat(live: LiveServer, offline: Any) -> None:
    expected = offline.chat(CHAT, greedy(), use_tqdm=False)[0].outputs[0]
    client = live.client()
    response = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected.text
    assert response.usage.completion_tokens == len(expected.token_ids)

    text, chunks = stream_chat(
        client, model="tiny", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, stream_options={"include_usage": True}
    )
    assert text == expected.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_chat_without_max_tokens_may_fill_the_context(live: LiveServer, offline: Any) -> None:
    response = live.client().chat.completions.create(
        model="tiny", messages=CHAT, temperature=0, extra_body={"ignore_eos": True}
    )
    assert response.choices[0].finish_reason == "length"
    assert response.usage.total_tokens == MAX_MODEL_LEN


def test_stop_strings_cut_streamed_and_full_text_alike(live: LiveServer, offline: Any, reference: list[Any]) -> None:
    full = reference[0].outputs[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    expected = offline.generate(PROMPTS[0], greedy(stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert expected.text == full[: full.index(stop)]
    client = live.client()
    response = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stop=stop)
    assert response.choices[0].text == expected.text
    assert response.choices[0].finish_reason == "stop"
    text, _ = stream_completion(client, model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stop=stop)
    assert text == expected.text


def test_logprobs_are_those_of_the_sampled_tokens(live: LiveServer, offline: Any) -> None:
    expected = offline.generate(PROMPTS[1], greedy(logprobs=0), use_tqdm=False)[0].outputs[0]
    client = live.client()
    response = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0, logprobs=0)
    logprobs = response.choices[0].logprobs
    assert logprobs.token_logprobs == pytest.approx(expected.logprobs, abs=1e-4)
    # One entry per sampled token (a token that ends inside a multi-byte character decodes to
    # a replacement character on its own, so the joined tokens need not spell the text).
    assert len(logprobs.tokens) == len(expected.token_ids) == response.usage.completion_tokens
    assert logprobs.text_offset[0] == 0
    assert logprobs.text_offset == sorted(logprobs.text_offset)

    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=5, temperature=0, logprobs=True)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(entry.logprob <= 0 for entry in content)


def test_seeded_sampling_is_reproducible(live: LiveServer) -> None:
    client = live.client()
    texts = {
        client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=1.0, seed=7).choices[0].text
        for _ in range(2)
    }
    assert len(texts) == 1


# ------------------------------------------------------------------------------------ speculation
def test_ngram_speculation_keeps_greedy_output_and_counts_drafts(
    live_ngram: LiveServer, reference: list[Any]
) -> None:
    live_ngram.wait_idle()
    before = live_ngram.metrics()
    client = live_ngram.client()
    for prompt, expected in zip(PROMPTS, reference, strict=True):
        response = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert response.choices[0].text == expected.outputs[0].text
        text, _ = stream_completion(client, model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert text == expected.outputs[0].text
    after = live_ngram.metrics()

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    drafts = delta("aphrodite:spec_decode_num_drafts_total")
    drafted = delta("aphrodite:spec_decode_num_draft_tokens_total")
    accepted = delta("aphrodite:spec_decode_num_accepted_tokens_total")
    per_pos = [
        delta("aphrodite:spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
        for p in range(NGRAM_CONFIG["num_speculative_tokens"])
    ]
    assert drafts > 0
    assert drafts <= drafted <= drafts * NGRAM_CONFIG["num_speculative_tokens"]
    assert sum(per_pos) == accepted
    assert per_pos == sorted(per_pos, reverse=True)  # position j accepted implies j-1 accepted
    assert delta("aphrodite:generation_tokens_total") == 2 * sum(len(r.outputs[0].token_ids) for r in reference)


# ---------------------------------------------------------------------------------------- metrics
def test_metrics_move_by_exactly_one_request(live: LiveServer) -> None:
    live.wait_idle()
    before = live.metrics()
    response = live.client().completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    live.wait_idle()
    after = live.metrics()

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before[key]

    assert response.usage.completion_tokens == 7
    assert delta("aphrodite:generation_tokens_total") == 7
    assert delta("aphrodite:prompt_tokens_total") == response.usage.prompt_tokens
    assert delta("aphrodite:request_success_total", finished_reason="length") == 1
    assert delta("aphrodite:request_success_total", finished_reason="stop") == 0
    assert delta("aphrodite:time_to_first_token_seconds_count") == 1
    assert delta("aphrodite:e2e_request_latency_seconds_count") == 1
    assert delta("aphrodite:inter_token_latency_seconds_count") == 6  # one gap per later token
    assert delta("aphrodite:spec_decode_num_drafts_total") == 0  # no speculation on this server
    assert after[("aphrodite:num_requests_running", ())] == 0
    assert after[("aphrodite:num_requests_waiting", ())] == 0
    assert after[("aphrodite:kv_cache_usage_perc", ())] == 0


# ------------------------------------------------------------------------------------ bad requests
BAD_REQUESTS = [
    # (route, body, status, param)
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "word " * (2 * MAX_MODEL_LEN), "max_tokens": 4}, 400, None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400, None),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 2}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "hi", "stream": True, "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": [], "max_tokens": 2}, 400, "prompt"),
    ("/v1/completions", {"prompt": [999999]}, 400, None),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages.0.content"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 422, "max_tokens"),
    ("/v1/completions", {"max_tokens": 3}, 422, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 422, "messages.0.role"),
    ("/v1/chat/completions", {"messages": "hello"}, 422, "messages"),
]


def test_bad_requests_get_openai_errors_and_leave_requests_in_flight_alone(
    live: LiveServer, offline: Any
) -> None:
    expected = offline.generate(PROMPTS[2], greedy(max_tokens=40), use_tqdm=False)[0].outputs[0].text
    streamed: list[str] = []

    def long_stream() -> None:
        text, _ = stream_completion(live.client(), model="tiny", prompt=PROMPTS[2], max_tokens=40, temperature=0)
        streamed.append(text)

    reader = threading.Thread(target=long_stream)
    reader.start()
    with live.http() as http:
        for route, body, status, param in BAD_REQUESTS:
            response = http.post(route, json=body)
            assert response.status_code == status, (body, response.text)
            error = response.json()["error"]
            assert error["code"] == status
            assert error["type"] == {400: "BadRequestError", 404: "NotFoundError", 422: "UnprocessableEntityError"}[status]
            assert error["message"]
            if param is not None:
                assert error["param"] == param, (body, error)
        malformed = http.post("/v1/completions", content=b'{"prompt": "hi", ', headers={"content-type": "application/json"})
        assert malformed.status_code == 400
        error = malformed.json()["error"]
        assert error["type"] == "BadRequestError" and error["param"] is None
        assert error["message"].startswith("the request body is not valid JSON at character 17: Expecting property name")
        unknown_route = http.get("/v1/nothing-here")
        assert unknown_route.status_code == 404
        assert unknown_route.json()["error"]["type"] == "NotFoundError"
        wrong_method = http.get("/v1/completions")
        assert wrong_method.status_code == 405
    reader.join(60)
    assert streamed == [expected]
    live.wait_idle()


def test_the_openai_client_raises_its_own_exceptions(live: LiveServer) -> None:
    client = live.client()
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt="hi", max_tokens=-5)
    assert bad.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=CHAT)
    with pytest.raises(openai.UnprocessableEntityError):
        client.completions.create(model="tiny", prompt="hi", extra_body={"temperature": "warm"})
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model="tiny", prompt="fox " * 400, max_tokens=1)
