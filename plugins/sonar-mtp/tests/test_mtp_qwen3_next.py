"""MTP on Qwen3-Next targets (``mtp.*``, FORMATS.md 5.3): the first draft equals a reference built
from transformers' own Qwen3-Next modules, the old name ``qwen3_next_mtp`` maps to ``mtp``, and a
layout Sonar cannot run is refused at the configuration check. (Greedy losslessness on this
hybrid target, with every accepted length, is tests/engine/test_hybrid_speculation.py.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from aphrodite import LLM
from sonar_core.errors import ConfigError
from sonar_core.testing.losslessness import greedy_outputs, random_prompts
from sonar_core.testing.mtp_layers import build_qwen3_next_target
from sonar_core.testing.plugin_checks import check_drafts, validate_for_target

LAYERS = 4


def _prompts() -> list[list[int]]:
    return random_prompts(5, seed=9, vocab=500, max_len=30)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_qwen3_next_target(tmp_path_factory.mktemp("qwen3-next-mtp") / "t", num_layers=LAYERS)


class TransformersQwen3NextMtp:
    """The MTP forward of FORMATS.md 5.3 over transformers' modules: the target's final states,
    ``fc(concat[pre_fc_norm_embedding(e), pre_fc_norm_hidden(h)])`` through the full model's last
    decoder layer (the one the checkpoint stores as ``mtp.layers.0``), ``mtp.norm``, the LM head."""

    def __init__(self, target: Path) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

        self.main = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        self.full = AutoModelForCausalLM.from_pretrained(target.with_name(target.name + "-full"), dtype=torch.float32)
        self.block = self.full.model.layers[LAYERS].eval()
        weights = load_file(target / "model.safetensors")
        hidden = self.main.config.hidden_size
        eps = self.main.config.rms_norm_eps
        self.norms = {}
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            norm = Qwen3NextRMSNorm(hidden, eps)
            norm.weight.data.copy_(weights[f"mtp.{name}.weight"])
            self.norms[name] = norm
        self.fc = weights["mtp.fc.weight"]

    @torch.no_grad()
    def first_draft(self, token_ids: list[int]) -> int:
        tokens = torch.tensor([token_ids])
        states = self.main(tokens[:, :-1], output_hidden_states=True).hidden_states[-1]
        embeds = self.main.model.embed_tokens(tokens[:, 1:])
        fused = torch.cat([self.norms["pre_fc_norm_embedding"](embeds), self.norms["pre_fc_norm_hidden"](states)], -1)
        u = fused @ self.fc.T
        length = u.shape[1]
        positions = torch.arange(length)[None]
        causal = torch.full((length, length), float("-inf")).triu(1)[None, None]
        y = self.block(u, position_embeddings=self.full.model.rotary_emb(u, positions), attention_mask=causal)
        y = y[0] if isinstance(y, tuple) else y
        return int(self.main.lm_head(self.norms["norm"](y))[0, -1].argmax())


def test_the_first_draft_equals_the_reference_mtp_forward(target):
    llm = LLM(model=str(target), dtype="float32", device="cpu",
              speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    oracle = TransformersQwen3NextMtp(target)
    assert check_drafts(llm, _prompts(), lambda batch, request: [oracle.first_draft(request.token_ids)]) > 10


def test_the_old_name_maps_to_mtp_and_stays_lossless(target):
    resolved = validate_for_target(target, "mtp", method="qwen3_next_mtp", num_speculative_tokens=2)
    assert resolved.method == "mtp" and any("old name" in warning for warning in resolved.warnings)
    reference = greedy_outputs(target, _prompts())[0]
    tokens, llm = greedy_outputs(target, _prompts(), {"method": "qwen3_next_mtp", "num_speculative_tokens": 2})
    assert tokens == reference and llm.get_spec_decode_metrics().num_draft_tokens > 0


def test_more_than_one_mtp_layer_is_refused_at_the_check(target, tmp_path):
    copy = tmp_path / "two-layers"
    shutil.copytree(target, copy)
    config = json.loads((copy / "config.json").read_text())
    config["num_nextn_predict_layers"] = 2
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="num_nextn_predict_layers=2.*at most 1 layer"):
        validate_for_target(copy, "mtp", method="mtp")
