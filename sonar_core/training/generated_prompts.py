"""Prompts the target writes itself: user turns sampled from its own chat template.

An instruction-tuned model has learnt what users ask. Started where its chat template opens a user
turn and sampled, it writes a request, on any subject and in the many phrasings it was tuned on
(the "Magpie" way of making instruction data). For a draft head that means answers on far more
subjects than the fixed lists of :mod:`sonar_core.training.prompts` hold; a head learns the
target's habits on those subjects rather than the few the lists name (docs/training.md measures
what that changed for the shipped head).

A sample is kept when the model closed its turn within :data:`MAX_TOKENS`, has at least
:data:`MIN_WORDS` words, and was not written before. Attempt ``k`` is sampled with its own seed
(from the data seed and ``k``), so the list is the same every time and a longer one extends a
shorter one. The list lives in the data folder (:data:`FILE_NAME`), one JSON line per kept prompt
with its attempt number, appended as it grows: it costs target time to make, the answer files are
named after it, and an interrupted run resumes after the last attempt written.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sonar_core.errors import ConfigError
from sonar_core.training.prompts import TrainingPrompt

GENERATED = "generated"
FILE_NAME = "generated-prompts.jsonl"
# Sampling of a user turn: the model's own distribution (nucleus-trimmed of its unlikely tail), and
# short requests (a longer sample rambles rather than asks).
TEMPERATURE = 1.0
TOP_P = 0.95
MAX_TOKENS = 80
MIN_WORDS = 5
# Attempts sampled at once, and the most attempts per kept prompt before the target is judged
# unable to write requests (a base model, or a template without a user turn it can continue).
BATCH = 256
MAX_ATTEMPTS_PER_PROMPT = 20
_SENTINEL = "\x00sonar-user-turn\x00"


@dataclass(frozen=True)
class UserTurn:
    """Where a user's text goes in the target's chat template: the text before it (every
    conversation's opening, a default system prompt included) and the text that closes the turn."""

    opening: str
    closing: str

    @classmethod
    def of(cls, tokenizer: Any) -> UserTurn:
        """Read from ``tokenizer``'s chat template by rendering a one-message conversation."""
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False)
        if rendered.count(_SENTINEL) != 1:
            raise ConfigError(
                "generated_prompts", "the target's chat template does not place a user message's text as it is, "
                "so the target cannot be asked to write one", "leave out --generated-prompts for this target",
            )
        opening, closing = rendered.split(_SENTINEL)
        return cls(opening, closing.strip())


# ``sample(seeds)`` -> one ``(text, finished)`` per seed: the user turn sampled with that seed, and
# whether the model closed the turn itself.
Sampler = Callable[[Sequence[int]], list[tuple[str, bool]]]


def engine_sampler(llm: Any) -> Sampler:
    """Sample user turns with ``llm`` (a Sonar :class:`~sonar_core.entrypoints.llm.LLM`)."""
    from sonar_core.sampling_params import SamplingParams

    tokenizer = llm.get_tokenizer()
    turn = UserTurn.of(tokenizer)
    opening = tokenizer.encode(turn.opening, add_special_tokens=False)
    stop = [turn.closing] if turn.closing else None

    def sample(seeds: Sequence[int]) -> list[tuple[str, bool]]:
        params = [SamplingParams(temperature=TEMPERATURE, top_p=TOP_P, max_tokens=MAX_TOKENS, seed=seed, stop=stop)
                  for seed in seeds]
        outputs = llm.generate([list(opening)] * len(seeds), params, use_tqdm=False)
        return [(o.outputs[0].text, o.outputs[0].finish_reason == "stop") for o in outputs]

    return sample


class GeneratedPrompts:
    """The list of target-written prompts in a data folder (see the module docstring)."""

    def __init__(self, folder: Path, seed: int) -> None:
        self.path = Path(folder) / FILE_NAME
        self.seed = seed

    def read(self) -> list[TrainingPrompt]:
        """Every prompt written so far, in order."""
        return [_prompt(index, entry["text"]) for index, entry in enumerate(self._entries())]

    def first(self, count: int) -> list[TrainingPrompt]:
        """The first ``count`` prompts; a ConfigError when fewer were written."""
        prompts = self.read()
        if len(prompts) < count:
            raise ConfigError(
                "work_dir", f"{self.path} holds {len(prompts)} of the {count} target-written prompts asked for",
                "run the data step again with the same settings; it writes the rest",
            )
        return prompts[:count]

    def extend(self, count: int, sample: Sampler, progress: Callable[[int, int], None] | None = None) -> int:
        """Sample until ``count`` prompts are written (the folder's earlier ones stay); returns how
        many were added, calling ``progress(written, count)`` as they are. A ConfigError when the
        target writes too few usable requests."""
        entries = self._entries()
        seen = {entry["text"] for entry in entries}
        attempt = entries[-1]["attempt"] + 1 if entries else 0
        limit = attempt + MAX_ATTEMPTS_PER_PROMPT * max(count - len(entries), 0)
        added = 0
        while len(entries) + added < count:
            if attempt >= limit:
                raise ConfigError(
                    "generated_prompts",
                    f"the target wrote {len(entries) + added} usable requests in {attempt} attempts, fewer than "
                    f"the {count} asked for (a request must end its turn within {MAX_TOKENS} tokens and have "
                    f"{MIN_WORDS} words or more): it does not seem to be tuned for chat",
                    "ask for fewer --generated-prompts, or use the built-in prompt sets of a target that is not",
                )
            attempts = range(attempt, attempt + BATCH)
            kept = []
            for number, (text, finished) in zip(attempts, sample([self._seed(k) for k in attempts]), strict=True):
                text = text.strip()
                if finished and len(text.split()) >= MIN_WORDS and text not in seen:
                    seen.add(text)
                    kept.append({"attempt": number, "text": text})
            kept = kept[: count - len(entries) - added]
            attempt += BATCH
            self._append(kept)
            added += len(kept)
            if progress is not None:
                progress(len(entries) + added, count)
        return added

    def _seed(self, attempt: int) -> int:
        """Attempt ``attempt``'s sampling seed: distinct per data seed and attempt."""
        return (self.seed << 32) + attempt

    def _entries(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def _append(self, entries: list[dict[str, Any]]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as file:
            for entry in entries:
                file.write(json.dumps(entry) + "\n")


def _prompt(index: int, text: str) -> TrainingPrompt:
    return TrainingPrompt(f"{GENERATED}-{index:06d}", GENERATED, ({"role": "user", "content": text},))
