"""What a Medusa checkpoint holds, read from its config and tensor names (no weights).

Two published layouts:

* FasterDecoding (``medusa_lm_head.pt`` next to a config with ``medusa_num_heads``,
  ``medusa_num_layers``): head ``h`` is ``{h}.{l}.linear.weight/bias`` for its ResBlocks and
  ``{h}.{L}.weight`` for its own LM head. The uploaded configs are known to state another head
  count than the weights hold, so the heads are counted from the weights.
* vLLM's MedusaConfig (``model_type: "medusa"``): ``blocks.{h}.layers.{l}.weight`` (and ``.bias``
  with ``medusa_fc_bias``), ``lm_heads.{h}.weight`` over ``truncated_vocab_size`` tokens, with a
  ``token_map`` to target ids when that is below the vocabulary; ``original_lm_head`` shares one
  LM head across heads. A leading ``medusa_heads.`` is ignored.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sonar_core.errors import ConfigError
from sonar_core.spec_decode.draft_checkpoint import FIELD, DraftCheckpoint
from sonar_medusa.layout_names import FASTERDECODING, VLLM

_PREFIX = "medusa_heads."
_FD_BLOCK = re.compile(r"^(\d+)\.(\d+)\.linear\.(weight|bias)$")
_FD_HEAD = re.compile(r"^(\d+)\.(\d+)\.weight$")
_VLLM_BLOCK = re.compile(r"^blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)$")
_VLLM_HEAD = re.compile(r"^lm_heads\.(\d+)\.weight$")


@dataclass(frozen=True)
class MedusaLayout:
    """A Medusa checkpoint's shape."""

    layout: str
    num_heads: int  # counted from the weights
    num_layers: int  # ResBlocks per head
    hidden_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int  # the heads' (truncated_vocab_size)
    block_bias: bool
    shared_lm_head: bool  # original_lm_head: one LM head for every head
    has_token_map: bool

    def block_name(self, head: int, layer: int, leaf: str) -> str:
        if self.layout == FASTERDECODING:
            return f"{head}.{layer}.linear.{leaf}"
        return f"blocks.{head}.layers.{layer}.{leaf}"

    def lm_head_name(self, head: int) -> str:
        if self.layout == FASTERDECODING:
            return f"{head}.{self.num_layers}.weight"
        return f"lm_heads.{0 if self.shared_lm_head else head}.weight"

    def expected(self) -> dict[str, tuple[int, ...]]:
        """Every tensor name with its shape."""
        hidden = self.hidden_size
        shapes: dict[str, tuple[int, ...]] = {}
        for head in range(self.num_heads):
            for layer in range(self.num_layers):
                shapes[self.block_name(head, layer, "weight")] = (hidden, hidden)
                if self.block_bias:
                    shapes[self.block_name(head, layer, "bias")] = (hidden,)
            shapes[self.lm_head_name(head)] = (self.draft_vocab_size, hidden)
        if self.has_token_map:
            shapes["token_map"] = (self.draft_vocab_size,)
        return shapes

    @staticmethod
    def rename(name: str) -> str:
        return name.removeprefix(_PREFIX)


def read_layout(checkpoint: DraftCheckpoint, hidden_size: int, vocab_size: int) -> MedusaLayout:
    """The layout of ``checkpoint`` for a target of ``hidden_size`` and ``vocab_size``."""
    config = checkpoint.config
    names = [MedusaLayout.rename(name) for name in checkpoint.shapes]
    if "medusa_num_heads" in config or any(_FD_BLOCK.match(n) for n in names):
        heads = {int(m.group(1)) for n in names if (m := _FD_BLOCK.match(n) or _FD_HEAD.match(n))}
        num_layers = _num_layers(config, "medusa_num_layers", checkpoint)
        return MedusaLayout(
            layout=FASTERDECODING, num_heads=_count(heads, checkpoint), num_layers=num_layers,
            hidden_size=hidden_size, vocab_size=vocab_size, draft_vocab_size=vocab_size,
            block_bias=True, shared_lm_head=False, has_token_map=False,
        )
    heads = {int(m.group(1)) for n in names if (m := _VLLM_BLOCK.match(n))}
    draft_vocab = int(config.get("truncated_vocab_size") or vocab_size)
    if draft_vocab < vocab_size and "token_map" not in names:
        raise ConfigError(
            FIELD,
            f"{checkpoint.describe()} predicts over truncated_vocab_size={draft_vocab} of the target's {vocab_size} "
            "tokens but has no token_map",
            "use a checkpoint that ships its token_map (the target id of each head token)",
        )
    return MedusaLayout(
        layout=VLLM, num_heads=_count(heads, checkpoint), num_layers=_num_layers(config, "num_hidden_layers", checkpoint),
        hidden_size=hidden_size, vocab_size=vocab_size, draft_vocab_size=draft_vocab,
        block_bias=bool(config.get("medusa_fc_bias", False)), shared_lm_head=bool(config.get("original_lm_head", False)),
        has_token_map="token_map" in names,
    )


def _count(heads: set[int], checkpoint: DraftCheckpoint) -> int:
    if not heads:
        raise ConfigError(
            FIELD, f"{checkpoint.describe()} holds no Medusa head", "pass a Medusa checkpoint (FasterDecoding or vLLM layout)"
        )
    return max(heads) + 1  # a gap shows up as missing tensors


def _num_layers(config: dict, key: str, checkpoint: DraftCheckpoint) -> int:
    value = config.get(key, 1)
    if not isinstance(value, int) or value < 0:
        raise ConfigError(FIELD, f"{checkpoint.describe()}: {key}={value!r} is not a layer count", "repair config.json")
    return value
