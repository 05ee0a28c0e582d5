"""IBM's MLP speculator (fms-extras): its layout, its stages, and the proposer that chains them.

Stage ``i`` reads the running state and the token sampled by the stage before (the newest token
for stage 0) and produces the next state and draft::

    s     = proj_i(state) + (emb_weight / state_weight) * emb_i(token)
    state = GELU(LN_i(s))                 # LN: w * x / rms(x) + b, no mean subtraction; exact GELU
    logits_i = head_i(state)

with ``state_weight = 0.5 ** (0.5 / n_predict)`` and ``emb_weight = sqrt((1 - state_weight**2) *
inner_dim / 2)``; the first state is the target's final state (RMS-normed and divided by sqrt(2)
with ``scale_input``). With ``tie_weights`` every stage shares stage 0's embedding, head and norm
and every stage after the first shares ``proj.1``, so the chain may run past ``n_predict``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sonar_core.errors import ConfigError
from sonar_core.sample.processing import SamplingBatch
from sonar_core.spec_decode.draft_checkpoint import FIELD, DraftCheckpoint
from sonar_core.spec_decode.draft_sampling import DraftSample, DraftSampler
from sonar_core.spec_decode.state_head_proposer import StateHeadProposer

_NAME = re.compile(r"^(?:speculator\.)?(emb|proj|head|ln)\.(\d+)\.(weight|bias)$")
LN_EPS = 1e-6


@dataclass(frozen=True)
class MLPSpeculatorLayout:
    """The shape of an MLP speculator checkpoint."""

    n_predict: int
    emb_dim: int
    inner_dim: int
    vocab_size: int
    tie_weights: bool
    scale_input: bool

    def stage_index(self, kind: str, stage: int) -> int:
        """Which stored module stage ``stage`` uses (tied weights share them)."""
        if not self.tie_weights:
            return stage
        return min(stage, 1) if kind == "proj" else 0

    def module_count(self, kind: str) -> int:
        if not self.tie_weights:
            return self.n_predict
        return min(self.n_predict, 2) if kind == "proj" else 1

    def expected(self) -> dict[str, tuple[int, ...]]:
        """The tensors the speculator loads (names without the ``speculator.`` prefix)."""
        inner, vocab = self.inner_dim, self.vocab_size
        shapes: dict[str, tuple[int, ...]] = {}
        for i in range(self.module_count("emb")):
            shapes[f"emb.{i}.weight"] = (vocab, inner)
            shapes[f"head.{i}.weight"] = (vocab, inner)
            shapes[f"ln.{i}.weight"] = (inner,)
            shapes[f"ln.{i}.bias"] = (inner,)
        for i in range(self.module_count("proj")):
            shapes[f"proj.{i}.weight"] = (inner, self.emb_dim if i == 0 else inner)
        return shapes

    def tied_copies(self) -> dict[str, tuple[int, ...]]:
        """Copies of shared tensors a tied checkpoint may also store, at the other indices."""
        if not self.tie_weights:
            return {}
        full = MLPSpeculatorLayout(self.n_predict, self.emb_dim, self.inner_dim, self.vocab_size, False, False)
        return {name: shape for name, shape in full.expected().items() if name not in self.expected()}

    @staticmethod
    def rename(name: str) -> str:
        return name.removeprefix("speculator.")

    @staticmethod
    def is_stage_tensor(name: str) -> bool:
        return _NAME.match(name) is not None


def read_layout(checkpoint: DraftCheckpoint, hidden_size: int, vocab_size: int) -> MLPSpeculatorLayout:
    """The layout, checked against the target (its final state feeds stage 0)."""
    config = checkpoint.config
    n_predict = config.get("n_predict")
    if not isinstance(n_predict, int) or n_predict < 1:
        raise ConfigError(FIELD, f"{checkpoint.describe()}: n_predict={n_predict!r} is not a stage count", "repair config.json")
    emb_dim = int(config.get("emb_dim") or config.get("hidden_size") or 0)
    if emb_dim != hidden_size:
        raise ConfigError(
            FIELD,
            f"{checkpoint.describe()} reads target states of size emb_dim={emb_dim}, but the target's hidden size is "
            f"{hidden_size}",
            "use an MLP speculator trained for this target",
        )
    if int(config.get("vocab_size") or vocab_size) != vocab_size:
        raise ConfigError(
            FIELD, f"{checkpoint.describe()} has vocab_size {config.get('vocab_size')}, the target {vocab_size}",
            "use an MLP speculator trained for this target",
        )
    return MLPSpeculatorLayout(
        n_predict=n_predict,
        emb_dim=emb_dim,
        inner_dim=int(config.get("inner_dim") or emb_dim),
        vocab_size=vocab_size,
        tie_weights=bool(config.get("tie_weights", False)),
        scale_input=bool(config.get("scale_input", False)),
    )


class ScaledRMSNorm(nn.Module):
    """fms-extras' ``LayerNormParameterized`` as the speculator uses it: ``w * x / rms(x) + b``."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.bias = nn.Parameter(torch.zeros(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, LN_EPS).to(x.dtype)
        return self.weight * normed + self.bias


class MLPSpeculator(nn.Module):
    """The stored stages (see the module docstring)."""

    def __init__(self, layout: MLPSpeculatorLayout) -> None:
        super().__init__()
        self.layout = layout
        inner = layout.inner_dim
        self.emb = nn.ModuleList(nn.Embedding(layout.vocab_size, inner) for _ in range(layout.module_count("emb")))
        self.proj = nn.ModuleList(
            nn.Linear(layout.emb_dim if i == 0 else inner, inner, bias=False) for i in range(layout.module_count("proj"))
        )
        self.head = nn.ModuleList(nn.Linear(inner, layout.vocab_size, bias=False) for _ in range(layout.module_count("head")))
        self.ln = nn.ModuleList(ScaledRMSNorm(inner) for _ in range(layout.module_count("ln")))
        state_weight = 0.5 ** (0.5 / layout.n_predict)
        self.embedding_scale = math.sqrt((1 - state_weight**2) * (inner / 2)) / state_weight

    def first_state(self, states: torch.Tensor) -> torch.Tensor:
        if not self.layout.scale_input:
            return states
        return F.rms_norm(states.float(), (states.shape[-1],), None, LN_EPS).to(states.dtype) / math.sqrt(2)

    def stage(self, index: int, state: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(next state, float32 logits)`` of stage ``index``."""
        layout = self.layout
        mixed = self.proj[layout.stage_index("proj", index)](state)
        mixed = mixed + self.embedding_scale * self.emb[layout.stage_index("emb", index)](tokens)
        state = F.gelu(self.ln[layout.stage_index("ln", index)](mixed))
        return state, self.head[layout.stage_index("head", index)](state).float()


def load_speculator(
    checkpoint: DraftCheckpoint, layout: MLPSpeculatorLayout, dtype: torch.dtype, device: torch.device
) -> MLPSpeculator:
    from sonar_core.models.meta_build import materialize, on_meta_device
    from sonar_core.models.weights import load_named_weights

    with on_meta_device():
        speculator = MLPSpeculator(layout)
    speculator = materialize(speculator, dtype, device)
    copies = set(layout.tied_copies())
    load_named_weights(
        speculator,
        checkpoint.tensors(rename=MLPSpeculatorLayout.rename),
        ignore=lambda name: name in copies,
    )
    return speculator.eval().requires_grad_(False)


class MLPSpeculatorProposer(StateHeadProposer):
    """Chains the stages: each stage's sampled draft is the next stage's token."""

    def __init__(self, speculator: MLPSpeculator, sampler: DraftSampler, max_depth: int | None) -> None:
        super().__init__(sampler, max_depth=max_depth)
        self.speculator = speculator

    def draft(
        self, states: torch.Tensor, newest_tokens: torch.Tensor, depth: int, sampling: SamplingBatch | None
    ) -> list[DraftSample]:
        state = self.speculator.first_state(states)
        tokens = newest_tokens
        samples = []
        for index in range(depth):
            state, logits = self.speculator.stage(index, state, tokens)
            sample = self.sampler.sample(logits, sampling)
            samples.append(sample)
            tokens = sample.token_ids
        return samples
