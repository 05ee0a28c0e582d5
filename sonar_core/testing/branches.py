"""Draft branches on every step, for tests of what branches do.

The engine drafts branches only while a step verifies few rows (``BRANCH_ROW_LIMIT``), only for
requests whose head is unsure of its first draft (``BRANCH_CONFIDENCE``), and stops chains where
the head's probability runs out (``draft_stop_confidence``: such a test's configuration sets it to
0). A test of branches must exercise them at full depth whatever its batch and however peaked or
flat its tiny head happens to be.
"""

from __future__ import annotations

import math

import pytest

from sonar_core.engine import speculator as speculator_module
from sonar_core.spec_decode import chain_proposer


def branch_on_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every drafting request gets its draft branches on every step (for this test only); as deep
    as it may draft with ``"draft_stop_confidence": 0`` in the test's configuration."""
    monkeypatch.setattr(speculator_module, "BRANCH_ROW_LIMIT", 10**6)
    monkeypatch.setattr(chain_proposer, "BRANCH_CONFIDENCE", math.inf)
