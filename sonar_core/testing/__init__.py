"""Test kit for Sonar and its plugins: tiny random checkpoints in real on-disk layouts.

See :mod:`sonar_core.testing.checkpoints` for the fixture pattern.
"""

from sonar_core.testing.checkpoints import (
    CheckpointFactory,
    build_bytelevel_tokenizer,
    build_tiny_checkpoint,
    build_truncated_draft,
)

__all__ = ["CheckpointFactory", "build_bytelevel_tokenizer", "build_tiny_checkpoint", "build_truncated_draft"]
