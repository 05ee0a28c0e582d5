"""Tiny random checkpoints in the exact on-disk layout of real ones, built offline in a second.

Tests of the engine, the model code and speculation methods need checkpoints whose format is real
(config.json, safetensors, a tokenizer that ``AutoTokenizer.from_pretrained`` loads offline, a chat
template, eos ids) but whose size is not. Typical use in a ``conftest.py``::

    import pytest
    from sonar_core.testing.checkpoints import CheckpointFactory

    @pytest.fixture(scope="session")
    def checkpoints(tmp_path_factory):
        return CheckpointFactory(tmp_path_factory.mktemp("checkpoints"))

    def test_something(checkpoints):
        target = checkpoints.get("qwen3", num_layers=4)          # built once per session
        draft = checkpoints.truncated_draft(target, num_layers=1)  # same vocabulary, first layer

The weights are random but drawn with a large standard deviation (``init_std``), so the logits are
peaked: greedy continuations differ between prompts, and the top two logits are rarely close
enough for float32 rounding to flip an argmax (which would make exact-match tests flaky).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from sonar_core.models.weights import BIN_INDEX, BIN_SINGLE, SAFETENSORS_INDEX, iter_checkpoint, weight_files

ARCHITECTURES = ("llama", "qwen2", "qwen3", "deepseek_v3", "gemma4_text", "gemma4", "qwen3_next")
# Tiny values for family-specific keys whose transformers defaults are full size (256 experts).
# DeepSeek-V3: MLA ranks and head widths, 8 routed experts in 2 groups, one dense layer first.
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v3": dict(
        moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
        topk_group=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16,
    ),
    # Gemma 4: full layers with twice the sliding head size, 8-wide per-layer inputs, a window of
    # 8 positions, the released rope rules (proportional, a quarter rotated, on full layers).
    "gemma4_text": dict(
        global_head_dim=32, hidden_size_per_layer_input=8, sliding_window=8,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
        },
    ),
    # Qwen3-Next: linear attention with 2 key heads serving 4 value heads, full attention every
    # second layer (transformers rotates a quarter of each head by default), 4 experts of which 2
    # per token, and a shared expert of its own width.
    "qwen3_next": dict(
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, full_attention_interval=2, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48,
    ),
}
# Multimodal model_types: (the text model_type that gets the tiny shape, as its text_config; the
# outer config's own defaults, a tiny vision tower). config_overrides of these outer keys stay outer.
_MULTIMODAL: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma4": (
        "gemma4_text",
        {
            "vision_config": dict(
                hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, head_dim=16, patch_size=4, position_embedding_size=64,
            ),
            "audio_config": None,
        },
    ),
}
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
# ChatML, as SmolLM2 and Qwen use it.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_WORDS = (
    "the a one two three four five six seven eight nine ten model token draft target verify accept "
    "reject sample greedy block cache layer head query key value batch step request prompt output "
    "quick brown fox jumps over lazy dog river mountain city garden window paper music light water "
    "speculative decoding inference engine scheduler memory kernel tensor vector matrix number text "
    "little robot loved count story began when where because while after before under between"
).split()
_CODE = (
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "class Node:\n    def __init__(self, value):\n        self.value = value\n",
    "if x > 0 and y < 0:\n    result = x - y\nelse:\n    result = x + y\n",
)


def training_corpus(num_sentences: int = 400, seed: int = 1234) -> list[str]:
    """A deterministic mix of English-like sentences, numbers and code for training the tokenizer."""
    rng = random.Random(seed)
    lines = list(_CODE)
    for _ in range(num_sentences):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        sentence = " ".join(words).capitalize() + rng.choice((".", "!", "?", ",", ";"))
        if rng.random() < 0.3:
            sentence += f" {rng.randint(0, 99999)}"
        lines.append(sentence)
    return lines


def build_bytelevel_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE tokenizer of exactly ``vocab_size`` tokens with ChatML specials.

    Ids 0-2 are ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``. When the corpus runs out of
    merges before ``vocab_size``, ``<extra_N>`` tokens fill the rest so every id a random model can
    emit decodes to text.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be at least {len(alphabet) + len(SPECIAL_TOKENS)} for a byte-level BPE")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(), trainer)
    missing = vocab_size - tokenizer.get_vocab_size()
    if missing > 0:
        tokenizer.add_tokens([f"<extra_{i}>" for i in range(missing)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
    )


def _config(
    arch: str,
    *,
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    tie_word_embeddings: bool,
    max_position_embeddings: int,
    init_std: float,
    eos_token_id: int,
    pad_token_id: int,
    rope_parameters: dict[str, Any] | None,
    config_overrides: dict[str, Any] | None,
) -> Any:
    """The transformers config of ``arch`` (a model_type) with the shared tiny shape, then
    ``config_overrides`` (family-specific keys, which win over the shared ones)."""
    from transformers import AutoConfig

    values: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=init_std,
        rms_norm_eps=1e-6,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, **(rope_parameters or {})},
    )
    text_arch, outer = _MULTIMODAL.get(arch, (arch, None))
    overrides = dict(config_overrides or {})
    outer_values = {key: overrides.pop(key) for key in list(overrides) if outer is not None and key in outer}
    values.update(_FAMILY_DEFAULTS.get(text_arch, {}))
    values.update(overrides)
    values.update({k: v for k, v in _derived_keys(text_arch, values).items() if k not in overrides})
    if outer is None:
        return AutoConfig.for_model(arch, **values)
    shared = {key: values[key] for key in ("tie_word_embeddings", "initializer_range")}  # read from the outer one
    return AutoConfig.for_model(arch, text_config=values, **shared, **{**outer, **outer_values})


def _derived_keys(arch: str, values: dict[str, Any]) -> dict[str, Any]:
    """Keys a family derives from others, which the shared tiny shape must not contradict.

    DeepSeek-V3: ``head_dim`` is the rotary width (transformers computes the rope frequencies from
    it), and MLA has one key head per query head.
    """
    if arch == "deepseek_v3":
        return {"head_dim": values["qk_rope_head_dim"], "num_key_value_heads": values["num_attention_heads"]}
    if arch == "gemma4_text":  # one per-layer embedding row per token
        return {"vocab_size_per_layer_input": values["vocab_size"]}
    return {}


def build_tiny_checkpoint(
    path: Path,
    arch: str = "llama",
    *,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    max_position_embeddings: int = 2048,
    tokenizer: str | Path = "bytelevel",
    sharded: bool = False,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
    init_std: float = 0.3,
    rope_parameters: dict[str, Any] | None = None,
    config_overrides: dict[str, Any] | None = None,
) -> Path:
    """Write a random ``arch`` checkpoint (a model_type of :data:`ARCHITECTURES`) with a tokenizer
    to ``path``.

    ``tokenizer``: ``"bytelevel"`` trains a byte-level BPE of exactly ``vocab_size`` tokens; a path
    copies that folder's tokenizer instead (``vocab_size`` must then be at least its length; use it
    to give a tiny model the vocabulary of a real one). ``sharded`` splits the safetensors into
    several shards with an index. ``head_dim`` defaults to ``hidden_size // num_heads``,
    ``intermediate_size`` to ``2 * hidden_size``. ``rope_parameters`` overrides the rope settings
    (e.g. ``{"rope_type": "llama3", "factor": 8.0, ...}``); ``config_overrides`` sets any other
    config key (a family's own: MoE sizes, layer types). Returns ``path``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if str(tokenizer) == "bytelevel":
        hf_tokenizer = build_bytelevel_tokenizer(vocab_size)
    else:
        hf_tokenizer = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
        if len(hf_tokenizer) > vocab_size:
            raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {len(hf_tokenizer)} tokens")
    config = _config(
        arch,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim or hidden_size // num_heads,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=max_position_embeddings,
        init_std=init_std,
        eos_token_id=hf_tokenizer.eos_token_id,
        pad_token_id=hf_tokenizer.pad_token_id,
        rope_parameters=rope_parameters,
        config_overrides=config_overrides,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    if config.model_type == "qwen3_next":
        _vary_qwen3_next_init(model)
    model.generation_config.eos_token_id = hf_tokenizer.eos_token_id
    model.generation_config.pad_token_id = hf_tokenizer.pad_token_id
    total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # A third of the size gives 3-4 shards; the default limit keeps a single file.
    shard_kwargs = {"max_shard_size": max(total_bytes // 3, 1)} if sharded else {}
    model.save_pretrained(path, **shard_kwargs)
    hf_tokenizer.save_pretrained(path)
    return path


@torch.no_grad()
def _vary_qwen3_next_init(model: torch.nn.Module) -> None:
    """transformers starts Qwen3-Next's zero-centred norms at 0 (scale 1), the gated output norms at
    1 and ``dt_bias`` at 1, and draws decay rates ``exp(A_log)`` up to 16, which forget the
    recurrent state within a token. Parity tests need all of them to matter: norm scales around 1,
    random ``dt_bias``, and decays that keep a state over several tokens."""
    for name, param in model.named_parameters():
        if name.endswith("linear_attn.norm.weight"):
            param.normal_(1.0, 0.1)
        elif name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")) or name == "model.norm.weight":
            param.normal_(0.0, 0.1)
        elif name.endswith("dt_bias"):
            param.normal_(-2.0, 0.5)
        elif name.endswith("A_log"):
            param.uniform_(0.05, 0.5).log_()


_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")
_WEIGHT_FILES = {SAFETENSORS_INDEX, BIN_INDEX, BIN_SINGLE, "config.json"}


def build_truncated_draft(target_dir: Path, out_dir: Path, num_layers: int) -> Path:
    """Write a draft checkpoint that keeps the first ``num_layers`` decoder layers of the target.

    Embedding, final norm, LM head and tokenizer are the target's, so the draft shares its
    vocabulary and agrees with it more often than a random model would: a realistic draft for
    speculative-decoding tests. Returns ``out_dir``.
    """
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    config = json.loads((target_dir / "config.json").read_text())
    if not 0 < num_layers < config["num_hidden_layers"]:
        raise ValueError(f"num_layers must be in 1..{config['num_hidden_layers'] - 1}, got {num_layers}")
    config["num_hidden_layers"] = num_layers
    if config.get("layer_types"):
        config["layer_types"] = config["layer_types"][:num_layers]
    out_dir.mkdir(parents=True, exist_ok=True)
    skip = _WEIGHT_FILES | {p.name for p in weight_files(target_dir)}
    for item in target_dir.iterdir():
        if item.is_file() and item.name not in skip:
            shutil.copy2(item, out_dir / item.name)
    tensors = {}
    for name, tensor in iter_checkpoint(target_dir):
        match = _LAYER_NAME.match(name)
        if match is None or int(match.group(1)) < num_layers:
            tensors[name] = tensor.contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


class CheckpointFactory:
    """Builds each distinct checkpoint once under ``root`` and hands back its folder afterwards.

    Meant for a session-scoped fixture over ``tmp_path_factory`` (see the module docstring), so
    nothing is cached outside pytest's temporary directory.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def _folder(self, kind: str, key: dict[str, Any]) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:12]
        return self.root / f"{kind}-{digest}"

    def get(self, arch: str = "llama", **kwargs: Any) -> Path:
        """:func:`build_tiny_checkpoint` with these arguments, built on first request."""
        folder = self._folder(arch, kwargs)
        if not folder.is_dir():
            # Built aside and renamed, so an interrupted build is never mistaken for a finished one.
            partial = folder.with_name(folder.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            build_tiny_checkpoint(partial, arch, **kwargs)
            partial.rename(folder)
        return folder

    def truncated_draft(self, target_dir: Path, num_layers: int) -> Path:
        """:func:`build_truncated_draft` of ``target_dir``, built on first request."""
        folder = self._folder("draft", {"target": str(target_dir), "num_layers": num_layers})
        if not folder.is_dir():
            partial = folder.with_name(folder.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            build_truncated_draft(target_dir, partial, num_layers)
            partial.rename(folder)
        return folder


def load_default_model_tokenizer() -> Any:
    """The embedded default model's tokenizer (SmolLM2's byte-level BPE with its chat template),
    as transformers reads it from the GGUF file; skips the calling test where the model is not
    installed."""
    import pytest

    from sonar_core.model_files import default_model_path
    from sonar_core.models.gguf import gguf_tokenizer

    try:
        path = default_model_path()
    except FileNotFoundError:
        pytest.skip("the default model is not installed")
    return gguf_tokenizer(path)
