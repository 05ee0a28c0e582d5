"""Turns one step's logits into emitted tokens: plain sampling, or verification of drafts."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sonar_core.engine.model_runner import ModelRunOutput
from sonar_core.engine.scheduler import ScheduledSequence
from sonar_core.sample.sampler import Sampler, SamplingBatch
from sonar_core.spec_decode.rejection_sampler import SpecDecodeMetadata, rejection_sample


@dataclass
class VerifyResult:
    """Per scheduled request (empty where the step does not sample for it)."""

    token_ids: list[list[int]]
    # Drafts accepted per request (0 without drafts).
    num_accepted: list[int]
    # Raw logprob of each emitted token, for requests that asked for logprobs; else None.
    logprobs: list[list[float] | None]


class Verifier:
    """Samples one token per request, or runs the rejection sampler when the batch holds drafts.

    Both paths shape the target distribution through the same sampling code, so temperature,
    top_k, top_p, min_p and per-request seeds mean the same with and without speculation.
    """

    def __init__(self, device: torch.device, backend: str = "auto") -> None:
        self.device = device
        self.backend = backend
        self._sampler = Sampler()

    def __call__(self, run: ModelRunOutput, scheduled: list[ScheduledSequence]) -> VerifyResult:
        sampling = [i for i, item in enumerate(scheduled) if item.samples]
        token_ids: list[list[int]] = [[] for _ in scheduled]
        num_accepted = [0] * len(scheduled)
        logprobs: list[list[float] | None] = [None] * len(scheduled)
        if not sampling:
            return VerifyResult(token_ids, num_accepted, logprobs)
        seqs = [scheduled[i].seq for i in sampling]
        batch = SamplingBatch.from_params(
            [s.params for s in seqs], [s.generator for s in seqs], self.device
        )
        drafts = [scheduled[i].draft_token_ids for i in sampling]
        if any(drafts):
            emitted, accepted = self._verify(run.logits, drafts, [s.draft_probs for s in seqs], batch)
        else:
            out = self._sampler(run.logits, batch)
            emitted = [[t] for t in out.token_ids.tolist()]
            accepted = [0] * len(seqs)
        for slot, i in enumerate(sampling):
            token_ids[i] = emitted[slot]
            num_accepted[i] = accepted[slot]
            if scheduled[i].seq.params.logprobs is not None:
                rows = run.logits[run.logits_rows[i]][: len(emitted[slot])]
                logprobs[i] = _token_logprobs(rows, emitted[slot])
        return VerifyResult(token_ids, num_accepted, logprobs)

    def _verify(
        self,
        logits: torch.Tensor,
        drafts: list[list[int]],
        draft_probs: list[torch.Tensor | None],
        batch: SamplingBatch,
    ) -> tuple[list[list[int]], list[int]]:
        metadata = SpecDecodeMetadata.from_drafts(drafts, self.device)
        probs = _stack_draft_probs(drafts, draft_probs, logits.shape[-1], self.device)
        out = rejection_sample(logits, metadata, probs, batch, backend=self.backend)
        return out.output_token_ids, out.num_accepted


def _stack_draft_probs(
    drafts: list[list[int]],
    draft_probs: list[torch.Tensor | None],
    vocab_size: int,
    device: torch.device,
) -> torch.Tensor | None:
    """[sum of draft lengths, vocab] probabilities, one-hot rows for drafts that came without any.

    Returns None when no request has draft probabilities (the sampler then treats all as one-hot).
    """
    if all(p is None for p in draft_probs):
        return None
    rows = []
    for tokens, probs in zip(drafts, draft_probs, strict=True):
        if not tokens:
            continue
        if probs is None:
            ids = torch.tensor(tokens, device=device)
            probs = torch.nn.functional.one_hot(ids, vocab_size).float()
        rows.append(probs[: len(tokens)].to(device=device, dtype=torch.float32))
    return torch.cat(rows)


def _token_logprobs(rows: torch.Tensor, tokens: list[int]) -> list[float]:
    logp = torch.log_softmax(rows.float(), dim=-1)
    index = torch.tensor(tokens, device=rows.device).unsqueeze(1)
    return logp.gather(1, index).squeeze(1).tolist()
