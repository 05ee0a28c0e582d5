"""Rotary position embeddings (RoPE) with the ``default``, ``linear``, ``llama3`` and ``proportional``
frequency rules.

The cos/sin tables are computed once per forward from the step's positions and shared by every
layer, so the per-layer cost is three element-wise ops on q and k together.

Partial rotary embeddings (``partial_rotary_factor < 1``) come in two kinds, as transformers defines
them. ``default`` rotates only the first ``int(head_dim * factor)`` dimensions of each head, with
frequencies spread over that width (Qwen3-Next): the tables are that narrow and
:func:`apply_rotary` passes the remaining dimensions through. ``proportional`` (Gemma 4) keeps
full-width tables whose later frequencies are zero.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from sonar_core import cpu_kernels

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "proportional")


@dataclass(frozen=True)
class RopeConfig:
    """The frequency rule of one model's rotary embedding."""

    head_dim: int
    theta: float = 10000.0
    rope_type: str = "default"
    # linear and llama3: positions are stretched by this factor.
    factor: float = 1.0
    # llama3 only: wavelength band where frequencies are blended instead of scaled or kept.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # default and proportional only: the share of each head that rotates (see the module docstring).
    partial_rotary_factor: float = 1.0

    @classmethod
    def from_hf_config(cls, hf_config: Any, head_dim: int) -> RopeConfig:
        """Read the rope settings of a Hugging Face config.

        transformers >= 5 keeps everything in ``rope_parameters``; older configs have ``rope_theta``
        plus an optional ``rope_scaling`` dict. Both spellings are accepted.
        """
        params = getattr(hf_config, "rope_parameters", None)
        if params is None:
            params = dict(getattr(hf_config, "rope_scaling", None) or {})
            params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
            params.setdefault("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
        return cls.from_parameters(params, head_dim, getattr(hf_config, "max_position_embeddings", 8192))

    @classmethod
    def from_parameters(cls, params: Mapping[str, Any], head_dim: int, max_position_embeddings: int) -> RopeConfig:
        """Read one ``rope_parameters`` dict (families with several rotary embeddings, such as
        Gemma 4's per layer type, keep one such dict per embedding)."""
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        partial = float(params.get("partial_rotary_factor", 1.0))
        if partial != 1.0 and rope_type not in ("default", "proportional"):
            raise ValueError(
                f"partial rotary embeddings (partial_rotary_factor != 1) are supported only with rope types "
                f"'default' and 'proportional', not {rope_type!r}"
            )
        return cls(
            head_dim=head_dim,
            theta=float(params.get("rope_theta", 10000.0)),
            rope_type=rope_type,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(params.get("original_max_position_embeddings") or max_position_embeddings),
            partial_rotary_factor=partial,
        )

    @property
    def rotary_dim(self) -> int:
        """The leading dimensions of each head that the tables cover (the whole head except for
        partial ``default`` rotation)."""
        if self.rope_type == "proportional":
            return self.head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    def inv_freq(self) -> torch.Tensor:
        """The ``rotary_dim // 2`` inverse frequencies in float32, on the CPU."""
        dim = self.rotary_dim
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
        inv_freq = 1.0 / (self.theta**exponents)
        if self.rope_type == "linear":
            return inv_freq / self.factor
        if self.rope_type == "llama3":
            return self._llama3(inv_freq)
        if self.rope_type == "proportional":
            # The first partial_rotary_factor of the frequencies (exponents still over the whole
            # head), the rest zero: those dimension pairs keep cos 1, sin 0 and pass unrotated.
            rotated = int(self.partial_rotary_factor * self.head_dim // 2)
            inv_freq[rotated:] = 0.0
            return inv_freq / self.factor
        return inv_freq

    def _llama3(self, inv_freq: torch.Tensor) -> torch.Tensor:
        # Long wavelengths (beyond the pretraining context / low_freq_factor) are slowed down by
        # `factor`, short ones (below context / high_freq_factor) are kept, and the band in between
        # is interpolated linearly in 1/wavelength.
        old_len = self.original_max_position_embeddings
        low_freq_wavelen = old_len / self.low_freq_factor
        high_freq_wavelen = old_len / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (old_len / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        blended = (1 - smooth) * scaled / self.factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, blended, scaled)


# CPU steps read cos/sin from tables by position (two index_selects instead of the seven operators
# that form them, a fifth of a one-token draft pass's overhead) for positions below this bound:
# 16,384 positions of a 128-wide head are 16 MiB of float32 tables; further ones are computed.
TABLE_MAX_POSITIONS = 16_384


class RotaryEmbedding:
    """Computes per-step cos/sin tables and applies them (the "rotate half" RoPE layout)."""

    def __init__(self, config: RopeConfig) -> None:
        self.config = config
        self._inv_freq_cpu = config.inv_freq()
        self._inv_freq_by_device: dict[torch.device, torch.Tensor] = {}
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def _inv_freq(self, device: torch.device) -> torch.Tensor:
        inv_freq = self._inv_freq_by_device.get(device)
        if inv_freq is None:
            inv_freq = self._inv_freq_by_device[device] = self._inv_freq_cpu.to(device)
        return inv_freq

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, upto: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, signed_sin)``, each ``[T, 1, rotary_dim]`` in ``dtype``, for :func:`apply_rotary`.

        The angles are formed in float32 (positions up to 10^6 lose precision in bf16). The sine
        carries the sign of the rotation (``-sin`` on the first half) so that applying RoPE needs no
        negation per layer. On the CPU, rows come from tables of every position up to the largest
        asked for so far (grown by doubling, up to :data:`TABLE_MAX_POSITIONS`), the same values
        as computing them (``tests/models/test_rotary.py``); elsewhere finding the largest position
        would wait for the device, so they are computed. ``upto``: a bound the caller knows on the
        host (every position below it: a step's ``AttentionMetadata.max_seq_len``, which every
        model and draft head passes), which spares reading the largest position back (two
        operators a step, dear after a kernel has swept the caches: see docs/performance.md).
        """
        if positions.device.type != "cpu" or positions.numel() == 0:
            return self._compute(positions, dtype)
        needed = upto if upto is not None else int(positions.max()) + 1
        tables = self._tables.get(dtype)
        if tables is None or tables[0].shape[0] < needed:
            if needed > TABLE_MAX_POSITIONS:
                return self._compute(positions, dtype)
            size = min(TABLE_MAX_POSITIONS, max(needed, 2 * (tables[0].shape[0] if tables else 512)))
            tables = self._tables[dtype] = self._compute(torch.arange(size), dtype)
        cos, sin = tables
        return cos.index_select(0, positions), sin.index_select(0, positions)

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self._inv_freq(positions.device)
        cos = freqs.cos()
        sin = freqs.sin()
        cos = torch.cat((cos, cos), dim=-1)
        sin = torch.cat((-sin, sin), dim=-1)
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` by the tables of :meth:`RotaryEmbedding.cos_sin`.

    Equal to ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``: rolling by
    half the head swaps the halves and the signed sine supplies the minus. Tables narrower than the
    head (partial ``default`` rotation) rotate its first ``rotary_dim`` dimensions that way and
    leave the rest as they are.
    """
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rotary_dim], cos, signed_sin), x[..., rotary_dim:]), dim=-1)
    return torch.addcmul(x * cos, x.roll(rotary_dim // 2, dims=-1), signed_sin)


def rotate_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rotary`, overwriting ``x`` where Sonar's CPU kernel can (one pass, no rolled
    copy); returns the rotated tensor, which is ``x`` itself on that path and a new one otherwise.
    For a caller that owns ``x`` (a fresh projection's output) and no longer needs it unrotated."""
    kernels = cpu_kernels.for_tensor(x)
    if kernels is None or x.dim() != 3 or x.stride(-1) != 1:
        return apply_rotary(x, cos, signed_sin)
    tokens = cos.shape[0]
    kernels.rotary_embedding_(x, cos.reshape(tokens, -1), signed_sin.reshape(tokens, -1))
    return x
