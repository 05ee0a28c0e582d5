"""Request bodies -> SamplingParams: types are the model's job (422), values the converters' (400)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sonar_core.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    chat_sampling_params,
    completion_sampling_params,
    error_body,
)


def completion(**fields: object) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi", **fields})


def chat(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


def test_completion_fields_map_onto_sampling_params() -> None:
    params = completion_sampling_params(
        completion(max_tokens=7, temperature=0, top_p=0.5, top_k=3, min_p=0.1, seed=11, stop="\n", logprobs=0)
    )
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (7, 0.0, 0.5, 3)
    assert (params.min_p, params.seed, params.stop, params.logprobs) == (0.1, 11, ["\n"], 0)


def test_completion_defaults_follow_openai() -> None:
    params = completion_sampling_params(completion())
    assert params.max_tokens == 16
    assert params.temperature == 1.0
    assert params.logprobs is None


def test_chat_prefers_max_completion_tokens_and_defaults_to_unbounded() -> None:
    assert chat_sampling_params(chat()).max_tokens is None
    assert chat_sampling_params(chat(max_tokens=5, max_completion_tokens=3)).max_tokens == 3
    assert chat_sampling_params(chat(logprobs=True)).logprobs == 0


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"n": 2}, "n"),
        ({"best_of": 3}, "best_of"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": -1}, "frequency_penalty"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"logprobs": 3}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"echo": True}, "echo"),
        ({"suffix": "tail"}, "suffix"),
        ({"seed": 2**64}, "seed"),
        ({"top_k": 2**70}, "top_k"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_completion_values_that_cannot_be_served_are_400(fields: dict, param: str) -> None:
    with pytest.raises(APIError) as caught:
        completion_sampling_params(completion(**fields))
    assert caught.value.status == 400
    assert caught.value.param == param
    assert param in caught.value.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_completion_tokens": -3}, "max_completion_tokens"),
        ({"messages": []}, "messages"),
        ({"logprobs": True, "top_logprobs": 2}, "top_logprobs"),
        ({"top_logprobs": 0}, "top_logprobs"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ],
)
def test_chat_values_that_cannot_be_served_are_400(fields: dict, param: str) -> None:
    with pytest.raises(APIError) as caught:
        chat_sampling_params(chat(**fields))
    assert (caught.value.status, caught.value.param) == (400, param)


@pytest.mark.parametrize(
    "fields",
    [
        {"max_tokens": "5"},
        {"temperature": "hot"},
        {"prompt": None},
        {"prompt": 5},
        {"stream": "yes"},
        {"stop": 3},
    ],
)
def test_wrong_types_are_rejected_by_the_model(fields: dict) -> None:
    with pytest.raises(ValidationError):
        completion(**fields)


def test_unknown_fields_are_ignored_and_ints_pass_as_floats() -> None:
    request = completion(temperature=1, some_future_field={"x": 1}, metadata={"k": "v"})
    assert request.temperature == 1.0
    assert not hasattr(request, "some_future_field")


def test_chat_roles_are_checked_and_content_parts_parse() -> None:
    with pytest.raises(ValidationError):
        chat(messages=[{"role": "wizard", "content": "hi"}])
    request = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}]}])
    assert request.messages[0].content[0].text == "a"


def test_error_body_is_openais_shape() -> None:
    assert error_body(404, "no such model", "model") == {
        "error": {"message": "no such model", "type": "NotFoundError", "param": "model", "code": 404}
    }
    assert error_body(400, "bad")["error"]["type"] == "BadRequestError"
