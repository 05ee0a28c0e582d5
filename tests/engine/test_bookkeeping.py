"""Host-side bookkeeping whose cost per step must not grow with the output: the token list of a
request, the outputs of running requests, and the one-decode-per-step detokenizer."""

from __future__ import annotations

import json
import pickle
import random
from pathlib import Path

import pytest

from aphrodite import SamplingParams
from sonar_core.engine.detokenizer import IncrementalDetokenizer
from sonar_core.engine.sequence import Sequence
from sonar_core.engine.stop_checker import apply_stop_conditions
from sonar_core.outputs import ListView, RequestMetrics
from sonar_core.testing.checkpoints import (
    build_bytelevel_tokenizer,
    load_default_model_tokenizer,
    training_corpus,
)

# Accented, CJK and emoji text: characters of 2, 3 and 4 UTF-8 bytes, split across tokens.
MIXED_TEXTS = [
    "Café crème, naïve façade: déjà vu über Zürich.",
    "日本語のテキストと中文字符 mixed with English words.",
    "Emoji 😀🎉 and flags 🇫🇷🇯🇵, a family 👨‍👩‍👧 and ✨ sparkles ✨.",
    "def añadir(a, b):\n    return a + b  # ¿qué? ½ ≠ ∞\n",
    "  leading spaces,   runs of   spaces and a tab\tthen ünïcödé 🙂",
]


class _TwoDecodeDetokenizer:
    """The detokenizer as it was (two decodes per token), the oracle for the one-decode one."""

    def __init__(self, tokenizer, prompt_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self._ids = list(prompt_token_ids[-6:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""

    def append(self, token_ids: list[int]) -> str:
        self._ids.extend(token_ids)
        prefix_text = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=True)
        full_text = self._tokenizer.decode(self._ids[self._prefix_offset :], skip_special_tokens=True)
        if full_text.endswith("\ufffd") or len(full_text) <= len(prefix_text):
            return ""
        new_text = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += new_text
        return new_text


class _CountingTokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.decodes = 0

    def decode(self, ids, skip_special_tokens=True):
        self.decodes += 1
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def bytelevel():
    return build_bytelevel_tokenizer(600)


@pytest.fixture(scope="module")
def bytelevel_with_cleanup(bytelevel):
    """The same, with ``clean_up_tokenization_spaces`` (" ," -> ",", as Llama 3's config asks)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=bytelevel.backend_tokenizer, eos_token=bytelevel.eos_token, clean_up_tokenization_spaces=True
    )


@pytest.fixture(scope="module")
def sentencepiece():
    """A Llama-2 style tokenizer: ``▁`` word pieces, byte fallback for characters it lacks, and a
    decoder that strips the leading space of the text it decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tokenizer.train_from_iterator([*training_corpus(), "Café crème déjà vu über naïve"], trainer)
    spec = json.loads(tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    world = hf.convert_tokens_to_ids("▁the")
    assert hf.decode([world]) == "the"  # a window that starts at a word loses its space
    assert "<0xF0>" in hf.convert_ids_to_tokens(hf.encode("😀", add_special_tokens=False))
    return hf


@pytest.fixture(scope="module")
def default_model_tokenizer():
    return load_default_model_tokenizer()


def _streams(tokenizer, seed: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, output) token id pairs: real text, and random ids (invalid UTF-8 included)."""
    rng = random.Random(seed)
    vocab = len(tokenizer)
    pairs = []
    for text in MIXED_TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        cut = rng.randrange(1, len(ids) - 1)
        pairs.append((ids[:cut], ids[cut:]))
        pairs.append((ids[:1], ids[1:] + tokenizer.encode(" " + text, add_special_tokens=False)))
    long_text = " ".join(MIXED_TEXTS * 3)
    ids = tokenizer.encode(long_text, add_special_tokens=False)
    pairs.append((ids[:3], ids[3:]))
    for _ in range(6):
        pairs.append(([rng.randrange(vocab) for _ in range(rng.randint(1, 9))],
                      [rng.randrange(vocab) for _ in range(rng.randint(20, 120))]))
    return pairs


# ------------------------------------------------------------------------------------ detokenizer
TOKENIZERS = ["bytelevel", "bytelevel_with_cleanup", "sentencepiece", "default_model_tokenizer"]


@pytest.mark.parametrize("name", TOKENIZERS)
def test_one_token_at_a_time_emits_what_two_decodes_did(request, name):
    tokenizer = request.getfixturevalue(name)
    for prompt, output in _streams(tokenizer, seed=1):
        ours, oracle = IncrementalDetokenizer(tokenizer, prompt), _TwoDecodeDetokenizer(tokenizer, prompt)
        for token in output:
            assert ours.append([token]) == oracle.append([token])
        assert ours.text == oracle.text


@pytest.mark.parametrize("name", TOKENIZERS)
def test_several_tokens_at_once_emit_what_two_decodes_did(request, name):
    tokenizer = request.getfixturevalue(name)
    rng = random.Random(2)
    for prompt, output in _streams(tokenizer, seed=2):
        ours, oracle = IncrementalDetokenizer(tokenizer, prompt), _TwoDecodeDetokenizer(tokenizer, prompt)
        start = 0
        while start < len(output):
            chunk = output[start : start + rng.randint(1, 6)]
            start += len(chunk)
            assert ours.append(chunk) == oracle.append(chunk)
        assert ours.text == oracle.text


@pytest.mark.parametrize("name", ["bytelevel", "sentencepiece"])
def test_text_keeps_its_spaces_and_never_holds_half_a_character(request, name):
    tokenizer = request.getfixturevalue(name)
    for text in MIXED_TEXTS:
        prompt = tokenizer.encode("Hello", add_special_tokens=False)
        output = tokenizer.encode("Hello " + text, add_special_tokens=False)[len(prompt) :]
        detokenizer = IncrementalDetokenizer(tokenizer, prompt)
        deltas = [detokenizer.append([token]) for token in output]
        assert "".join(deltas) == detokenizer.text == " " + text
        assert not any("\ufffd" in delta for delta in deltas)
    emoji = tokenizer.encode("a😀", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, emoji[:1])
    assert len(emoji) > 2  # the emoji's four bytes come in several tokens
    assert [detokenizer.append([token]) for token in emoji[1:]] == [""] * (len(emoji) - 2) + ["😀"]


@pytest.mark.parametrize("text", ["plain ascii words and spaces", MIXED_TEXTS[2]], ids=["ascii", "emoji"])
def test_about_one_decode_per_append(bytelevel, text):
    ids = bytelevel.encode(" ".join([text] * 30), add_special_tokens=False)
    counting = _CountingTokenizer(bytelevel)
    detokenizer = IncrementalDetokenizer(counting, ids[:4])
    for token in ids[4:]:
        detokenizer.append([token])
    appends = len(ids) - 4
    # One decode per append, and one more each time the window restarts (every 4 tokens).
    assert counting.decodes <= appends * 1.3 + 2
    assert detokenizer.text == bytelevel.decode(ids)[len(bytelevel.decode(ids[:4])) :]


def test_fast_tokenizers_decode_through_rust_unless_their_decoding_differs(bytelevel, bytelevel_with_cleanup):
    from sonar_core.models.tokenizer_snapshot import rust_decoder

    assert rust_decoder(bytelevel) is bytelevel.backend_tokenizer
    assert rust_decoder(bytelevel_with_cleanup) is None  # cleans up spaces in Python
    assert rust_decoder(_CountingTokenizer(bytelevel)) is None

    class Custom(type(bytelevel)):
        def _decode(self, token_ids, **kwargs):
            return "custom"

    custom = Custom(tokenizer_object=bytelevel.backend_tokenizer)
    assert rust_decoder(custom) is None
    assert IncrementalDetokenizer(custom, [1]).append([40]) == ""  # its own decode, "custom" both times


# --------------------------------------------------------------------------------- stop checking
def _sequence(tokenizer, prompt: list[int], params: SamplingParams) -> Sequence:
    return Sequence(
        request_id="r", prompt=None, prompt_token_ids=prompt, params=params,
        metrics=RequestMetrics(arrival_time=0.0), detokenizer=IncrementalDetokenizer(tokenizer, prompt),
        generator=None, eos_token_ids=frozenset({tokenizer.eos_token_id}),
    )


def test_a_stop_string_inside_a_step_cuts_text_and_tokens(bytelevel):
    ids = bytelevel.encode("the cat sat on the mat and the dog", add_special_tokens=False)
    seq = _sequence(bytelevel, ids[:1], SamplingParams(stop=["mat"]))
    kept = apply_stop_conditions(seq, ids[1:])
    assert seq.finish_reason == "stop" and seq.stop_reason == "mat"
    text = bytelevel.decode(ids)[len(bytelevel.decode(ids[:1])) :]
    assert seq.detokenizer.text == text[: text.index("mat")]
    assert len(kept) < len(ids) - 1 and list(seq.output_token_ids) == kept


# -------------------------------------------------------------------------------------- sequence
def test_the_token_list_grows_in_place(bytelevel):
    prompt = [5, 6, 7]
    seq = _sequence(bytelevel, prompt, SamplingParams())
    tokens = seq.all_token_ids
    seq.output_token_ids.append(8)
    seq.output_token_ids.extend([9, 10])
    assert seq.all_token_ids is tokens and tokens == [5, 6, 7, 8, 9, 10]
    assert seq.output_token_ids == [8, 9, 10] and len(seq.output_token_ids) == 3
    assert seq.prompt_token_ids == [5, 6, 7] and seq.num_tokens == 6
    assert seq.token_slice(2, 5) == [7, 8, 9]
    snapshot = seq.output_token_ids.snapshot()
    seq.output_token_ids.append(11)
    assert snapshot == [8, 9, 10] and seq.output_token_ids[-1] == 11
    seq.output_token_ids = [1, 2]
    assert seq.all_token_ids == [5, 6, 7, 1, 2] and snapshot == [8, 9, 10]


def test_cumulative_logprob_is_the_sum_of_the_logprobs_bit_for_bit(bytelevel):
    rng = random.Random(4)
    seq = _sequence(bytelevel, [1], SamplingParams(logprobs=0))
    assert seq.cumulative_logprob == 0.0
    for _ in range(300):
        seq.output_logprobs.extend(-rng.expovariate(0.3) * 10 ** rng.randint(-8, 2) for _ in range(rng.randint(1, 5)))
        assert seq.cumulative_logprob == sum(seq.output_logprobs)
    seq.output_logprobs = [-1.0, -2.5]
    assert seq.cumulative_logprob == -3.5


def test_a_list_view_reads_like_a_list_and_stays_as_made():
    data = [0, 1, 2, 3, 4, 5, 6]
    view = ListView(data, 2, 6)
    assert len(view) == 4 and list(view) == [2, 3, 4, 5] and view == [2, 3, 4, 5] and [2, 3, 4, 5] == view
    assert view != [2, 3, 4] and view != (2, 3, 4, 5)
    assert (view[0], view[-1], view[1:3], view[::-2], view[5:], view[-10:2]) == (2, 5, [3, 4], [5, 3], [], [2, 3])
    with pytest.raises(IndexError):
        view[4]
    with pytest.raises(IndexError):
        view[-5]
    assert [9] + view == [9, 2, 3, 4, 5] and view + [9] == [2, 3, 4, 5, 9] and view + view == [2, 3, 4, 5] * 2
    assert 3 in view and 6 not in view and view.index(4) == 2 and view.copy() == [2, 3, 4, 5]
    assert repr(view) == "[2, 3, 4, 5]" and json.dumps(list(view)) == "[2, 3, 4, 5]"
    data.append(7)
    assert view == [2, 3, 4, 5] and ListView(data, 5) == [5, 6, 7]
    assert pickle.loads(pickle.dumps(view)) == [2, 3, 4, 5]
    with pytest.raises(TypeError):
        hash(view)


# ---------------------------------------------------------------------------------------- engine
SCRIPTED = str(Path(__file__).with_name("scripted_proposer.py")) + ":ScriptedProposer"


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_outputs_of_running_requests_never_change_and_add_up(make_llm, speculative):
    prompt = [3, 4, 5]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=0)
    plain = make_llm().generate([prompt], params, use_tqdm=False)[0].outputs[0]
    config = None
    if speculative:  # drafts that verification accepts 0, some and all of, in turn
        config = {"method": "custom_class", "custom_class": SCRIPTED, "num_speculative_tokens": 3,
                  "options": {"continuations": [prompt + plain.token_ids]}}
    engine = make_llm(speculative_config=config).engine
    request_id = engine.add_request(prompt, params)
    seen = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            completion = out.outputs[0]
            seen.append((out, list(completion.token_ids), list(completion.logprobs), completion.text))
    final = seen[-1][0]
    assert final.request_id == request_id and final.finished
    completion = final.outputs[0]
    assert type(completion.token_ids) is list and type(completion.logprobs) is list
    assert completion.token_ids == plain.token_ids and completion.text == plain.text
    assert completion.logprobs == pytest.approx(plain.logprobs, abs=1e-5)
    assert (max(len(out.delta_token_ids) for out, *_ in seen) > 1) == speculative
    deltas, text = [], ""
    for out, token_ids, logprobs, text_then in seen:
        # An output kept from an earlier step still shows that step.
        assert out.outputs[0].token_ids == token_ids and list(out.outputs[0].logprobs) == logprobs
        assert token_ids == completion.token_ids[: len(token_ids)] and logprobs == completion.logprobs[: len(logprobs)]
        assert out.outputs[0].cumulative_logprob == sum(logprobs)
        deltas += out.delta_token_ids
        text += out.delta_text
        assert text == text_then
    assert deltas == completion.token_ids and text == completion.text
    assert completion.cumulative_logprob == sum(completion.logprobs)
