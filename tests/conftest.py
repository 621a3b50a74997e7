"""Shared test fixtures: where the real upstream captures live (beside the checkout, in ../shared)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
REAL_CAPTURES = ROOT.parent / "shared" / "real-captures"


@pytest.fixture(scope="session")
def real_captures() -> Path:
    if not REAL_CAPTURES.is_dir():
        pytest.fail(f"real captures not found at {REAL_CAPTURES} (CI lays shared/ beside the checkout)")
    return REAL_CAPTURES
