"""Test parameters over genuine upstream sessions, run in CI.

Tests used to take their upstream captures only from ``../shared/real-captures`` beside the checkout, so they never
ran in CI.  :func:`captures` makes the kit's own recordings in ``fixtures/upstream/`` (genuine 6.0.0, 7.0.0 and
8.0.0 sessions, always present) the parameters that always run, and adds the ``../shared`` captures, when present,
as extra parameters (larger sessions from other builds: more coverage, skipped without them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
UPSTREAM_FIXTURES = ROOT / "fixtures" / "upstream"
REAL_CAPTURES = ROOT.parent / "shared" / "real-captures"


def captures(fixtures: dict[str, Any], shared: dict[str, Any] | None = None) -> list[Any]:
    """``pytest.param(path, value)`` for each fixture file and each ``../shared`` capture; the id is the file's
    name, ``shared:``-prefixed for the optional ones."""
    params = [pytest.param(UPSTREAM_FIXTURES / name, value, id=name) for name, value in fixtures.items()]
    missing = pytest.mark.skipif(not REAL_CAPTURES.is_dir(), reason=f"{REAL_CAPTURES} not beside the checkout")
    params += [pytest.param(REAL_CAPTURES / name, value, id=f"shared:{name}", marks=missing)
               for name, value in (shared or {}).items()]
    return params
