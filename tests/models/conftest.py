"""Fixtures for the model tests: cached tiny checkpoints and a minimal paged-cache driver."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from sonar_core import cpu_kernels
from sonar_core.kv import RecurrentStateCache, StateBatch, allocate_kv_cache
from sonar_core.layers import attention
from sonar_core.layers.attention import AttentionMetadata
from sonar_core.models.base import CausalLM
from sonar_core.models.hidden_capture import HiddenStateCapture
from sonar_core.testing.checkpoints import CheckpointFactory


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> CheckpointFactory:
    return CheckpointFactory(tmp_path_factory.mktemp("model-checkpoints"))


class PagedRunner:
    """Drives a model over a paged cache the way the engine does, with a naive block allocator.

    Blocks are handed out from a shuffled free list (block 0 included), so block tables are
    scattered and padding entries of a table point at blocks other sequences really use: a mask
    or gather bug shows up as wrong logits instead of hiding behind zeros.

    Models with recurrent layers (``state_specs()``) get a :class:`RecurrentStateCache` of
    ``num_slots`` requests filled with noise, so a row that should start from zeros but reads its
    slot shows up too; ``keep_positions`` of a step and :meth:`commit` drive speculative rows.
    """

    def __init__(
        self,
        model: CausalLM,
        num_blocks: int = 128,
        block_size: int = 4,
        seed: int = 0,
        num_slots: int = 8,
        max_positions: int = 6,
    ) -> None:
        self.model = model
        self.block_size = block_size
        param = next(model.parameters())
        self.device = param.device
        self.caches = allocate_kv_cache(model.kv_cache_specs(), num_blocks, block_size, param.dtype, param.device)
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}
        self.states: RecurrentStateCache | None = None
        state_specs = model.state_specs()
        if state_specs:
            self.states = RecurrentStateCache(state_specs, num_slots, max_positions, param.dtype, param.device)
            generator = torch.Generator(device=param.device).manual_seed(seed)
            for layer in self.states.layers:
                for tensor in (layer.conv, layer.recurrent, layer.conv_positions, layer.recurrent_positions):
                    tensor.copy_(torch.randn(tensor.shape, generator=generator, device=param.device))
        self.kept: dict[str, int] = {}

    def metadata(
        self, new_tokens: dict[str, list[int]], causal: bool = True, keep_positions: dict[str, int] | None = None
    ) -> AttentionMetadata:
        """Grow the sequences by their new tokens (allocating blocks) and build the step's metadata
        (with its StateBatch for models with recurrent layers: ``keep_positions`` per sequence,
        default 0)."""
        keep_positions = keep_positions or {}
        starts = [self.lens.get(seq, 0) for seq in new_tokens]
        query_lens, seq_lens, tables = [], [], []
        for seq, tokens in new_tokens.items():
            table = self.tables.setdefault(seq, [])
            seq_len = self.lens.get(seq, 0) + len(tokens)
            while len(table) * self.block_size < seq_len:
                table.append(self.free.pop())
            self.lens[seq] = seq_len
            query_lens.append(len(tokens))
            seq_lens.append(seq_len)
            tables.append(table)
        metadata = AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size, self.device, causal)
        if self.states is not None:
            self.kept = {seq: keep_positions.get(seq, 0) for seq in new_tokens}
            metadata.state = StateBatch(
                cache=self.states,
                slots=[self.states.acquire(seq) for seq in new_tokens],
                has_initial_state=[start > 0 for start in starts],
                keep_positions=list(self.kept.values()),
            )
        return metadata

    def commit(self, accepted: dict[str, int]) -> None:
        """After a step whose rows kept positions: commit the state after each sequence's
        ``accepted`` drafts and drop its rejected tokens from the KV lengths."""
        assert self.states is not None
        self.states.commit([self.states.acquire(seq) for seq in accepted], list(accepted.values()))
        for seq, count in accepted.items():
            self.lens[seq] -= self.kept[seq] - 1 - count

    @torch.inference_mode()
    def step(
        self,
        new_tokens: dict[str, list[int]],
        causal: bool = True,
        capture_layers: tuple[int, ...] = (),
        keep_positions: dict[str, int] | None = None,
    ) -> tuple[dict[str, torch.Tensor], dict[int, dict[str, torch.Tensor]]]:
        """One flattened forward. Returns float32 logits ``[q, vocab]`` per sequence and, per
        captured residual-stream state (Sonar's index: after k layers), ``[q, H]`` per sequence."""
        metadata = self.metadata(new_tokens, causal, keep_positions)
        flat = [t for tokens in new_tokens.values() for t in tokens]
        input_ids = torch.tensor(flat, dtype=torch.int64, device=self.device)
        capture = None
        if capture_layers:
            modules = self.model.shared_modules()
            capture = HiddenStateCapture(
                capture_layers, modules.num_layers, modules.hidden_size, len(flat), self.caches[0][0].dtype,
                self.device,
            )
        hidden = self.model(input_ids, metadata.positions, self.caches, metadata, capture)
        logits = self.model.compute_logits(hidden)
        starts = metadata.query_start_loc.tolist()
        rows = {seq: slice(starts[i], starts[i + 1]) for i, seq in enumerate(new_tokens)}
        per_seq = {seq: logits[r] for seq, r in rows.items()}
        layers = {
            layer: {seq: capture.buffer[r, capture.columns(layer)].clone() for seq, r in rows.items()}
            for layer in capture_layers
        }
        return per_seq, layers

    def greedy(self, prompts: dict[str, list[int]], max_new_tokens: int, eos_ids: list[int]) -> dict[str, list[int]]:
        """Greedy continuations of all prompts, decoded together in one batch per step."""
        outputs: dict[str, list[int]] = {seq: [] for seq in prompts}
        pending = dict(prompts)
        while pending:
            logits, _ = self.step(pending)
            pending = {}
            for seq, rows in logits.items():
                token = int(rows[-1].argmax())
                outputs[seq].append(token)
                if token not in eos_ids and len(outputs[seq]) < max_new_tokens:
                    pending[seq] = [token]
        return outputs


@pytest.fixture
def paged_runner() -> type[PagedRunner]:
    return PagedRunner


@pytest.fixture
def pin_in_place_limit(monkeypatch: pytest.MonkeyPatch):
    """``pin(n)``: steps of up to ``n`` queries per sequence attend in place for the rest of the
    test, whatever their length, dtype and block size, where the loaded kernels verify in place
    (8: AVX2 builds; ``sys.maxsize``: AVX-512 builds), decode steps only where they do not."""

    def pin(limit: int) -> None:
        policy = attention.InPlacePolicy(limit if cpu_kernels.attention_verifies_in_place() else 1)
        monkeypatch.setattr(attention, "in_place_policy", lambda dtype: policy)

    return pin


def hf_model(path: Path) -> torch.nn.Module:
    """The transformers reference model of a checkpoint, float32, eval."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture
def hf_reference() -> object:
    return hf_model
