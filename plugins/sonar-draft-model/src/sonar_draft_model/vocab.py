"""Token-level vocabulary intersection between a target and a draft tokenizer.

Drafting through the intersection keeps speculation lossless for models whose tokenizers differ:
the draft only proposes tokens that exist, as the same string, in both vocabularies, and every
proposal is verified by the target in its own vocabulary. Context tokens outside the
intersection reach the draft as its unknown token, which lowers acceptance but never correctness.
"""

from __future__ import annotations

from typing import Any

import torch


class VocabularyIntersection:
    """Maps between target and draft token ids over the tokens both vocabularies share."""

    def __init__(self, target_tokenizer: Any, draft_tokenizer: Any, device: torch.device) -> None:
        target_vocab: dict[str, int] = target_tokenizer.get_vocab()
        draft_vocab: dict[str, int] = draft_tokenizer.get_vocab()
        shared = target_vocab.keys() & draft_vocab.keys()
        target_size = max(target_vocab.values()) + 1
        draft_size = max(draft_vocab.values()) + 1
        fallback = draft_tokenizer.unk_token_id
        if fallback is None:
            fallback = draft_tokenizer.eos_token_id if draft_tokenizer.eos_token_id is not None else 0
        self.size = len(shared)
        self.target_to_draft = torch.full((target_size,), fallback, dtype=torch.long)
        self.draft_to_target = torch.full((draft_size,), -1, dtype=torch.long)
        for token in shared:
            self.target_to_draft[target_vocab[token]] = draft_vocab[token]
            self.draft_to_target[draft_vocab[token]] = target_vocab[token]
        self.target_to_draft = self.target_to_draft.to(device)
        self.draft_to_target = self.draft_to_target.to(device)
        # Draft logits outside the intersection are masked before the draft picks a token.
        self.draft_mask = self.draft_to_target >= 0

    def to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        return self.target_to_draft[target_ids]

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.draft_to_target[draft_ids]

    def mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Restrict draft logits ([N, draft_vocab]) to the shared tokens."""
        width = min(logits.shape[-1], self.draft_mask.shape[0])
        masked = torch.full_like(logits, float("-inf"))
        keep = self.draft_mask[:width]
        masked[:, :width][:, keep] = logits[:, :width][:, keep]
        return masked
