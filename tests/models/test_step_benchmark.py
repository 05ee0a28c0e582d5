"""transformers compiled for the step benchmark: each timed step sees the cache the eager model sees."""

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from sonar_core.models.step_benchmark import CompiledSteps

CONTEXT = 12


def _eager_logits(model: torch.nn.Module, ids: torch.Tensor, q: int) -> torch.Tensor:
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(ids[None, :CONTEXT], past_key_values=cache, use_cache=True)
        return model(ids[None, CONTEXT : CONTEXT + q], past_key_values=cache, use_cache=True).logits


def _steps_repeat_the_eager_step(model: torch.nn.Module) -> None:
    ids = torch.randint(0, model.config.vocab_size, (CONTEXT + 4,), generator=torch.Generator().manual_seed(0))
    steps = CompiledSteps(model, ids, CONTEXT, max_new_tokens=4, batch=1)
    for q in (1, 3, 1, 3):  # a step that did not rewind the cache would attend to the last one's tokens
        torch.testing.assert_close(steps.step(q), _eager_logits(model, ids, q), rtol=1e-4, atol=1e-4)


def test_each_step_rewinds_the_static_cache(checkpoints, monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda model, **options: model)
    _steps_repeat_the_eager_step(AutoModelForCausalLM.from_pretrained(checkpoints.get("llama")).eval())


@pytest.mark.slow
def test_compiled_steps_give_the_eager_logits(checkpoints, monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # inductor's compiled code, not the user's cache
    torch._dynamo.reset()
    try:
        _steps_repeat_the_eager_step(AutoModelForCausalLM.from_pretrained(checkpoints.get("llama")).eval())
    finally:
        torch._dynamo.reset()
