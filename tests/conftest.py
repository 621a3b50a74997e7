"""Shared test fixtures: the real upstream captures.

Two sources: the captures laid beside the checkout in ``../shared/real-captures`` (used when present), and the kit's
own recordings of genuine upstream sessions in ``fixtures/upstream/`` (always present, so a fresh clone is tested
on real upstream traffic too). Tests about a ``../shared`` capture's documented figures skip without it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
REAL_CAPTURES = ROOT.parent / "shared" / "real-captures"
UPSTREAM_FIXTURES = ROOT / "fixtures" / "upstream"


def upstream_fixtures() -> list[dict]:
    """The manifest entries of the kit's own upstream recordings (``fixtures/upstream/manifest.json``)."""
    manifest = UPSTREAM_FIXTURES / "manifest.json"
    if not manifest.is_file():
        return []
    return json.loads(manifest.read_text())["fixtures"]


@pytest.fixture(scope="session")
def real_captures() -> Path:
    if not REAL_CAPTURES.is_dir():
        pytest.skip(f"{REAL_CAPTURES} not beside the checkout (fixtures/upstream/ holds the kit's own recordings, "
                    "tested in tests/test_upstream_fixtures.py)")
    return REAL_CAPTURES


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "upstream: needs the upstream peers (`ggml-rpc upstream install`)")
    config.addinivalue_line("markers", "memory: bounded-memory checks on a ~1 GB capture (run by default, in CI "
                                       "too; about a minute; `-m 'not memory'` leaves them out locally)")


@pytest.fixture(scope="session")
def upstream_peer():
    """An installed upstream 7.0.0 peer; skip with one line when none is (a failure when CI is set)."""
    from ggml_rpc.conformance.upstream.peers import PEERS

    peer = PEERS["7.0.0"]
    if not peer.installed():
        message = "upstream peers not installed: run `ggml-rpc upstream install`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return peer


@pytest.fixture(scope="session")
def upstream_peer8():
    """The installed upstream 8.0.0 peer (the llama-cpp-py-sync wheel); skip with one line when it is not (a
    failure when CI is set)."""
    from ggml_rpc.conformance.upstream.peers import PEERS

    peer = PEERS["8.0.0"]
    if not peer.installed():
        message = "upstream 8.0.0 not installed: run `ggml-rpc upstream install --proto 8`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return peer
