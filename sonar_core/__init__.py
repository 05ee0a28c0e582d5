"""Sonar: a speculative-decoding inference engine.

The user-facing names live in the ``aphrodite`` package (``from aphrodite import LLM, SamplingParams``);
the code lives here.
"""

__version__ = "0.1.0"
