"""The engine's drafts equal a reference forward written here from the published layouts.

The reference reads the head's safetensors by their published names and recomputes every draft
from scratch: the whole sequence through the head with full causal attention (no paged cache, no
chunks, no rollback), given the target states the engine handed the proposer. Equality of drafts,
not just of outputs, catches what losslessness cannot: the shift-by-one of tokens, the bonus token
in the last slot, RoPE positions, draft KV holes after chunked prefill, stale KV after rejection.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from sonar_eagle import heads

from aphrodite import LLM, SamplingParams
from sonar_core import cpu_kernels
from sonar_core.layers import direct_layers
from sonar_core.testing.reference_ops import causal_self_attention, gated_mlp, rms_norm

PROMPTS = [[5, 9, 12, 40, 7] * 6, [100, 3, 3, 8], list(range(20, 61)), [7] * 3 + list(range(300, 330))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=18, ignore_eos=True)


class Reference:
    """The published EAGLE-1 / EAGLE-3 forward over a whole sequence, in plain torch."""

    def __init__(self, head_dir: Path, target_dir: Path) -> None:
        self.w = load_file(head_dir / "model.safetensors")
        target = load_file(target_dir / "model.safetensors")
        config = json.loads((head_dir / "config.json").read_text())
        self.eagle3 = "d2t" in self.w or any(k.startswith(("midlayer.", "layers.0.hidden_norm")) for k in self.w)
        self.options = config
        layer = config.get("transformer_layer_config", config)
        self.eps = layer["rms_norm_eps"]
        self.theta = (layer.get("rope_parameters") or {}).get("rope_theta", layer.get("rope_theta", 10000.0))
        self.heads = layer["num_attention_heads"]
        self.kv_heads = layer["num_key_value_heads"]
        self.num_layers = layer["num_hidden_layers"]
        self.embed = self.w.get("embed_tokens.weight", target["model.embed_tokens.weight"])
        self.target_lm_head = target["lm_head.weight"]
        if "midlayer.hidden_norm.weight" in self.w:
            self.w = {k.replace("midlayer.", "layers.0."): v for k, v in self.w.items()}
        self.target_ids = None
        if "d2t" in self.w:
            self.target_ids = torch.arange(self.w["d2t"].shape[0]) + self.w["d2t"]

    def _attention(self, prefix: str, z: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return causal_self_attention(self.w, prefix, z, positions, self.heads, self.kv_heads, self.theta, self.eps)

    def _mlp(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        return x + gated_mlp(self.w, prefix, rms_norm(x, self.w[f"{prefix}post_attention_layernorm.weight"], self.eps))

    def _llama_layer(self, index: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        prefix = f"layers.{index}."
        norm = self.w.get(f"{prefix}input_layernorm.weight")
        h = rms_norm(x, norm, self.eps) if norm is not None else x  # EAGLE-1's first layer has no input norm
        return self._mlp(prefix, x + self._attention(prefix, h, positions))

    def first_hidden(self, state: torch.Tensor) -> torch.Tensor:
        """The first-pass hidden input from a target state (EAGLE-3 fuses its aux states)."""
        if not self.eagle3:
            return state
        return state @ self.w["fc.weight"].T

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits of the last row, [R, H] states fed back) for rows at positions 0..R-1."""
        positions = torch.arange(len(tokens))
        embeds = self.embed[tokens]
        if self.eagle3:
            w = self.w
            normed = rms_norm(hidden, w["layers.0.hidden_norm.weight"], self.eps)
            residual = normed if self.options.get("norm_before_residual") else hidden
            z = torch.cat((rms_norm(embeds, w["layers.0.input_layernorm.weight"], self.eps), normed), -1)
            y = self._mlp("layers.0.", residual + self._attention("layers.0.", z, positions))
            for index in range(1, self.num_layers):
                y = self._llama_layer(index, y, positions)
            out = rms_norm(y, w["norm.weight"], self.eps)
            logits = out[-1] @ w["lm_head.weight"].T
            return logits, (out if self.options.get("norm_output") else y)
        x = torch.cat((embeds, hidden), -1) @ self.w["fc.weight"].T
        if "fc.bias" in self.w:
            x = x + self.w["fc.bias"]
        for index in range(self.num_layers):
            x = self._llama_layer(index, x, positions)
        return x[-1] @ self.target_lm_head.T, x

    def drafts(self, token_ids: list[int], states: torch.Tensor, depth: int) -> list[int]:
        """``depth`` greedy drafts after ``token_ids``, given the target states of positions
        0..len-2: row t pairs state t with token t + 1."""
        tokens = torch.tensor(token_ids[1:])
        hidden = self.first_hidden(states)
        drafts = []
        for _ in range(depth):
            logits, fed_back = self.forward(tokens, hidden)
            draft = int(logits.argmax())
            if self.target_ids is not None:
                draft = int(self.target_ids[draft])
            drafts.append(draft)
            tokens = torch.cat((tokens, torch.tensor([draft])))
            hidden = torch.cat((hidden, fed_back[-1:]))
        return drafts


def _record(llm: LLM) -> list[tuple[list[int], torch.Tensor, list[int], int]]:
    """Wrap the proposer: per drafting request and step, (tokens, target states of every earlier
    position, the drafts, the draft budget)."""
    proposer = llm.engine.speculator.proposer
    original = proposer.propose
    states: dict[str, dict[int, torch.Tensor]] = {}
    records = []

    def recording(batch):
        hidden = batch.target_hidden
        source = hidden.final if hidden.aux is None else hidden.aux
        for request in batch.requests:
            known = states.setdefault(request.request_id, {})
            for offset, row in enumerate(range(request.hidden_rows.start, request.hidden_rows.stop)):
                known[request.hidden_start + offset] = source[row].clone()
        proposal = original(batch)
        for request, drafts in zip(batch.requests, proposal.token_ids, strict=True):
            if request.max_draft_tokens:
                known = states[request.request_id]
                rows = torch.stack([known[p] for p in range(len(request.token_ids) - 1)])
                records.append((list(request.token_ids), rows, list(drafts), request.max_draft_tokens))
        return proposal

    proposer.propose = recording
    return records


CASES = {
    "eagle3-speculators": dict(method="eagle3", layout="speculators", draft_vocab_size=128),
    "eagle3-safeailab": dict(method="eagle3", layout="safeailab"),
    "eagle3-two-layers-norm-switches": dict(
        method="eagle3", layout="speculators", num_layers=2, norm_before_residual=True, norm_output=True,
        draft_vocab_size=200,
    ),
    "eagle1": dict(method="eagle", layout="safeailab", num_layers=2),
    "eagle1-own-embedding-no-bias": dict(method="eagle", layout="safeailab", include_embedding=True, fc_bias=False),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("chunked", [False, True], ids=["whole-prefill", "chunked-prefill"])
def test_drafts_equal_the_published_forward(case, chunked, target, make_head):
    options = CASES[case]
    head = make_head(target, **options)
    extra = {"max_num_batched_tokens": 16, "max_num_seqs": 4} if chunked else {}
    llm = LLM(
        model=str(target), dtype="float32", device="cpu",
        # Every chain at full depth, however flat the random head's probabilities.
        speculative_config={"method": options["method"], "model": str(head), "num_speculative_tokens": 4,
                            "draft_stop_confidence": 0},
        **extra,
    )
    records = _record(llm)
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    reference = Reference(head, target)
    assert len(records) > 10
    for tokens, states, drafts, budget in records:
        assert drafts == reference.drafts(tokens, states, budget), f"after {len(tokens)} tokens"


def test_chunked_and_whole_prefill_draft_the_same(target, make_head):
    head = make_head(target, **CASES["eagle3-speculators"])

    def drafts(**extra):
        llm = LLM(model=str(target), dtype="float32", device="cpu",
                  speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}, **extra)
        records = _record(llm)
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        return sorted((tuple(tokens), tuple(d)) for tokens, _, d, _ in records)

    assert drafts() == drafts(max_num_batched_tokens=8, max_num_seqs=4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_first_layer_drafts_the_same_through_one_kernel_call(dtype, target, make_head, monkeypatch):
    """EAGLE-3's first layer runs its attention and MLP as one ``decoder_layers`` call where the
    kernels take the step, and drafts what its modules draft, bit for bit."""
    if cpu_kernels.load() is None:
        pytest.skip(f"CPU kernels unavailable: {cpu_kernels.problem()}")
    head = make_head(target, **CASES["eagle3-two-layers-norm-switches"])
    kernel_calls = 0
    run = direct_layers.run_with_attention_input

    def counted(*args):
        nonlocal kernel_calls
        out = run(*args)
        kernel_calls += out is not None
        return out

    monkeypatch.setattr(heads, "run_with_attention_input", counted)

    def drafts():
        llm = LLM(model=str(target), dtype=dtype, device="cpu",
                  speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": 3})
        records = _record(llm)
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        return [(tuple(tokens), tuple(d)) for tokens, _, d, _ in records]

    direct = drafts()
    assert kernel_calls > 0
    with direct_layers.through_modules():
        modules = drafts()
    assert direct == modules
