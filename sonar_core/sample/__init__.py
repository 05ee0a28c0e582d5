"""Token sampling: the target distribution (``processing``) and the plain sampler (``sampler``)."""

from sonar_core.sample.processing import SamplingBatch, processed_probs
from sonar_core.sample.sampler import Sampler, SamplerOutput, draw_race_weights, make_generator

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplingBatch",
    "draw_race_weights",
    "make_generator",
    "processed_probs",
]
