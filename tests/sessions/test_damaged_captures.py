"""Captures cut inside a message: decode, lint and replay say where the capture ends and exit 1.

Before, lint called such a file clean ("0 violation(s)") and replay blamed the server ("expected the server to
close"), since a stream that stops looks like a peer that stopped.  The cuts are made where a user makes them:
``head -c`` of a fixture, at a packet boundary or inside a large message's data.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from ggml_rpc.conformance.cli import main
from ggml_rpc.conformance.sessions.capture import read_connections
from ggml_rpc.conformance.sessions.decode import decode_file
from ggml_rpc.conformance.sessions.lint import lint_file

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


@dataclass(frozen=True)
class Cut:
    source: str
    #: Bytes of the source file kept (``head -c``), or where in a stream to cut: (connection, client side?, byte).
    keep: int | tuple[int, bool, int]
    connection: int
    direction: str
    index: int
    command: str
    end: int | None  # stream byte where the capture ends (None: where the packet holding the cut byte starts)
    others: int  # connections replayed whole besides the cut one


CUTS = {
    # `head -c 1000`: whole packets up to the GET_ALIGNMENT request; its reply is missing.
    "head-c-1000": Cut("v7-inference.pcap", 1000, 0, "server->client", 2, "GET_ALIGNMENT", 48, 0),
    # inside the 2 MB of a model upload's SET_TENSOR data (the last connection)
    "set-tensor-data": Cut("upstream/v7-upstream-tiny-q8_0-cold.pcap", (12, True, 5216 + 1_000_000), 12,
                           "client->server", 19, "SET_TENSOR", None, 12),
    # inside a 384000-byte GET_TENSOR reply (the logits read back)
    "get-tensor-reply": Cut("upstream/v8-upstream-tiny-q8_0-cold.pcap", (10, False, 348 + 200_000), 10,
                            "server->client", 66, "GET_TENSOR", None, 10),
}


def file_offset(path: Path, connection: int, client: bool, byte: int) -> tuple[int, int]:
    """Where in the file stream byte ``byte`` of one direction lies (a segment's bytes are contiguous), and the
    stream offset of its segment: a file cut inside a packet loses the whole packet, so the stream ends there."""
    conn = read_connections(path)[connection]
    stream = (conn.c2s if client else conn.s2c).stream
    k = bisect.bisect_right(list(stream.pos), byte) - 1
    return stream.off[k] + byte - stream.pos[k], stream.pos[k]


@pytest.fixture(params=sorted(CUTS))
def cut(request, tmp_path) -> tuple[Cut, Path]:
    spec = CUTS[request.param]
    source = FIXTURES / spec.source
    if isinstance(spec.keep, int):
        keep = spec.keep
    else:
        keep, end = file_offset(source, *spec.keep)
        spec = replace(spec, end=end)
    path = tmp_path / f"{request.param}.pcap"
    path.write_bytes(source.read_bytes()[:keep])
    return spec, path


def where(spec: Cut) -> str:
    return (f"connection {spec.connection} ({spec.direction}): the capture ends inside message {spec.index} "
            f"({spec.command}{' reply' if spec.direction == 'server->client' else ''}) at stream byte {spec.end}")


def test_decode_says_where_the_capture_ends(cut, capsys):
    spec, path = cut
    assert main(["decode", str(path)]) == 1
    captured = capsys.readouterr()
    assert f"ggml-rpc decode: {path}: {where(spec)}" in captured.err
    assert where(spec) in captured.out  # the listing says where it stops
    assert "no reply before the connection ended" not in captured.out  # the capture ended, not the connection


def test_decode_json_names_the_cut(cut, capsys):
    spec, path = cut
    assert main(["decode", "--json", "-", str(path)]) == 1
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    [truncated] = [e for e in events if e.get("event") == "truncated"]
    assert truncated["file"] == str(path)
    assert (truncated["connection"], truncated["direction"], truncated["index"], truncated["command"],
            truncated["end"]) == (spec.connection, spec.direction, spec.index, spec.command, spec.end)


def test_lint_reports_the_cut_not_a_clean_capture(cut, capsys):
    spec, path = cut
    assert main(["lint", str(path)]) == 1
    out = capsys.readouterr().out
    assert "CAPTURE-TRUNCATED" in out and "0 violation(s)" not in out
    [v] = lint_file(path)  # the cut is the only finding: the message cut short is not judged as a peer's
    assert (v.rule, v.connection, v.direction, v.index, v.command) == (
        "CAPTURE-TRUNCATED", spec.connection, spec.direction, spec.index, spec.command)
    assert f"at stream byte {spec.end}" in v.message


def test_replay_stops_the_cut_connection_and_goes_on(cut, capsys):
    spec, path = cut
    assert main(["replay", "--json", "-", str(path)]) == 1
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["mismatches"] == []  # not the server's fault
    assert not report["ok"]
    [line] = report["cuts"]
    assert line.startswith(f"{path} {where(spec)}") and f"not replayed from message {spec.index} on" in line
    assert report["connections"] == spec.others + 1  # every other connection was replayed
    assert "CAPTURE CUT:" in captured.err and "cut short by the capture" in captured.err
    assert "MISMATCH" not in captured.err


def test_whole_fixtures_have_no_cut():
    for path in (FIXTURES / "v7-inference.pcap", FIXTURES / "upstream" / "v7-upstream-tiny-q8_0-cold.pcap",
                 FIXTURES / "repro" / "v7-early-close-device-count.pcap"):
        assert all(not dc.cuts for dc in decode_file(path)), path
        assert not [v for v in lint_file(path) if v.rule == "CAPTURE-TRUNCATED"], path


def _stopped_capture(path: Path, tail: bytes, *, close: bool) -> None:
    """A whole capture file whose client sent HELLO, got its reply, then ``tail``; ``close``: both sides FIN,
    else the capture stopped with the connection open."""
    from ggml_rpc.conformance.sessions.pcapwrite import PcapWriter
    from ggml_rpc.spec import V7, Command, encode_reply, encode_request, hello_reply

    with PcapWriter(path) as w:
        flow = w.flow()
        flow.open()
        flow.write(True, encode_request(V7, Command.HELLO, {"conn_caps": bytes(24)}))
        flow.write(False, encode_reply(V7, Command.HELLO, hello_reply((7, 0, 0))))
        flow.write(True, tail)
        if close:
            flow.close()


@pytest.mark.parametrize(("tail", "command", "size"), [
    (bytes([14, 24, 0, 0]), None, None),  # inside the next request's 9-byte header
    (bytes([0]) + (12).to_bytes(8, "little") + bytes(4), "ALLOC_BUFFER", 21),  # inside its 12-byte payload
])
def test_a_capture_stopped_with_the_connection_open_is_cut_not_a_peer_fault(tmp_path, capsys, tail, command, size):
    path = tmp_path / "stopped.pcap"
    _stopped_capture(path, tail, close=False)
    [dc] = decode_file(path)
    [c] = dc.cuts
    assert (c.direction, c.index, c.command, c.start, c.end, c.size) == ("client->server", 1, command, 33,
                                                                          33 + len(tail), size)
    assert [v.rule for v in lint_file(path)] == ["CAPTURE-TRUNCATED"]
    assert main(["decode", str(path)]) == 1
    assert "the capture ends inside message 1" in capsys.readouterr().err


def test_a_client_that_closed_inside_a_message_is_not_a_cut(tmp_path):
    path = tmp_path / "closed.pcap"
    _stopped_capture(path, bytes([0]) + (12).to_bytes(8, "little") + bytes(4), close=True)
    [dc] = decode_file(path)
    assert dc.cuts == []  # the client's FIN ended its stream: the peer cut the message short, not the recording
    assert "CAPTURE-TRUNCATED" not in {v.rule for v in lint_file(path)}
