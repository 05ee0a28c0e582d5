"""A draft's reduced vocabulary and the target's: which target token each draft token is.

EAGLE-3 and DFlash/DSpark heads predict over ``Vd`` tokens, the ``Vd`` most frequent target tokens
sorted by target id. Checkpoints store the map as offsets (``d2t[i] = target_id - i``) and the
inverse as a mask over the target vocabulary (``t2d``, ``Vd`` entries True). The engine never sees
draft ids: a plugin owns a :class:`DraftVocabularyMap` and hands drafts and their probabilities over
in the target vocabulary.
"""

from __future__ import annotations

import torch

from sonar_core.errors import ConfigError


class DraftVocabularyMap:
    """Draft id ``i`` is target id ``target_ids[i]`` (strictly increasing, all below ``target_vocab_size``)."""

    def __init__(self, target_ids: torch.Tensor, target_vocab_size: int) -> None:
        self.target_ids = target_ids.to(torch.int64)
        self.target_vocab_size = target_vocab_size
        self.draft_vocab_size = int(target_ids.shape[0])
        self.is_identity = self.draft_vocab_size == target_vocab_size

    @classmethod
    def identity(cls, vocab_size: int, device: torch.device | str = "cpu") -> DraftVocabularyMap:
        return cls(torch.arange(vocab_size, device=device), vocab_size)

    @classmethod
    def from_d2t(
        cls,
        d2t: torch.Tensor,
        target_vocab_size: int,
        draft_vocab_size: int,
        t2d: torch.Tensor | None = None,
        *,
        field: str = "model",
        source: str = "the draft checkpoint",
    ) -> DraftVocabularyMap:
        """From the published offsets (and, when present, the mask), validated.

        Raises :class:`ConfigError` on ``field`` naming ``source`` when the lengths disagree with
        ``draft_vocab_size`` or the target vocabulary, or the ids are not a sorted subset.
        """
        fix = "use the d2t/t2d tensors written for this draft vocabulary (re-export the checkpoint)"
        if d2t.dim() != 1 or d2t.shape[0] != draft_vocab_size:
            raise ConfigError(
                field, f"{source}: d2t has shape {tuple(d2t.shape)}, but draft_vocab_size is {draft_vocab_size}", fix
            )
        target_ids = torch.arange(draft_vocab_size, dtype=torch.int64) + d2t.to(torch.int64).cpu()
        if draft_vocab_size and (int(target_ids.min()) < 0 or int(target_ids.max()) >= target_vocab_size):
            raise ConfigError(
                field,
                f"{source}: d2t maps draft tokens to target ids {int(target_ids.min())}..{int(target_ids.max())}, "
                f"outside the target vocabulary of {target_vocab_size}",
                fix,
            )
        if draft_vocab_size > 1 and not bool((target_ids[1:] > target_ids[:-1]).all()):
            raise ConfigError(field, f"{source}: d2t does not map draft ids to increasing target ids", fix)
        if t2d is not None:
            if t2d.dim() != 1 or t2d.shape[0] != target_vocab_size:
                raise ConfigError(
                    field,
                    f"{source}: t2d has shape {tuple(t2d.shape)}, but the target vocabulary has {target_vocab_size} tokens",
                    fix,
                )
            mask = t2d.to(torch.bool).cpu()
            if int(mask.sum()) != draft_vocab_size or not bool(mask[target_ids].all()):
                raise ConfigError(
                    field,
                    f"{source}: t2d marks {int(mask.sum())} target tokens, not the {draft_vocab_size} tokens d2t maps to",
                    fix,
                )
        return cls(target_ids, target_vocab_size)

    def to(self, device: torch.device | str) -> DraftVocabularyMap:
        return DraftVocabularyMap(self.target_ids.to(device), self.target_vocab_size)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids (any shape) -> target ids."""
        if self.is_identity:
            return draft_ids
        return self.target_ids.index_select(0, draft_ids.reshape(-1)).view(draft_ids.shape)

    def scatter_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``[N, Vd]`` draft logits -> ``[N, V]`` target logits, ``-inf`` outside the draft vocabulary."""
        if self.is_identity:
            return logits
        full = logits.new_full((logits.shape[0], self.target_vocab_size), float("-inf"))
        return full.index_copy_(1, self.target_ids, logits)

    def scatter_probs(self, probs: torch.Tensor) -> torch.Tensor:
        """``[N, Vd]`` draft probabilities -> ``[N, V]``, zero outside the draft vocabulary."""
        if self.is_identity:
            return probs
        return probs.new_zeros((probs.shape[0], self.target_vocab_size)).index_copy_(1, self.target_ids, probs)
