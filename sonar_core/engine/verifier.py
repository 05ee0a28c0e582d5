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
    # Per scheduled request: 0 when its own drafts were verified, b when its draft branch b - 1
    # was (its first draft was the target's token there).
    winners: list[int]


@dataclass
class _Chains:
    """The chains verified for one request: its own drafts, then each draft branch's."""

    tokens: list[list[int]]
    logits_rows: list[slice]
    probs: list[torch.Tensor | None]


class Verifier:
    """Samples one token per request, or runs the rejection sampler when the batch holds drafts.

    Both paths shape the target distribution through the same sampling code, so temperature,
    top_k, top_p, min_p and per-request seeds mean the same with and without speculation.

    A request with draft branches has several candidate first drafts, each leading its own chain.
    Its first token is sampled from the target's distribution at its newest position (exactly what
    it would emit without speculation); the chain whose first draft equals it, if any, is taken
    and its further drafts verified by rejection sampling like any chain, which keeps the output
    distribution the target's whatever the candidates were.
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
        winners = [0] * len(scheduled)
        if not sampling:
            return VerifyResult(token_ids, num_accepted, logprobs, winners)
        seqs = [scheduled[i].seq for i in sampling]
        batch = SamplingBatch.from_params(
            [s.params for s in seqs], [s.generator for s in seqs], self.device
        )
        drafts = [scheduled[i].draft_token_ids for i in sampling]
        if any(item.draft_branches for item in scheduled):
            chains = [_chains_of(scheduled[i], run, i) for i in sampling]
            emitted, accepted, chosen = self._verify_branches(run.logits, chains, batch)
        elif any(drafts):
            emitted, accepted = self._verify(run.logits, drafts, [s.draft_probs for s in seqs], batch)
            chosen = [0] * len(seqs)
        else:
            out = self._sampler(run.logits, batch)
            emitted = [[t] for t in out.token_ids.tolist()]
            accepted = [0] * len(seqs)
            chosen = [0] * len(seqs)
        for slot, i in enumerate(sampling):
            token_ids[i] = emitted[slot]
            num_accepted[i] = accepted[slot]
            winners[i] = chosen[slot]
            if scheduled[i].seq.params.logprobs is not None:
                chain_rows = run.branch_logits_rows[i][chosen[slot] - 1] if chosen[slot] else run.logits_rows[i]
                logprobs[i] = _token_logprobs(run.logits[chain_rows][: len(emitted[slot])], emitted[slot])
        return VerifyResult(token_ids, num_accepted, logprobs, winners)

    def _verify_branches(
        self, logits: torch.Tensor, chains: list[_Chains], batch: SamplingBatch
    ) -> tuple[list[list[int]], list[int], list[int]]:
        """Verify requests among which some have draft branches (see the class docstring): the
        first token of every request with branches, then one rejection-sampling pass over each
        request's taken chain (past that first token where it has branches)."""
        branching = [slot for slot, chain in enumerate(chains) if len(chain.tokens) > 1]
        roots = torch.tensor([chains[slot].logits_rows[0].start for slot in branching], device=logits.device)
        first = self._sampler(logits.index_select(0, roots), batch.select(branching)).token_ids.tolist()
        chosen = [0] * len(chains)
        emitted: list[list[int]] = [[] for _ in chains]
        for slot, token in zip(branching, first, strict=True):
            firsts = [tokens[0] for tokens in chains[slot].tokens]
            chosen[slot] = firsts.index(token) if token in firsts else -1
            emitted[slot] = [token]
        # The chains left to verify: each request's own, or past the first token the taken one.
        verified = [slot for slot in range(len(chains)) if chosen[slot] >= 0]
        rows: list[int] = []
        drafts: list[list[int]] = []
        probs: list[torch.Tensor | None] = []
        for slot in verified:
            chain = chains[slot]
            skip = 1 if len(chain.tokens) > 1 else 0
            taken = chosen[slot]
            rows.extend(range(chain.logits_rows[taken].start + skip, chain.logits_rows[taken].stop))
            drafts.append(chain.tokens[taken][skip:])
            chain_probs = chain.probs[taken]
            probs.append(chain_probs[skip:] if chain_probs is not None else None)
        accepted = [0] * len(chains)
        if verified:
            index = torch.tensor(rows, device=logits.device)
            out_tokens, out_accepted = self._verify(logits.index_select(0, index), drafts, probs, batch.select(verified))
            for slot, tokens, count in zip(verified, out_tokens, out_accepted, strict=True):
                # A request with branches had its first draft accepted before this pass.
                first_accepted = len(emitted[slot])
                emitted[slot] = emitted[slot] + tokens
                accepted[slot] = first_accepted + count
        return emitted, accepted, [max(taken, 0) for taken in chosen]

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


def _chains_of(item: ScheduledSequence, run: ModelRunOutput, index: int) -> _Chains:
    """Request ``index``'s chains (its own, then its branches') with their logits rows."""
    seq = item.seq
    return _Chains(
        tokens=[item.draft_token_ids] + [branch.token_ids for branch in item.draft_branches],
        logits_rows=[run.logits_rows[index], *run.branch_logits_rows[index]],
        probs=[seq.draft_probs] + [branch.probs for branch in item.draft_branches],
    )


def _stack_draft_probs(
    drafts: list[list[int]],
    draft_probs: list[torch.Tensor | None],
    vocab_size: int,
    device: torch.device,
) -> torch.Tensor | None:
    """[sum of draft lengths, vocab] probabilities, one-hot rows for drafts that came without any.

    Returns None when no request has draft probabilities or drafts (the sampler then treats all
    as one-hot).
    """
    if all(p is None for p in draft_probs) or not any(drafts):
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
