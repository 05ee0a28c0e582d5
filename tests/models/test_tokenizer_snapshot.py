"""A tokenizer snapshot answers as the transformers tokenizer it stands for, and hands every call it
does not answer itself to that tokenizer; chat templates render as transformers renders them."""

from __future__ import annotations

import pickle
import random
from pathlib import Path

import jinja2
import pytest
from transformers import PreTrainedTokenizerFast

from sonar_core.models.chat_template import is_plain_conversation, render_chat_template
from sonar_core.models.tokenizer_snapshot import (
    SnapshotTokenizer,
    TokenizerSnapshot,
    answers_like,
    take_snapshot,
)
from sonar_core.testing.checkpoints import build_bytelevel_tokenizer, load_default_model_tokenizer


def _snapshot_of(tokenizer, tmp_path: Path) -> SnapshotTokenizer:
    snapshot = take_snapshot(tokenizer, tmp_path / "backend.json", "probe", lambda: tokenizer)
    assert snapshot is not None
    return SnapshotTokenizer(snapshot, "probe", lambda: tokenizer)


@pytest.fixture(scope="module")
def embedded_tokenizer():
    return load_default_model_tokenizer()


@pytest.fixture(scope="module")
def tiny_tokenizer():
    return build_bytelevel_tokenizer(512)


def _random_text(rng: random.Random, specials: list[str]) -> str:
    pieces = []
    for _ in range(rng.randint(1, 12)):
        kind = rng.random()
        if kind < 0.15:
            pieces.append(rng.choice(specials))
        elif kind < 0.35:
            pieces.append("".join(chr(rng.randint(0x20, 0x2FFF)) for _ in range(rng.randint(1, 6))))
        elif kind < 0.45:
            pieces.append(rng.choice((" ", "  ", "\n", "\t", "\r\n", " \n ")))
        else:
            pieces.append(
                rng.choice(("hello", "world", "don't", "x=1;", "café", "🙂", "'s", " .", "...", "東京"))
            )
    return "".join(pieces)


@pytest.mark.parametrize("which", ["embedded_tokenizer", "tiny_tokenizer"])
def test_encodings_decodings_and_chats_match_transformers(which, request, tmp_path):
    real = request.getfixturevalue(which)
    snapshot = _snapshot_of(real, tmp_path)
    specials = list(real.special_tokens_map.values())
    rng = random.Random(7)
    for _ in range(300):
        text = _random_text(rng, specials)
        for special in (True, False):
            ids = real.encode(text, add_special_tokens=special)
            assert snapshot.encode(text, add_special_tokens=special) == ids, text
            for skip in (True, False):
                assert snapshot.decode(ids, skip_special_tokens=skip) == real.decode(
                    ids, skip_special_tokens=skip
                )
    for _ in range(300):  # random ids, invalid UTF-8 pieces and special tokens included
        ids = [rng.randrange(len(real)) for _ in range(rng.randint(1, 8))]
        for skip in (True, False):
            assert snapshot.decode(ids, skip_special_tokens=skip) == real.decode(
                ids, skip_special_tokens=skip
            )
    roles = ("system", "user", "assistant")
    for _ in range(100):
        conversation = [
            {"role": rng.choice(roles), "content": _random_text(rng, specials)}
            for _ in range(rng.randint(1, 5))
        ]
        for prompt in (True, False):
            expected = real.apply_chat_template(conversation, tokenize=False, add_generation_prompt=prompt)
            assert (
                snapshot.apply_chat_template(conversation, tokenize=False, add_generation_prompt=prompt)
                == expected
            )
    assert len(snapshot) == len(real)
    assert snapshot.special_tokens_map == real.special_tokens_map
    assert (snapshot.eos_token_id, snapshot.pad_token_id) == (real.eos_token_id, real.pad_token_id)


def test_what_a_snapshot_does_not_answer_goes_to_the_tokenizer(tiny_tokenizer, tmp_path):
    loads = []

    def load_full():
        loads.append(1)
        return tiny_tokenizer

    snapshot = SnapshotTokenizer(
        take_snapshot(tiny_tokenizer, tmp_path / "backend.json", "probe", load_full), "probe", load_full
    )
    snapshot.encode("a b c")
    snapshot.decode([5, 6, 7])
    snapshot.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert loads == []  # answered from the snapshot
    not_plain = [{"role": "user", "content": "hi", "turn": 3}]
    assert snapshot.apply_chat_template(not_plain, tokenize=False) == tiny_tokenizer.apply_chat_template(
        not_plain, tokenize=False
    )
    plain = [{"role": "user", "content": "hi"}]
    assert (
        snapshot.apply_chat_template(plain, tokenize=True)["input_ids"]
        == tiny_tokenizer.apply_chat_template(plain)["input_ids"]
    )
    assert snapshot(["a", "b c"]).input_ids == tiny_tokenizer(["a", "b c"]).input_ids
    assert snapshot.encode(["a", "b"], is_split_into_words=True) == tiny_tokenizer.encode(
        ["a", "b"], is_split_into_words=True
    )
    assert snapshot.get_vocab() == tiny_tokenizer.get_vocab()
    assert snapshot.decode([[5, 6], [7]]) == tiny_tokenizer.decode([[5, 6], [7]])
    assert loads == [1]  # loaded once, on the first call it did not answer
    assert not snapshot.answers_from_snapshot
    with pytest.raises(AttributeError):
        snapshot.no_such_attribute  # noqa: B018


def test_once_loaded_the_tokenizer_answers_everything(tmp_path):
    """A call the snapshot does not know may change the tokenizer: from then on the transformers
    tokenizer answers the engine's calls too."""
    real = build_bytelevel_tokenizer(512)
    snapshot = _snapshot_of(real, tmp_path)
    snapshot.add_tokens(["<tool>"])
    assert snapshot.encode("a <tool> b") == real.encode("a <tool> b")
    assert len(snapshot) == len(real) == 513
    assert snapshot.decode(real.encode("<tool>")) == "<tool>"
    snapshot.chat_template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    assert real.chat_template == snapshot.chat_template
    assert snapshot.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "[x]"
    snapshot.padding_side = "left"
    assert real.padding_side == "left"
    assert type(pickle.loads(pickle.dumps(snapshot))) is type(real)


def test_a_snapshot_tokenizer_pickles(tiny_tokenizer, tmp_path):
    """Data-parallel replicas send the engine's tokenizer to the front process."""
    snapshot = SnapshotTokenizer(
        take_snapshot(tiny_tokenizer, tmp_path / "backend.json", "probe", _load_tiny), "probe", _load_tiny
    )
    copy = pickle.loads(pickle.dumps(snapshot))
    assert copy.encode("hello world") == snapshot.encode("hello world")
    assert copy.full_tokenizer("hello world").input_ids == tiny_tokenizer("hello world").input_ids


def _load_tiny():
    return build_bytelevel_tokenizer(512)


def test_a_tokenizer_that_decodes_its_own_way_is_not_snapshotted(tiny_tokenizer, tmp_path):
    class Shouting(PreTrainedTokenizerFast):
        def _decode(self, *args, **kwargs):
            return super()._decode(*args, **kwargs).upper()

    shouting = Shouting(tokenizer_object=tiny_tokenizer.backend_tokenizer, eos_token="<|im_end|>")
    assert take_snapshot(shouting, tmp_path / "backend.json", "probe", lambda: shouting) is None


def test_a_snapshot_that_answers_differently_is_refused(tiny_tokenizer, tmp_path):
    snapshot = take_snapshot(tiny_tokenizer, tmp_path / "backend.json", "probe", lambda: tiny_tokenizer)
    edited = TokenizerSnapshot(**{**vars(snapshot), "chat_template": snapshot.chat_template + "!"})
    assert not answers_like(SnapshotTokenizer(edited, "probe", lambda: tiny_tokenizer), tiny_tokenizer)
    other_eos = TokenizerSnapshot(
        **{**vars(snapshot), "token_ids": {**snapshot.token_ids, "eos_token_id": 0}}
    )
    assert not answers_like(SnapshotTokenizer(other_eos, "probe", lambda: tiny_tokenizer), tiny_tokenizer)


# A template using what transformers' environment adds to Jinja's: loop controls, the generation
# block, namespaces, dict(), tojson (non-ASCII kept), raise_exception and the special tokens.
FEATURE_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(count=0) %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'skip' %}{% continue %}{% endif %}"
    "{% set ns.count = ns.count + 1 %}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{% endgeneration %}"
    "{% else %}{{ dict(role=message['role'], text=message['content']) | tojson }}\n{% endif %}"
    "{% if message['content'] == 'stop' %}{% break %}{% endif %}"
    "{% endfor %}"
    "{% if messages[0]['role'] == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}"
    "{{ ns.count }}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}{{ eos_token }}"
)


@pytest.mark.parametrize(
    "conversation",
    [
        [{"role": "user", "content": "café <b>&</b> 東京"}, {"role": "assistant", "content": "ok"}],
        [
            {"role": "skip", "content": "x"},
            {"role": "user", "content": "stop"},
            {"role": "user", "content": "later"},
        ],
        [{"role": "user", "content": "a", "name": None}],
    ],
)
def test_template_features_render_as_in_transformers(tiny_tokenizer, conversation):
    special = tiny_tokenizer.special_tokens_map
    for prompt in (True, False):
        expected = tiny_tokenizer.apply_chat_template(
            conversation, chat_template=FEATURE_TEMPLATE, tokenize=False, add_generation_prompt=prompt
        )
        assert render_chat_template(FEATURE_TEMPLATE, conversation, prompt, special) == expected


def test_template_errors_are_transformers_errors():
    with pytest.raises(jinja2.exceptions.TemplateError, match="no bad roles"):
        render_chat_template(FEATURE_TEMPLATE, [{"role": "bad", "content": "x"}], False, {})
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat_template(
            "{% set ns = namespace(_hidden=1) %}", [{"role": "user", "content": "x"}], False, {}
        )
    with pytest.raises(jinja2.exceptions.SecurityError):  # the sandbox: no reaching interpreter internals
        render_chat_template(
            "{{ messages.__class__.__mro__ }}", [{"role": "user", "content": "x"}], False, {}
        )


@pytest.mark.parametrize(
    ("conversation", "plain"),
    [
        ([{"role": "user", "content": "hi"}], True),
        ([{"role": "user", "content": "hi", "name": None}], True),
        ([], False),
        ([[{"role": "user", "content": "hi"}]], False),  # a batch
        ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], False),
        ([{"role": "assistant", "content": "a", "reasoning_content": "b"}], False),
        ([{"role": "user", "content": 3}], False),
    ],
)
def test_which_conversations_are_plain(conversation, plain):
    assert is_plain_conversation(conversation) == plain
