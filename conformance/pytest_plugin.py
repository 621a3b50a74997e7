"""pytest plugin: the conformance catalogue as a test suite.

``pytest --pyargs ggml_rpc.conformance.checks --rpc-server HOST:PORT`` runs every check as one test against that
server (without ``--rpc-server``: against the embedded reference server).  MUST failures fail; SHOULD failures are
reported as expected failures (xfail) unless ``--rpc-strict``; skip, unsupported and not-run checks are skipped
with their reason.  The plugin is registered through the ``pytest11`` entry point and only adds ``--rpc-*``
options and the session fixture ``rpc_runner``; it does nothing to test runs that do not use them.

This module is loaded into every pytest run of an environment where the kit is installed, so it imports nothing of
the kit at load time: the fixture's session (:mod:`.pytest_session`, which needs the harness, about a second to
import) is loaded by the fixture, only in a run that asks for it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from .harness import Runner


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ggml-rpc", "ggml RPC conformance (pytest --pyargs ggml_rpc.conformance.checks)")
    group.addoption("--rpc-server", metavar="HOST:PORT", default=None,
                    help="server under test (default: the embedded reference server)")
    group.addoption("--rpc-spawn", metavar="CMD", default=None,
                    help="start the server under test with CMD ({port} = a free port); restarted after deaths")
    group.addoption("--rpc-proto", default="auto", help="auto, 6, 7 or 7.0.1 (expected version / embedded server)")
    group.addoption("--rpc-cache-dir", metavar="DIR", default=None, help="the server's cache directory")
    group.addoption("--rpc-strict", action="store_true", default=False, help="SHOULD failures fail too")
    group.addoption("--rpc-timeout", type=float, default=5.0, help="seconds to wait for an answer or a close")
    group.addoption("--rpc-seed", type=int, default=None, help="seed of every input a check draws (default: "
                    "the kit's fixed seed, as `ggml-rpc check --seed`)")


@pytest.fixture(scope="session")
def rpc_runner(pytestconfig: pytest.Config) -> Iterator[Runner]:
    """A started :class:`~ggml_rpc.conformance.harness.Runner` for the server named on the command line."""
    # Lazy on purpose (the plugin's one import of the kit): see the module's docstring.
    from .pytest_session import started_runner

    yield from started_runner(pytestconfig)
