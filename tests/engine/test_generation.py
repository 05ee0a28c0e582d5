"""End-to-end behaviour of the engine without speculation."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from aphrodite import SamplingParams
from sonar_core.config import EngineConfig
from sonar_core.engine.llm_engine import LLMEngine
from sonar_core.engine.request_errors import RequestError

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _mixed_prompts(count: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(1, 40))] for _ in range(count)]


def test_greedy_matches_transformers_generate(make_llm, tiny_model):
    llm = make_llm()
    reference = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    for prompt in _mixed_prompts(4, llm.engine.hf_config.vocab_size, seed=1):
        ours = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        with torch.no_grad():
            theirs = reference.generate(
                torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                pad_token_id=0,
            )[0, len(prompt):].tolist()
        assert ours == theirs


def test_batch_invariance_of_greedy_output(make_llm):
    llm = make_llm(max_num_seqs=16)
    prompts = _mixed_prompts(16, llm.engine.hf_config.vocab_size, seed=2)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    alone = [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert batched == alone


def test_preemption_under_a_tiny_kv_cache_gives_the_same_outputs(make_llm):
    roomy = make_llm(max_num_seqs=8)
    prompts = _mixed_prompts(8, roomy.engine.hf_config.vocab_size, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    # 40 blocks of 4 tokens (2 layers x K/V x 2 heads x 16 dims x 4 bytes = 2048 bytes a block):
    # room for about 2.5 full requests, so later ones preempt earlier ones, which are recomputed.
    tight = make_llm(max_num_seqs=8, block_size=4, max_model_len=64, kv_cache_memory_gb=40 * 2048 / 2**30)
    outputs = tight.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    engine = tight.engine
    assert engine.block_manager.num_blocks == 40
    assert engine.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_seeded_sampling_is_reproducible_regardless_of_neighbours(make_llm):
    llm = make_llm()
    vocab = llm.engine.hf_config.vocab_size
    prompt = [5, 6, 7, 8]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = _mixed_prompts(5, vocab, seed=4)
    params = [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)] * 5 + [seeded]
    crowded = llm.generate(others + [prompt], params, use_tqdm=False)[-1].outputs[0].token_ids
    assert alone == crowded
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=20, ignore_eos=True)
    assert llm.generate([prompt], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_max_tokens_and_stop_token_ids_end_requests(make_llm):
    llm = make_llm()
    out = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 16 and out.finish_reason == "length"
    stop_at = out.token_ids[5]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop_at])
    stopped = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0]
    first = out.token_ids.index(stop_at)
    assert stopped.token_ids == out.token_ids[: first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_at


def test_stop_strings_truncate_the_text(make_llm):
    llm = make_llm()
    full = llm.generate(["once upon a time"], GREEDY, use_tqdm=False)[0].outputs[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop])
    out = llm.generate(["once upon a time"], params, use_tqdm=False)[0].outputs[0]
    assert out.text == full.text[: full.text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_abort_frees_every_block(make_llm):
    llm = make_llm()
    engine = llm.engine
    ids = [engine.add_request(p, GREEDY) for p in _mixed_prompts(6, engine.hf_config.vocab_size, seed=5)]
    engine.step()
    engine.step()
    for request_id in ids[::2]:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_logprobs_and_timing_are_reported(make_llm):
    llm = make_llm()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    out = llm.generate([[4, 5, 6]], params, use_tqdm=False)[0]
    completion = out.outputs[0]
    assert len(completion.logprobs) == 8 and all(lp <= 0 for lp in completion.logprobs)
    assert completion.cumulative_logprob == pytest.approx(sum(completion.logprobs))
    assert out.metrics.time_to_first_token > 0
    assert len(out.metrics.inter_token_latencies) == 7


def test_bad_requests_are_rejected_and_lose_nothing(make_llm):
    llm = make_llm(max_model_len=32)
    engine = llm.engine
    good = engine.add_request([1, 2, 3], GREEDY)
    with pytest.raises(RequestError, match="max_model_len"):
        engine.add_request(list(range(40)), GREEDY)
    with pytest.raises(RequestError, match="max_tokens"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=31))
    with pytest.raises(RequestError, match="vocabulary"):
        engine.add_request([10**9], GREEDY)
    with pytest.raises(RequestError, match="empty"):
        engine.add_request([], GREEDY)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == [good]


def test_engine_rejects_unknown_configuration():
    with pytest.raises(Exception, match="max_num_seqs"):
        LLMEngine(EngineConfig.build(max_num_seqs=0))
