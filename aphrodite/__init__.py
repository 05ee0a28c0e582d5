"""The user-facing names of Sonar: ``from aphrodite import LLM, SamplingParams``."""

from sonar_core.entrypoints.llm import LLM
from sonar_core.outputs import CompletionOutput, RequestOutput
from sonar_core.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
