"""Every check can fail: each one runs against a server broken in exactly what it judges and must report a failure
with evidence.  The same checks, relayed without a fault, pass (so the failure comes from the fault).  A rule of the
table's that the breaker's replies break (a server rule: a reply's size, no reply bytes for a command without one)
is one the check enforces, so the check names it; and a server rule a check names, its breaker breaks."""

from __future__ import annotations

from pathlib import Path

import pytest
from breakers import BREAKERS
from faulty import Breaker, faulty_server
from ggml_rpc.conformance.checks import CATALOGUE
from ggml_rpc.conformance.harness import Check, ExternalTarget, Outcome, Runner
from ggml_rpc.conformance.sessions.lint import lint_connections
from ggml_rpc.reference import running_server
from ggml_rpc.spec import V6, V7, V7_0_1, V8, Protocol
from ggml_rpc.spec.rules import BY_ID, Side


def protocol_for(check: Check) -> Protocol:
    """The reference version the check applies to (7.0.0 first)."""
    for p in (V7, V6, V7_0_1, V8):
        if check.applies_to(p.version):
            return p
    raise AssertionError(f"{check.id} applies to no covered version")


def run_through(check: Check, breaker: Breaker, tmp_path: Path, protocol: Protocol | None = None):
    proto = protocol or protocol_for(check)
    cache = tmp_path / "cache"
    with running_server(proto, cache_dir=str(cache)) as ref, faulty_server(ref.address, proto, breaker, cache) as bad:
        runner = Runner(ExternalTarget(bad.host, bad.port, cache_dir=cache), expect=proto, timeout=3.0,
                        probe_timeout=2.0)
        runner.start()
        try:
            return runner.run_one(check)
        finally:
            runner.stop()


@pytest.mark.parametrize("check", CATALOGUE, ids=[c.id for c in CATALOGUE])
def test_check_catches_its_breaker(check: Check, tmp_path: Path) -> None:
    assert check.id in BREAKERS, f"{check.id} has no breaker: add one to tests/conformance/breakers.py"
    result = run_through(check, BREAKERS[check.id](), tmp_path)
    assert result.outcome is Outcome.FAIL, f"{check.id}: {result.outcome.value}: {result.message}"
    assert result.failed_level is not None
    assert result.message
    assert result.evidence, "a failure must carry evidence"
    assert any(e.expected or e.got for e in result.evidence), result.evidence
    assert result.recording is not None
    broken = {v.rule for v in lint_connections([c.capture() for c in result.recording.connections])}
    server = {r for r in broken if r in BY_ID and BY_ID[r].side is Side.SERVER}
    if "DECODE" in check.rules:
        # The request the check breaks on purpose cannot be decoded, so a reply to it cannot be paired with one:
        # the checker reports the breaker's answer as an ill-formed reply stream, a consequence of DECODE.
        server.discard("REPLY-DECODE")
    named = {r for r in check.rules if BY_ID[r].side is Side.SERVER}
    assert server == named, f"{check.id}: its breaker breaks {sorted(server)}, it names {sorted(named)}"


def test_every_breaker_names_a_check() -> None:
    assert set(BREAKERS) <= {c.id for c in CATALOGUE}
