"""Every check can fail: each one runs against a server broken in exactly what it judges and must report a failure
with evidence.  The same checks, relayed without a fault, pass (so the failure comes from the fault).  A rule of the
table's that the breaker's replies break (a server rule: a reply's size, no reply bytes for a command without one)
is one the check enforces, so the check names it; and a server rule a check names, its breaker breaks."""

from __future__ import annotations

from pathlib import Path

import pytest
from breakers import BREAKERS
from faulty import Act, Breaker, Conn, Msg, faulty_server
from ggml_rpc.conformance.checks import CATALOGUE
from ggml_rpc.conformance.client import RpcClient
from ggml_rpc.conformance.harness import Check, ExternalTarget, Outcome, Runner
from ggml_rpc.conformance.sessions.lint import lint_connections
from ggml_rpc.reference import running_server
from ggml_rpc.spec import V6, V7, V7_0_1, V8, Command, Protocol
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


class SkipsEmptyInit(Breaker):
    """8.0.0's way with an INIT_TENSOR of zero elements: skipped wherever its data points, no reply, the connection
    open (where the reference closes)."""

    def request(self, conn: Conn, msg: Msg) -> Act | None:
        t = msg.fields.get("tensor") if msg.fields else None
        if msg.command is Command.INIT_TENSOR and t is not None and 0 in tuple(t["ne"]):
            return Act(forward=None)
        return None


def test_a_shadow_check_never_waits_for_the_reply_of_a_command_that_has_none(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """SHADOW-018 against a server that takes the empty INIT_TENSORs the reference refuses: each is judged by the
    probe that follows it, not by waiting for a reply INIT_TENSOR never has (a whole timeout per case, 45 s of
    CHECK-v8's 100 s against the wheel)."""
    last: list[int] = []
    send, recv = RpcClient.send_raw, RpcClient.recv_reply_raw

    def send_raw(self: RpcClient, data: object) -> None:
        first = bytes(data[0] if isinstance(data, list | tuple) else data)[:1]  # type: ignore[arg-type, index]
        if first:
            last[:] = [first[0]]
        send(self, data)  # type: ignore[arg-type]

    def recv_reply_raw(self: RpcClient, *args: object, **kwargs: object) -> bytearray:
        command = V8.command_at(last[0]) if last else None
        assert command is None or V8.commands[command].has_reply, f"waited for a reply to {command.name}"
        return recv(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(RpcClient, "send_raw", send_raw)
    monkeypatch.setattr(RpcClient, "recv_reply_raw", recv_reply_raw)
    check = next(c for c in CATALOGUE if c.id == "SHADOW-018")
    result = run_through(check, SkipsEmptyInit(), tmp_path, V8)
    assert result.outcome is Outcome.PASS, f"{result.outcome.value}: {result.message}"
    assert "accepted where the reference refuses, buffers intact" in result.message
