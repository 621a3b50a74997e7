"""The fuzzer finds a server with one of upstream's bugs re-enabled (tests/fuzz/vulnerable.py), shrinks it, and the
saved reproducer replays to the same failure; a target that dies and cannot be restarted stops the campaign instead of
looping on refusals."""

from __future__ import annotations

import re

import pytest
from ggml_rpc.conformance.fuzz import EmbeddedFuzzTarget, Options, embedded_campaign, fuzz_config, target_campaign
from ggml_rpc.conformance.harness import ExternalTarget
from ggml_rpc.conformance.sessions.replay import ReplayError, replay
from ggml_rpc.reference import running_server
from ggml_rpc.spec import V7
from vulnerable import LEAKY_GET_TENSOR, SILENT_MAX_SIZE, WRONG_ALIGNMENT, VulnerableServer, server_with

#: The seeded campaign's budget, in examples: how fast the machine runs them does not matter.
CRASH_EXAMPLES = 300


@pytest.fixture(scope="module")
def crash(tmp_path_factory):
    out = tmp_path_factory.mktemp("findings")
    # Shrinking is bounded by hypothesis' own limits, not by a clock (a loaded machine shrinks as far, only later).
    campaign = embedded_campaign(V7, Options(examples=CRASH_EXAMPLES, seed=0, out_dir=out, max_findings=1,
                                             shrink_seconds=float("inf")),
                                 server_cls=VulnerableServer)
    campaign.target.start()
    try:
        campaign.run()
    finally:
        campaign.target.stop()
    return campaign, out


def test_finds_the_crash_within_an_example_budget(crash):
    campaign, out = crash
    assert campaign.stopped_because == "1 finding(s)", campaign.stopped_because
    # Found within the budget; the examples hypothesis runs while shrinking it come after.
    at = campaign.stats.first_finding_at
    assert at is not None and 1 <= at <= CRASH_EXAMPLES and at <= campaign.stats.examples
    assert campaign.report()["first_finding_at"] == at  # what findings.json says
    assert [f.kind for f in campaign.findings] == ["crash"]
    f = campaign.findings[0]
    assert f.death is not None and "SIGABRT" in f.death["status"]
    # The reproducer names the rule that was broken: a tensor's extent (address or shape) outside its buffer.
    assert f.broken is not None and re.match(r"bound: (\w+\.)*(\d+\.)?(data|ne\.\d|nb\.\d) = ", f.broken), f.broken
    assert f.pcap is not None and f.pcap.exists() and f.summary_file is not None
    line = f.summary_file.read_text().splitlines()[0]
    assert line.startswith("crash on ") and "SIGABRT" in line
    assert (out / "findings.txt").read_text().count("\n") == 1
    assert f.messages <= 40 and f.connections == 1


def test_reproducer_replays_clean_against_the_reference(crash):
    f = crash[0].findings[0]
    with running_server("7") as srv:
        report = replay([f.pcap], srv.host, srv.port, timeout=10)
        assert report.ok, [m.line() for m in report.mismatches]
        assert report.connections == 2  # the crashing connection and the HELLO probe


def test_reproducer_replays_to_the_same_crash(crash):
    f = crash[0].findings[0]
    target = EmbeddedFuzzTarget(fuzz_config(V7), VulnerableServer, cache=False)
    target.start()
    try:
        # The server dies on the recorded message: the HELLO probe that follows is refused, or (while the dying
        # process still holds its listening socket) accepted and then reset.
        try:
            report = replay([f.pcap], target.host, target.port, timeout=10)
        except ReplayError as exc:
            assert "cannot connect" in str(exc)
        else:
            # The reproducer says that the target died (issue: a shrunk reproducer must name the death).
            kinds = [(m.connection, m.command, m.kind) for m in report.mismatches]
            assert kinds[0] == (1, "HELLO", "transport") or kinds[0][2] == "death", kinds
            assert any(kind == "death" for _, _, kind in kinds), kinds
        info = target.death_info()
        assert info is not None and "SIGABRT" in info["status"]
    finally:
        target.stop()


def test_a_dead_external_target_stops_the_campaign(tmp_path):
    server = EmbeddedFuzzTarget(fuzz_config(V7), VulnerableServer, cache=False)
    server.start()
    try:
        external = ExternalTarget(server.host, server.port)
        campaign = target_campaign(external, Options(examples=CRASH_EXAMPLES, seed=0, out_dir=tmp_path,
                                                     wait_restart=0.5))
        campaign.run()
        assert campaign.stopped_because.startswith("target died"), (campaign.stopped_because,
                                                                    [f.line() for f in campaign.findings])
        assert "did not come back within 0.5 s" in campaign.stopped_because
        assert [f.kind for f in campaign.findings] == ["crash"]
        assert campaign.findings[0].pcap is not None and campaign.findings[0].pcap.exists()
    finally:
        server.stop()


@pytest.mark.parametrize("variant, kind, command", [
    (SILENT_MAX_SIZE, "hang", "GET_MAX_SIZE"),
    (WRONG_ALIGNMENT, "wrong-reply", "GET_ALIGNMENT"),
    (LEAKY_GET_TENSOR, "out-of-buffer", "GET_TENSOR"),
], ids=["silent-max-size", "wrong-alignment", "leaky-get-tensor"])
def test_every_kind_of_finding_is_detected(variant, kind, command, tmp_path):
    # Shrinking gets a few seconds: how far it gets does not decide the test (the reproducer must replay against
    # the reference either way), and a hang costs a timeout per shrink attempt, which an unbounded shrink would
    # multiply into many minutes.
    options = Options(examples=CRASH_EXAMPLES, seed=0, out_dir=tmp_path, max_findings=1, shrink_seconds=5.0,
                      timeout=1.0)
    campaign = embedded_campaign(V7, options, server_cls=server_with(variant, f"{kind}Server"))
    campaign.target.start()
    try:
        campaign.run()
    finally:
        campaign.target.stop()
    assert [(f.kind, f.command) for f in campaign.findings] == [(kind, command)]
    f = campaign.findings[0]
    assert f.pcap is not None and f.pcap.exists()
    with running_server("7") as srv:  # the reproducer is what the reference answers
        assert replay([f.pcap], srv.host, srv.port, timeout=10).ok
