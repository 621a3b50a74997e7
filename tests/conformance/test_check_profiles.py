"""``ggml-rpc check --profile safe``: which checks it holds, and that its membership is right.

The profile is derived, not listed: the checks that send only what the spec allows (``Check.bad_input`` False)
and that no known upstream memory-safety bug names (``conformance/upstream/known_bugs.py``).  Here the first half is
verified against the reference, the spec's executable form: every request of a check declared valid is answered
without the reference closing the connection on it, and its client stream breaks none of the spec's client rules
(the checker ``lint`` and ``proxy --check`` run).  Against the genuine servers, the profile kills none of them
(``upstream`` tests).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ggml_rpc.conformance.checks import CATALOGUE
from ggml_rpc.conformance.cli import main
from ggml_rpc.conformance.harness import ExternalTarget, Outcome, Runner
from ggml_rpc.conformance.sessions.lint import check_connection
from ggml_rpc.conformance.upstream.known_bugs import KNOWN_BUGS, harmful_checks, safe_profile
from ggml_rpc.conformance.upstream.peers import peers_of
from ggml_rpc.conformance.upstream.runs import UpstreamServer
from ggml_rpc.reference import Hooks, running_server
from ggml_rpc.spec import V6, V7, V8

SAFE = safe_profile(CATALOGUE)


def test_the_profile_leaves_out_bad_input_and_every_check_of_a_known_crash() -> None:
    ids = {c.id for c in SAFE}
    assert ids and len(ids) < len(CATALOGUE)
    assert not any(c.bad_input for c in SAFE)
    assert not ids & harmful_checks()
    assert harmful_checks() == {c for bug in KNOWN_BUGS if bug.cls in "ABCDEF" for c in bug.checks}
    # What a server someone depends on can take: the data path, the cache, computing.
    assert {"HELLO-001", "DATA-006", "CACHE-V7-006", "COMPUTE-014"} <= ids


@pytest.mark.parametrize("protocol", [V6, V7, V8], ids=lambda p: p.label)
def test_every_check_of_the_profile_sends_only_what_the_reference_accepts(protocol, tmp_path: Path) -> None:
    closes: list[str] = []
    applicable = [c for c in SAFE if c.applies_to(protocol.version)]
    refused: dict[str, list[str]] = {}
    broken: dict[str, list[str]] = {}
    with running_server(protocol, cache_dir=str(tmp_path), hooks=Hooks(close=lambda exc: closes.append(str(exc)))) \
            as srv:
        runner = Runner(ExternalTarget(srv.host, srv.port, cache_dir=tmp_path), expect=protocol, timeout=10.0,
                        probe_timeout=5.0)
        runner.start()
        try:
            for check in applicable:
                closes.clear()
                result = runner.run_one(check)
                assert result.outcome in (Outcome.PASS, Outcome.SKIP, Outcome.UNSUPPORTED), \
                    (check.id, result.message)
                if closes:
                    refused[check.id] = list(closes)
                rules = [v.rule for conn in result.recording.connections
                         for v in check_connection(conn.capture(), protocol)[0] if v.direction == "client->server"]
                if rules:
                    broken[check.id] = rules
        finally:
            runner.stop()
    assert not refused, f"checks of the safe profile whose requests the reference refuses: {refused}"
    assert not broken, f"checks of the safe profile whose requests break the spec's client rules: {broken}"


def test_the_profile_reads_as_partial_in_every_report(tmp_path: Path, capsys) -> None:
    out = tmp_path / "report.json"
    assert main(["check", "--profile", "safe", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    last = text.strip().splitlines()[-1]
    assert last.startswith("→ conformant on the safe profile") and "not full conformance" in last, last
    verdict = json.loads(out.read_text())["verdict"]
    assert verdict["state"] == "conformant" and verdict["profile"] == "safe"
    assert verdict["checks_left_out"] == len(CATALOGUE) - len(SAFE)


@pytest.mark.upstream
@pytest.mark.parametrize("version", ["6.0.0", "7.0.0", "8.0.0"])
def test_the_safe_profile_kills_no_genuine_server(version: str, tmp_path: Path) -> None:
    """The profile against every genuine build of the version (the release, and Debian's when installed), spawned
    so that a death would be seen, named and the server restarted: no check dies, and the verdict reads as the
    partial profile it is."""
    peers = [p for p in peers_of([version]) if p.installed()]
    if not peers:
        pytest.skip(f"upstream {version} is not installed (ggml-rpc upstream install --proto {version[0]})")
    for peer in peers:
        server = UpstreamServer(peer, cache=True, llama_cache=tmp_path / f"llama-cache-{peer.label}")
        server.cache_dir.mkdir(parents=True, exist_ok=True)
        out = tmp_path / f"report-{peer.label}.json"
        code = main(["check", "--profile", "safe", "--spawn", server.spawn_command(), "--cache-dir",
                     str(server.cache_dir), "--json", str(out)])
        report = json.loads(out.read_text())
        deaths = [r["id"] for r in report["results"] if r["server_death"]]
        assert not deaths, f"the safe profile killed upstream {peer.label}: {deaths}"
        verdict = report["verdict"]
        assert verdict["profile"] == "safe" and verdict["checks_left_out"] > 0 and code == verdict["exit_code"]
        assert "on the safe profile" in verdict["line"] and "not full conformance" in verdict["line"]
