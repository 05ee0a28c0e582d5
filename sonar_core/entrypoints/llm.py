"""The offline Python API: ``LLM(...).generate(...)`` and ``.chat(...)``."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence as SequenceLike
from typing import Any

from tqdm.auto import tqdm

from sonar_core.config import EngineConfig, SpeculativeConfig
from sonar_core.engine.llm_engine import LLMEngine
from sonar_core.entrypoints.logging_format import LOG_DATE_FORMAT, LOG_FORMAT, LOG_LEVEL_ENV
from sonar_core.outputs import RequestOutput
from sonar_core.sampling_params import SamplingParams
from sonar_core.spec_decode.metrics import SpecDecodingLogging, SpecDecodingSummary

Prompt = str | list[int]
ChatMessage = dict[str, Any]


class LLM:
    """A model with an engine behind it, for offline batched generation.

    ``model=None`` uses the embedded default model. Keyword arguments are the engine's
    configuration fields (``max_model_len``, ``max_num_seqs``, ``dtype``, ``device``, ``seed``,
    ``speculative_config`` ...), validated with the same rules as the command line.

    As in vLLM, ``disable_log_stats`` defaults to True here; with False, generation logs the
    ``SpecDecoding metrics`` line every ``stats_interval_s`` seconds and once at the end of each
    :meth:`generate` call, as ``aphrodite serve`` does.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        speculative_config: dict[str, Any] | SpeculativeConfig | None = None,
        disable_log_stats: bool = True,
        stats_interval_s: float = 5.0,
        **engine_args: Any,
    ) -> None:
        config = EngineConfig.build(
            model=model, speculative_config=speculative_config, disable_log_stats=disable_log_stats, **engine_args
        )
        _show_sonar_logs()
        self.engine = LLMEngine(config)
        speculating = self.engine.speculator is not None
        self._spec_logging = (
            SpecDecodingLogging(self.engine.spec_stats.num_speculative_tokens, stats_interval_s)
            if speculating and not disable_log_stats
            else None
        )

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | SequenceLike[Prompt],
        sampling_params: SamplingParams | SequenceLike[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in prompt order."""
        prompt_list = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompt_list))
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompt_list, params, strict=True)]
        final: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Generating", disable=not use_tqdm or len(ids) < 2) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
                        bar.update(1)
                self._log_stats(final=False)
        self._log_stats(final=True)
        return [final[i] for i in ids]

    def _log_stats(self, final: bool) -> None:
        """The periodic ``SpecDecoding metrics`` line (and the rest of the interval at the end)."""
        if self._spec_logging is None:
            return
        self._spec_logging.follow(self.engine.spec_stats)
        if final:
            self._spec_logging.log()
        else:
            self._spec_logging.maybe_log()

    def chat(
        self,
        messages: list[ChatMessage] | list[list[ChatMessage]],
        sampling_params: SamplingParams | SequenceLike[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.engine.tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def get_spec_decode_metrics(self) -> SpecDecodingSummary:
        """Acceptance figures accumulated since the engine started."""
        return self.engine.spec_stats.summary()


def _show_sonar_logs() -> None:
    """Give Sonar's loggers (``sonar.*``, and ``sonar_core.*`` for modules named by ``__name__``)
    a stderr handler at INFO (``SONAR_LOGGING_LEVEL``) when the program has configured no logging
    at all, so that the Python API shows the "engine ready" line, warnings and statistics the
    command line shows. A program with handlers of its own keeps them alone;
    ``SONAR_CONFIGURE_LOGGING=0`` turns this off."""
    loggers = [logging.getLogger(name) for name in ("sonar", "sonar_core")]
    if os.environ.get("SONAR_CONFIGURE_LOGGING", "1") == "0" or logging.getLogger().handlers:
        return
    level = logging.getLevelName(os.environ.get(LOG_LEVEL_ENV, "INFO").strip().upper())
    for logger in loggers:
        if logger.handlers:
            continue
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(LOG_FORMAT, datefmt=LOG_DATE_FORMAT))
        logger.addHandler(handler)
        logger.setLevel(level if isinstance(level, int) else logging.INFO)


def _as_prompt_list(prompts: Prompt | SequenceLike[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and isinstance(items[0], int):
        return [items]  # one prompt given as token ids
    return items


def _as_params_list(
    params: SamplingParams | SequenceLike[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(count)]
    if isinstance(params, SamplingParams):
        return [params] * count
    items = list(params)
    if len(items) != count:
        raise ValueError(f"got {len(items)} sampling params for {count} prompts; pass one or one per prompt")
    return items
