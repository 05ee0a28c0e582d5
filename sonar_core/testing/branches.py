"""Draft branches on every step, for tests of what branches do.

The engine drafts branches only while a step verifies few rows (``BRANCH_ROW_LIMIT``) and only for
requests whose head is unsure of its first draft (``BRANCH_CONFIDENCE``). A test of branches must
exercise them whatever its batch and however peaked its tiny head happens to be.
"""

from __future__ import annotations

import math

import pytest

from sonar_core.engine import speculator as speculator_module
from sonar_core.spec_decode import draft_sampling


def branch_on_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every drafting request gets its draft branches on every step (for this test only)."""
    monkeypatch.setattr(speculator_module, "BRANCH_ROW_LIMIT", 10**6)
    monkeypatch.setattr(draft_sampling, "BRANCH_CONFIDENCE", math.inf)
