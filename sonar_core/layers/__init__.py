"""Model building blocks shared by target models and draft heads: attention over the paged KV
cache, rotary embeddings, RMS norms and the pre-norm decoder layer.
"""

from sonar_core.layers.attention import AttentionMetadata, PagedAttention
from sonar_core.layers.decoder import DecoderLayer, DecoderLayerConfig, GatedMLP, SelfAttention
from sonar_core.layers.norms import RMSNorm
from sonar_core.layers.rotary import RopeConfig, RotaryEmbedding, apply_rotary

__all__ = [
    "AttentionMetadata",
    "DecoderLayer",
    "DecoderLayerConfig",
    "GatedMLP",
    "PagedAttention",
    "RMSNorm",
    "RopeConfig",
    "RotaryEmbedding",
    "SelfAttention",
    "apply_rotary",
]
