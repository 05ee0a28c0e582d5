"""The draft_model method end to end: losslessness, vocabulary rules and the intersection map."""

from pathlib import Path

import pytest
import torch
from sonar_draft_model.vocab import VocabularyIntersection
from transformers import AutoTokenizer

from aphrodite import LLM, SamplingParams
from sonar_core.errors import ConfigError

PROMPTS = ["the quick brown fox", "def add(a, b):\n    return", "hello hello hello", "numbers 1 2 3 4"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def _tokens(model: Path, speculative_config=None) -> tuple[list[list[int]], LLM]:
    llm = LLM(model=str(model), dtype="float32", device="cpu", speculative_config=speculative_config)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm


def test_heterogeneous_vocabulary_is_lossless(target: Path, foreign_draft: Path):
    reference, _ = _tokens(target)
    config = {
        "method": "draft_model",
        "model": str(foreign_draft),
        "num_speculative_tokens": 3,
        "use_heterogeneous_vocab": True,
    }
    tokens, llm = _tokens(target, config)
    assert tokens == reference
    assert llm.get_spec_decode_metrics().num_draft_tokens > 0


def test_different_vocabulary_needs_the_heterogeneous_option(target: Path, foreign_draft: Path):
    config = {"method": "draft_model", "model": str(foreign_draft), "num_speculative_tokens": 3}
    with pytest.raises(ConfigError, match="use_heterogeneous_vocab"):
        LLM(model=str(target), dtype="float32", device="cpu", speculative_config=config)


def test_heterogeneous_vocabulary_rejects_probabilistic_drafting(target: Path, foreign_draft: Path):
    config = {
        "method": "draft_model",
        "model": str(foreign_draft),
        "use_heterogeneous_vocab": True,
        "draft_sample_method": "probabilistic",
    }
    with pytest.raises(ConfigError, match="greedy"):
        LLM(model=str(target), dtype="float32", device="cpu", speculative_config=config)


def test_draft_model_needs_a_checkpoint(target: Path):
    with pytest.raises(ConfigError, match="model"):
        LLM(model=str(target), dtype="float32", device="cpu",
            speculative_config={"method": "draft_model", "num_speculative_tokens": 2})


def test_probabilistic_drafting_with_a_truncated_draft_keeps_greedy_output(target: Path, draft: Path):
    reference, _ = _tokens(target)
    config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4,
              "draft_sample_method": "probabilistic"}
    tokens, llm = _tokens(target, config)
    assert tokens == reference
    summary = llm.get_spec_decode_metrics()
    assert 0 < summary.num_accepted_tokens <= summary.num_draft_tokens


def test_intersection_maps_shared_strings_both_ways(target: Path, foreign_draft: Path):
    target_tok = AutoTokenizer.from_pretrained(target)
    draft_tok = AutoTokenizer.from_pretrained(foreign_draft)
    vocab = VocabularyIntersection(target_tok, draft_tok, torch.device("cpu"))
    shared = target_tok.get_vocab().keys() & draft_tok.get_vocab().keys()
    assert vocab.size == len(shared) > 256
    for token in list(shared)[:50]:
        t, d = target_tok.get_vocab()[token], draft_tok.get_vocab()[token]
        assert vocab.to_draft(torch.tensor([t])).item() == d
        assert vocab.to_target(torch.tensor([d])).item() == t
    masked = vocab.mask_logits(torch.zeros(1, len(draft_tok)))
    assert torch.isfinite(masked).sum().item() == len(shared)
