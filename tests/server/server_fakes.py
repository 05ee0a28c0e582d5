"""A stand-in for LLMEngine with the exact API the server drives, for fault-injection tests.

Its "model" repeats the prompt's tokens (output token i is prompt token i mod len(prompt)), one
token per request per step, so outputs are known in advance. It keeps real KV-block accounting
(a :class:`BlockManager`) so tests can check that aborts and failures free every block, and it
can be told to fail a step or to run slowly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from sonar_core.engine.block_manager import BlockManager
from sonar_core.engine.request_errors import RequestError
from sonar_core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from sonar_core.sampling_params import SamplingParams
from sonar_core.spec_decode.metrics import SpecDecodingStats


@dataclass
class _FakeRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)


class FakeEngine:
    """Echoes prompts token by token; ``fail_next_step`` makes the next step raise."""

    model_name = "fake-model"

    def __init__(
        self, tokenizer: Any, max_model_len: int = 64, num_blocks: int = 64, block_size: int = 4,
        step_delay_s: float = 0.0,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.block_manager = BlockManager(num_blocks, block_size)
        self.spec_stats = SpecDecodingStats(num_speculative_tokens=2)
        self.step_delay_s = step_delay_s
        self.fail_next_step = False
        self.num_steps = 0
        self._waiting: list[_FakeRequest] = []
        self._running: list[_FakeRequest] = []

    # The API of LLMEngine that the server uses.
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        params = params or SamplingParams()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise RequestError("the prompt is empty")
        if any(not 0 <= token < len(self.tokenizer) for token in ids):
            raise RequestError("a prompt token id is outside the vocabulary")
        if len(ids) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}")
        if params.max_tokens is not None and params.max_tokens > self.max_model_len - len(ids):
            raise RequestError("max_tokens is too large")
        assert request_id is not None
        metrics = RequestMetrics(arrival_time=arrival_time or time.monotonic())
        self._waiting.append(_FakeRequest(request_id, ids, params, metrics))
        return request_id

    def step(self) -> list[RequestOutput]:
        self.num_steps += 1
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("injected step failure")
        while self._waiting and self.block_manager.grow(self._waiting[0].block_table, self.max_model_len):
            self._running.append(self._waiting.pop(0))
        outputs = []
        now = time.monotonic()
        for request in list(self._running):
            token = request.prompt_ids[len(request.output_ids) % len(request.prompt_ids)]
            request.output_ids.append(token)
            self.spec_stats.observe_draft(2, 1)
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            else:
                request.metrics.inter_token_latencies.append(now - request.metrics.last_token_time)
            request.metrics.last_token_time = now
            finished = len(request.output_ids) >= (request.params.max_tokens or self.max_model_len)
            if finished:
                request.metrics.finished_time = now
                self._release(request)
            outputs.append(self._output(request, token, finished))
        return outputs

    def abort_request(self, request_id: str) -> None:
        for request in self._waiting + self._running:
            if request.request_id == request_id:
                self._release(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def kv_cache_usage(self) -> float:
        return self.block_manager.usage

    # Helpers.
    def _release(self, request: _FakeRequest) -> None:
        if request in self._running:
            self._running.remove(request)
        if request in self._waiting:
            self._waiting.remove(request)
        self.block_manager.free(request.block_table)

    def _output(self, request: _FakeRequest, token: int, finished: bool) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=self.tokenizer.decode(request.output_ids),
            token_ids=list(request.output_ids),
            cumulative_logprob=None,
            logprobs=None,
            finish_reason="length" if finished else None,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=None,
            prompt_token_ids=request.prompt_ids,
            outputs=[completion],
            finished=finished,
            metrics=request.metrics,
            delta_token_ids=[token],
        )
