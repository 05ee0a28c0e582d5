"""YaRN rotary embeddings (``rope_type: "yarn"``), computed the way transformers computes them.

YaRN keeps the high-frequency rotary dimensions as trained (extrapolation), divides the
low-frequency ones by ``factor`` (interpolation) and ramps linearly between the two over the
dimensions whose wavelength falls between ``beta_fast`` and ``beta_slow`` rotations of the original
context. It also scales cos and sin by an *attention factor*, which multiplies the rotary part of
every query-key product by its square.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from sonar_core.layers.rotary import SUPPORTED_ROPE_TYPES, RopeConfig


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The rope settings of a config: transformers >= 5 ``rope_parameters``, or the older
    ``rope_scaling`` dict plus ``rope_theta``."""
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return dict(params)


def rope_type(params: Mapping[str, Any]) -> str:
    return params.get("rope_type", params.get("type", "default"))


@dataclass(frozen=True)
class YarnRopeConfig(RopeConfig):
    """A :class:`RopeConfig` with YaRN's frequency rule; :class:`RotaryEmbedding` takes it as is.

    ``attention_factor`` is *not* applied by :class:`RotaryEmbedding`: the caller scales its cos and
    sin tables (see :class:`sonar_core.layers.mla.MLARotary`).
    """

    rope_type: str = "yarn"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0

    @classmethod
    def from_rope_parameters(
        cls, params: Mapping[str, Any], head_dim: int, max_position_embeddings: int
    ) -> YarnRopeConfig:
        """Read a ``rope_type: "yarn"`` parameter dict, filling defaults as transformers does:
        ``original_max_position_embeddings`` from the config's length, ``factor`` from their ratio,
        the attention factor from ``mscale`` / ``mscale_all_dim`` when not given."""
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
        original = int(params.get("original_max_position_embeddings") or max_position_embeddings)
        factor = params.get("factor")
        factor = float(max_position_embeddings / original if factor is None else factor)
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
            if mscale and mscale_all_dim:
                attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
            else:
                attention_factor = yarn_mscale(factor)
        return cls(
            head_dim=head_dim,
            theta=float(params.get("rope_theta", 10000.0)),
            factor=factor,
            original_max_position_embeddings=original,
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            truncate=bool(params.get("truncate", True)),
            attention_factor=float(attention_factor),
        )

    def inv_freq(self) -> torch.Tensor:
        dim = self.head_dim
        # Explicit CPU tensors: models are constructed under torch.device("meta").
        pos_freqs = self.theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim)
        extrapolation = 1.0 / pos_freqs
        interpolation = 1.0 / (self.factor * pos_freqs)
        low, high = self._correction_range()
        if low == high:
            high += 0.001  # the ramp needs a non-empty interval
        ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp  # 1: extrapolate (high frequency), 0: interpolate (low frequency)
        return interpolation * (1 - keep) + extrapolation * keep

    def _correction_range(self) -> tuple[float, float]:
        """The (fractional) dimension indices where ``beta_fast`` and ``beta_slow`` rotations fit in
        the original context; the ramp runs between them."""

        def dimension(rotations: float) -> float:
            wavelengths = self.original_max_position_embeddings / (rotations * 2 * math.pi)
            return self.head_dim * math.log(wavelengths) / (2 * math.log(self.theta))

        low, high = dimension(self.beta_fast), dimension(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, self.head_dim - 1)


def rope_config_with_yarn(hf_config: Any, head_dim: int) -> RopeConfig:
    """:meth:`RopeConfig.from_hf_config`, extended to ``rope_type: "yarn"``."""
    params = rope_parameters(hf_config)
    kind = rope_type(params)
    if kind == "yarn":
        return YarnRopeConfig.from_rope_parameters(params, head_dim, int(hf_config.max_position_embeddings))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope type {kind!r} is not supported (supported: {', '.join((*SUPPORTED_ROPE_TYPES, 'yarn'))})"
        )
    return RopeConfig.from_hf_config(hf_config, head_dim)
