"""Prompts the target writes itself: where its chat template opens a user turn, which samples are
kept, a list that is the same every time and grows by extension, and the data step that answers them."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence

import pytest
from training_kit import data_spec
from transformers import AutoTokenizer

from sonar_core.errors import ConfigError
from sonar_core.training import data as data_module
from sonar_core.training.data import GENERATED_SPARE, SelfDistillationData, held_out_prompts
from sonar_core.training.generated_prompts import (
    FILE_NAME,
    GENERATED,
    MIN_WORDS,
    GeneratedPrompts,
    UserTurn,
    engine_sampler,
)


class FakeTarget:
    """A sampler that writes, for each seed, a request unique to it, except that every third seed
    runs past its turn, every fifth writes too few words and every seventh repeats an earlier text.
    Records the seeds it was asked for."""

    def __init__(self) -> None:
        self.seeds: list[int] = []

    def __call__(self, seeds: Sequence[int]) -> list[tuple[str, bool]]:
        self.seeds += seeds
        return [self._write(seed) for seed in seeds]

    @staticmethod
    def _write(seed: int) -> tuple[str, bool]:
        attempt = seed & 0xFFFFFFFF
        if attempt % 5 == 0:
            return "too short", True
        if attempt % 7 == 0:
            return "  please tell me about the same thing again  ", True
        return f"please tell me about subject number {attempt}", attempt % 3 != 0


def test_the_user_turn_is_read_from_the_chat_template(target):
    tokenizer = AutoTokenizer.from_pretrained(target)
    turn = UserTurn.of(tokenizer)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False)
    assert rendered.startswith(turn.opening) and turn.opening.endswith("user\n")
    assert rendered[len(turn.opening):].startswith("hello") and turn.closing == "<|im_end|>"


def test_a_template_that_does_not_place_the_users_text_is_refused(target):
    tokenizer = AutoTokenizer.from_pretrained(target)
    tokenizer.chat_template = "{% for m in messages %}<turn>{% endfor %}"
    with pytest.raises(ConfigError, match="does not place a user message's text") as refused:
        UserTurn.of(tokenizer)
    assert refused.value.field == "generated_prompts"


def test_kept_prompts_are_finished_long_enough_and_distinct(tmp_path):
    sample = FakeTarget()
    prompts = GeneratedPrompts(tmp_path, seed=3)
    assert prompts.extend(40, sample) == 40
    texts = [p.text for p in prompts.read()]
    assert len(texts) == len(set(texts)) == 40
    assert all(len(text.split()) >= MIN_WORDS and text == text.strip() for text in texts)
    # Exactly one repeat made it in (its first occurrence), and no turn that ran past its end.
    assert texts.count("please tell me about the same thing again") == 1
    numbers = [int(text.rsplit(" ", 1)[1]) for text in texts if text[-1].isdigit()]
    assert numbers and all(n % 3 and n % 5 and n % 7 for n in numbers)
    assert [p.id for p in prompts.read()[:2]] == [f"{GENERATED}-000000", f"{GENERATED}-000001"]
    # Each attempt has its own seed from the data seed.
    assert sample.seeds[:2] == [(3 << 32) + 0, (3 << 32) + 1]


def test_a_longer_list_extends_a_shorter_one_and_a_resumed_one_is_the_same(tmp_path):
    whole = GeneratedPrompts(tmp_path / "whole", seed=1)
    whole.extend(30, FakeTarget())
    grown = GeneratedPrompts(tmp_path / "grown", seed=1)
    grown.extend(12, FakeTarget())
    assert grown.read() == whole.read()[:12]
    assert grown.extend(30, FakeTarget()) == 18
    assert grown.read() == whole.read()
    assert grown.path.read_text() == whole.path.read_text()
    # Another seed, another list.
    other = GeneratedPrompts(tmp_path / "other", seed=2)
    other.extend(3, FakeTarget())
    assert other.path.read_text() != whole.path.read_text()


def test_a_target_that_writes_no_usable_request_is_refused_with_the_fix(tmp_path):
    def rambles(seeds: Sequence[int]) -> list[tuple[str, bool]]:
        return [(f"and so on and so forth {seed}", False) for seed in seeds]

    with pytest.raises(ConfigError, match="wrote 0 usable requests") as refused:
        GeneratedPrompts(tmp_path, seed=0).extend(3, rambles)
    assert refused.value.field == "generated_prompts" and "--generated-prompts" in refused.value.fix
    with pytest.raises(ConfigError, match="holds 0 of the 3 target-written prompts"):
        GeneratedPrompts(tmp_path, seed=0).first(3)


def test_the_engine_samples_each_seed_the_same_way_whatever_it_runs_beside(target):
    from aphrodite import LLM

    sample = engine_sampler(LLM(model=str(target), dtype="float32", max_num_seqs=4))
    together = sample([11, 12, 13])
    alone = sample([12])
    assert len(together) == 3 and together[1] == alone[0]
    assert len({text for text, _ in together}) == 3
    assert all(isinstance(finished, bool) for _, finished in together)


def test_the_data_step_answers_the_prompts_the_folder_holds(tmp_path, data_dir, target, monkeypatch):
    folder = tmp_path / "data"
    shutil.copytree(data_dir, folder)
    spec = data_spec(target, generated_prompts=3)
    lines = [json.dumps({"attempt": 2 * i, "text": f"please write a note about topic {i}"})
             for i in range(3 + GENERATED_SPARE)]
    (folder / FILE_NAME).write_text("\n".join(lines) + "\n")
    # The folder holds enough written prompts: none is sampled.
    monkeypatch.setattr(data_module, "engine_sampler", lambda llm: pytest.fail("sampled again"))
    data = SelfDistillationData(folder)
    assert data.generate(spec) == 3
    files = data.files(spec)
    assert len(files) == 19 and [path.name for path in files[-3:]] == [f"{GENERATED}-{i:06d}.safetensors" for i in range(3)]
    assert json.loads((folder / "manifest.json").read_text())["generated_prompts"] == 3
    # Held out: the spare prompts, never the trained ones, in their share of the data.
    spare = data.spare(spec)
    assert len(spare) == GENERATED_SPARE and spare[0].text == "please write a note about topic 3"
    held_out = held_out_prompts(spec, 19, spare)
    assert [p.text for p in held_out if p.domain == GENERATED] == [p.text for p in spare[:3]]
    assert len(held_out) == 19
