"""The offline Python API: ``LLM(...).generate(...)`` and ``.chat(...)``."""

from __future__ import annotations

from collections.abc import Sequence as SequenceLike
from typing import Any

from tqdm.auto import tqdm

from sonar_core.config import EngineConfig, SpeculativeConfig
from sonar_core.engine.llm_engine import LLMEngine
from sonar_core.outputs import RequestOutput
from sonar_core.sampling_params import SamplingParams
from sonar_core.spec_decode.metrics import SpecDecodingSummary

Prompt = str | list[int]
ChatMessage = dict[str, Any]


class LLM:
    """A model with an engine behind it, for offline batched generation.

    ``model=None`` uses the embedded default model. Keyword arguments are the engine's
    configuration fields (``max_model_len``, ``max_num_seqs``, ``dtype``, ``device``, ``seed``,
    ``speculative_config`` ...), validated with the same rules as the command line.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        speculative_config: dict[str, Any] | SpeculativeConfig | None = None,
        **engine_args: Any,
    ) -> None:
        config = EngineConfig.build(model=model, speculative_config=speculative_config, **engine_args)
        self.engine = LLMEngine(config)

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
        return [final[i] for i in ids]

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
