"""Fixtures of the fuzzer tests: the tests folder on the import path (the vulnerable server variant lives here), and
every test run from its own temporary folder (whatever a test forgets to direct elsewhere lands there)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _run_in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
