"""Fixtures for the model tests: cached tiny checkpoints and a minimal paged-cache driver."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from sonar_core.kv import allocate_kv_cache
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
    """

    def __init__(self, model: CausalLM, num_blocks: int = 128, block_size: int = 4, seed: int = 0) -> None:
        self.model = model
        self.block_size = block_size
        param = next(model.parameters())
        self.device = param.device
        self.caches = allocate_kv_cache(model.kv_cache_specs(), num_blocks, block_size, param.dtype, param.device)
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def metadata(self, new_tokens: dict[str, list[int]], causal: bool = True) -> AttentionMetadata:
        """Grow the sequences by their new tokens (allocating blocks) and build the step's metadata."""
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
        return AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size, self.device, causal)

    @torch.inference_mode()
    def step(
        self, new_tokens: dict[str, list[int]], causal: bool = True, capture_layers: tuple[int, ...] = ()
    ) -> tuple[dict[str, torch.Tensor], dict[int, dict[str, torch.Tensor]]]:
        """One flattened forward. Returns float32 logits ``[q, vocab]`` per sequence and, per
        captured residual-stream state (Sonar's index: after k layers), ``[q, H]`` per sequence."""
        metadata = self.metadata(new_tokens, causal)
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


def hf_model(path: Path) -> torch.nn.Module:
    """The transformers reference model of a checkpoint, float32, eval."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture
def hf_reference() -> object:
    return hf_model
