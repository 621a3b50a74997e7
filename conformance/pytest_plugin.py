"""pytest plugin: the conformance catalogue as a test suite.

``pytest --pyargs ggml_rpc.conformance.checks --rpc-server HOST:PORT`` runs every check as one test against that
server (without ``--rpc-server``: against the embedded reference server).  MUST failures fail; SHOULD failures are
reported as expected failures (xfail) unless ``--rpc-strict``; skip, unsupported and not-run checks are skipped
with their reason.  The plugin is registered through the ``pytest11`` entry point and only adds ``--rpc-*``
options and the session fixture ``rpc_runner``; it does nothing to test runs that do not use them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from .harness import Result, Runner, Target

# The harness is imported only when a test asks for it: this module is loaded into every pytest run of an
# environment where the kit is installed and must cost (and risk) nothing there.


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


def _target(config: pytest.Config) -> tuple[Target, object]:
    from ggml_rpc.spec import V7, parse_version_option

    from .harness import EmbeddedTarget, ExternalTarget, SpawnedTarget, parse_address

    proto_text = config.getoption("--rpc-proto")
    proto = None if proto_text == "auto" else parse_version_option(proto_text)
    cache = config.getoption("--rpc-cache-dir")
    cache_dir = Path(cache) if cache else None
    server = config.getoption("--rpc-server")
    spawn = config.getoption("--rpc-spawn")
    if spawn:
        target = SpawnedTarget(spawn, cache_dir=cache_dir)
        if server:
            target.host, target.port = parse_address(server)
        return target, proto
    if server:
        return ExternalTarget(*parse_address(server), cache_dir=cache_dir), proto
    return EmbeddedTarget(proto or V7, cache_dir), proto


@pytest.fixture(scope="session")
def rpc_runner(pytestconfig: pytest.Config) -> Iterator[Runner]:
    """A started :class:`~ggml_rpc.conformance.harness.Runner` for the server named on the command line."""
    from .harness import Runner, TargetError

    try:
        target, proto = _target(pytestconfig)
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    runner = Runner(target, expect=proto, timeout=pytestconfig.getoption("--rpc-timeout"))  # type: ignore[arg-type]
    seed = pytestconfig.getoption("--rpc-seed")
    if seed is not None:
        runner.seed = seed
    try:
        runner.start()
    except TargetError as exc:
        runner.stop()
        pytest.exit(f"ggml-rpc conformance: {exc}", returncode=2)
    yield runner
    runner.stop()


def describe(result: Result) -> str:
    """A failure message: the verdict, the rule's link and every piece of evidence."""
    from .harness.report_files import evidence_lines

    return "\n".join([f"{result.check.id}: {result.message}", f"rule: {result.check.title} — {result.spec}",
                      *evidence_lines(result)])


def judge(result: Result, strict: bool) -> None:
    """Turn a check result into the pytest outcome of its test."""
    from .harness import Level, Outcome

    if result.outcome is Outcome.PASS:
        return
    if result.outcome in (Outcome.SKIP, Outcome.UNSUPPORTED, Outcome.NOT_RUN):
        pytest.skip(f"{result.outcome.value}: {result.message}")
    if result.failed_level is Level.SHOULD and not strict:
        pytest.xfail("SHOULD rule broken: " + describe(result))
    pytest.fail(describe(result), pytrace=False)
