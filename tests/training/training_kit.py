"""Helpers of the training tests: the tiny target's data settings and a seeded head of any method."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from sonar_core.kv import allocate_kv_cache
from sonar_core.spec_decode.chain_proposer import ChainProposer, ChainStops
from sonar_core.spec_decode.draft_checkpoint import DraftCheckpoint
from sonar_core.spec_decode.draft_sampling import DraftSampler
from sonar_core.spec_decode.proposer import ProposalRequest, ProposeBatch, TargetHiddenStates
from sonar_core.spec_decode.vocab_map import DraftVocabularyMap
from sonar_core.training.data import DataSpec
from sonar_core.training.dataset import StreamingDataset, TrainingSequence
from sonar_core.training.loop import TrainSettings
from sonar_core.training.methods import build_trainer, reduces_vocabulary
from sonar_core.training.methods.base import HeadOptions, HeadTrainer
from sonar_core.training.target import TrainingTarget, draft_vocabulary

# Eight layers, so that EAGLE-3's default states (2, L/2, L-3) = (2, 4, 5) are distinct.
TARGET_LAYERS = 8
LAYERS = (2, 4, 5)
DRAFT_VOCAB = 128
SETTINGS = TrainSettings(epochs=3, learning_rate=3e-3, warmup_steps=2, batch_rows=128, max_rows=96, save_every=4)


def data_spec(target: Path, **changes) -> DataSpec:
    # Two answers at a time: chunks of 8 prompts, so that 16 prompts make two.
    fields = dict(model=str(target), num_prompts=16, max_tokens=24, seed=0, dtype="float32", layer_ids=LAYERS,
                  max_num_seqs=2)
    fields.update(changes)
    return DataSpec(**fields)


def make_trainer(method: str, training_target: TrainingTarget, dataset: StreamingDataset, depth: int = 3,
                 seed: int = 0, labels: str = "choice", num_layers: int = 1) -> HeadTrainer:
    """A freshly initialised head of ``method`` for the tiny target (seeded), learning ``labels``,
    with ``num_layers`` draft layers."""
    counts = dataset.answer_token_counts(training_target.vocab_size)
    size = DRAFT_VOCAB if reduces_vocabulary(method) else training_target.vocab_size
    torch.manual_seed(seed)
    options = HeadOptions(depth=depth, draft_vocab_size=DRAFT_VOCAB, labels=labels, num_layers=num_layers)
    return build_trainer(method, training_target, options, draft_vocabulary(counts, size), dataset.layer_ids,
                         training_target.vocab_size - 1)


# Block size and draft depth of the drafting tests.
BLOCK = 16
DEPTH = 3


def recording_logits(head: torch.nn.Module) -> list[torch.Tensor]:
    """Record every logits tensor the head computes while it drafts."""
    recorded: list[torch.Tensor] = []
    compute = head.compute_logits

    def record(out: torch.Tensor) -> torch.Tensor:
        recorded.append(compute(out))
        return recorded[-1]

    head.compute_logits = record
    return recorded


def propose_once(proposer, tokens: list[int], context_rows: int, aux: torch.Tensor, layers, hidden_size: int) -> list[int]:
    """One propose call for a request whose target has read ``context_rows`` positions."""
    head_kv = proposer.capabilities.kv_layers
    blocks = (len(tokens) + BLOCK + DEPTH) // BLOCK + 1
    request = ProposalRequest(
        request_id="r", token_ids=tokens, num_new_tokens=len(tokens), max_draft_tokens=DEPTH,
        block_table=list(range(blocks)), hidden_rows=slice(0, context_rows), hidden_start=0,
    )
    batch = ProposeBatch(
        requests=[request], block_size=BLOCK, kv_caches=allocate_kv_cache(list(head_kv), blocks, BLOCK, torch.float32, "cpu"),
        device=torch.device("cpu"), target_hidden=TargetHiddenStates(layers, hidden_size, aux=aux[:context_rows]),
    )
    return proposer.propose(batch).token_ids[0]


@dataclass
class DraftedChain:
    """A seeded EAGLE-3 head, loaded as its plugin loads it, and the chain it drafts for the first
    training answer once the target has read positions ``0 .. m - 1`` and sampled token ``m``."""

    trainer: HeadTrainer
    head: torch.nn.Module
    vocab_map: DraftVocabularyMap
    recorded: list[torch.Tensor]  # every logits tensor the head computed, the chain's first
    record: TrainingSequence
    m: int
    drafts: list[int]


def draft_eagle3_chain(out_dir: Path, training_target: TrainingTarget, dataset: StreamingDataset) -> DraftedChain:
    """Export a seeded EAGLE-3 head to ``out_dir``, load it back and draft one chain of DEPTH."""
    from sonar_eagle.loading import load_head

    trainer = make_trainer("eagle3", training_target, dataset, depth=DEPTH, seed=3)
    head_dir = trainer.export(out_dir, torch.float32)
    head, vocab_map = load_head(DraftCheckpoint.open(str(head_dir)), "eagle3", training_target.modules,
                                torch.float32, torch.device("cpu"))
    recorded = recording_logits(head)
    record = dataset.load([0], trainer.layers, final=True)[0]
    m = min(record.num_rows, 20)
    drafts = propose_once(ChainProposer(head, DraftSampler(vocab_map, False, "cpu"), ChainStops(0.0, 0.0)), record.token_ids[: m + 1].tolist(),
                          m, record.aux, trainer.layers, training_target.hidden_size)
    return DraftedChain(trainer, head, vocab_map, recorded, record, m, drafts)
