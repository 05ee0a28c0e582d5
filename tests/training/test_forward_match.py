"""Training runs the drafting code: the unrolled EAGLE-3 steps and the DFlash blocks the trainer
scores are, logit for logit, what the plugins' proposers compute when they draft with the written
head (so a trained head drafts exactly what it was trained to)."""

from __future__ import annotations

import torch
from training_kit import DEPTH, data_spec, draft_eagle3_chain, make_trainer, propose_once, recording_logits

from sonar_core.entrypoints.llm import LLM
from sonar_core.layers.decoder import fused_projections
from sonar_core.sampling_params import SamplingParams
from sonar_core.spec_decode.block_layout import block_layout_of, block_target
from sonar_core.spec_decode.block_proposer import BlockDraftHead, BlockProposer
from sonar_core.spec_decode.chain_proposer import ChainProposer
from sonar_core.spec_decode.draft_checkpoint import DraftCheckpoint
from sonar_core.spec_decode.draft_sampling import DraftSampler
from sonar_core.spec_decode.head_loading import HeadSpec, load_head_checkpoint
from sonar_core.training.data import SelfDistillationData, training_prompts
from sonar_core.training.dataset import StreamingDataset, TrainingSequence
from sonar_core.training.methods.base import FlatBatch


def test_eagle3_unrolled_steps_are_the_chain_proposers_drafts(tmp_path, dataset, training_target):
    chain = draft_eagle3_chain(tmp_path / "head", training_target, dataset)
    trainer, record, m, drafts = chain.trainer, chain.record, chain.m, chain.drafts
    assert len(drafts) == DEPTH

    # The same request as a training sequence whose later tokens are the drafts (teacher forcing).
    tokens = torch.cat([record.token_ids[: m + 1], torch.tensor(drafts)])
    aux = torch.cat([record.aux[:m], torch.zeros(DEPTH, record.aux.shape[1])])
    sequence = TrainingSequence(tokens, aux, torch.zeros(m + DEPTH, training_target.hidden_size))
    with torch.no_grad():
        for step, rows, out in trainer.unroll(FlatBatch([sequence])):
            logits = trainer.head.compute_logits(out[rows == m - 1])
            torch.testing.assert_close(logits, chain.recorded[step], rtol=1e-4, atol=1e-4)
            assert int(chain.vocab_map.to_target(logits.argmax(-1))) == drafts[step]


def test_dflash_training_blocks_are_the_block_proposers(tmp_path, dataset, training_target):
    trainer = make_trainer("dflash", training_target, dataset, depth=DEPTH, seed=3)
    head_dir = trainer.export(tmp_path / "head", torch.float32)
    checkpoint = DraftCheckpoint.open(str(head_dir))
    layout = block_layout_of(checkpoint, block_target(training_target.modules))
    spec = HeadSpec(build=lambda modules: BlockDraftHead(layout, modules), fused=fused_projections(layout.layer),
                    vocab_size=layout.vocab_size, draft_vocab_size=layout.draft_vocab_size)
    head, vocab_map = load_head_checkpoint(checkpoint, spec, training_target.modules, torch.float32, torch.device("cpu"))
    recorded = recording_logits(head)
    record = dataset.load([0], trainer.layers, final=True)[0]
    p = min(record.num_rows - DEPTH, 20)  # the anchor: the newest token sits at position p
    drafts = propose_once(BlockProposer(head, DraftSampler(vocab_map, False, "cpu")), record.token_ids[: p + 1].tolist(),
                      p, record.aux, trainer.layers, training_target.hidden_size)
    assert len(drafts) == DEPTH

    with torch.no_grad():
        slots = trainer.block_states(FlatBatch([record]), torch.tensor([p]))
        for slot in range(1, DEPTH + 1):
            logits = trainer.head.compute_logits(slots[:, slot])
            torch.testing.assert_close(logits, recorded[slot - 1], rtol=1e-4, atol=1e-4)
            assert int(logits.argmax(-1)) == drafts[slot - 1]


def test_the_engines_drafts_are_the_trainers_predictions(tmp_path, monkeypatch, data_dir, dataset, training_target,
                                                         target):
    """End to end: the engine, drafting with the written head while it answers the training
    prompts, proposes at every step exactly the token the trainer's first unrolled step predicts
    for that row of the exported data (the live target states are the exported ones, at the same
    rows; the draft vocabulary maps back to the same ids)."""
    trainer = make_trainer("eagle3", training_target, dataset, depth=DEPTH, seed=3)
    head_dir = trainer.export(tmp_path / "head", torch.float32)
    drafted: list[tuple[list[int], int]] = []
    propose = ChainProposer.propose

    def recording(self, batch):
        proposal = propose(self, batch)
        drafted.extend((list(r.token_ids), ids[0]) for r, ids in zip(batch.requests, proposal.token_ids, strict=True)
                       if ids)
        return proposal

    monkeypatch.setattr(ChainProposer, "propose", recording)
    spec = data_spec(target)
    llm = LLM(model=str(target), dtype="float32", max_num_seqs=spec.max_num_seqs,
              speculative_config={"method": "eagle3", "model": str(head_dir), "num_speculative_tokens": DEPTH,
                                  "draft_stop_confidence": 0})
    prompts = training_prompts(spec)
    llm.chat([list(p.messages) for p in prompts], SamplingParams(temperature=0.0, max_tokens=spec.max_tokens),
             use_tqdm=False)

    vocab = trainer.draft_vocab
    whole = StreamingDataset(SelfDistillationData(data_dir).files(spec), 10_000, 10_000)  # records uncut
    predicted: dict[tuple[int, ...], tuple[int, float]] = {}  # token prefix -> (prediction, top-2 margin)
    for index in range(len(whole.records)):
        record = whole.load([index], trainer.layers, final=True)[0]
        with torch.no_grad():
            step, rows, out = next(iter(trainer.unroll(FlatBatch([record]))))
            top = trainer.head.compute_logits(out).topk(2, dim=-1)
        tokens = record.token_ids.tolist()
        for row, best, values in zip(rows.tolist(), top.indices[:, 0].tolist(), top.values.tolist(), strict=True):
            predicted[tuple(tokens[: row + 2])] = (int(vocab[best]), values[0] - values[1])
    assert len(drafted) > 2 * len(prompts)
    mismatched = [(tokens, draft) for tokens, draft in drafted
                  if predicted[tuple(tokens)][0] != draft and predicted[tuple(tokens)][1] > 1e-3]
    assert not mismatched
