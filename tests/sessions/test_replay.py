"""replay: relocation, comparison classes, cache state, cross-version rewriting, against the reference server."""

from __future__ import annotations

import numpy as np
import pytest
from ggml_rpc.conformance.cli import main
from ggml_rpc.conformance.sessions.pcapwrite import write_session
from ggml_rpc.conformance.sessions.relocate import Relocator
from ggml_rpc.conformance.sessions.replay import load_captures, replay
from ggml_rpc.reference import running_server
from ggml_rpc.spec import TENSOR_DTYPE, V6, V7, Command, encode_reply, encode_request, make_tensor
from upstream_captures import UPSTREAM_FIXTURES, captures

from .conftest import hello

# Genuine upstream sessions: the kit's fixtures always, the ../shared captures too when present.
FIXED = {"v7-upstream-tiny-q8_0-cold.pcap": V7, "v6-upstream-tiny-q8_0-cold.pcap": V6,
         "v7client-v6server-hello.pcap": V6}
REAL = {"v7-v7-gen-cold.pcap": V7, "v6-v6-gen-cold.pcap": V6, "v7-v7-test-backend-ops.pcap": V7,
        "v7client-v6server-hello.pcap": V6}
GENERATION = {k: v for k, v in FIXED.items() if "cold" in k}
OTHER = {"6.0.0": V7, "7.0.0": V6}


@pytest.mark.parametrize("rewrite", [False, True], ids=["same-version", "as-other-version"])
@pytest.mark.parametrize(("path", "proto"), captures(FIXED, REAL))
def test_real_capture_non_compute_parts_replay_clean(tmp_path, path, proto, rewrite):
    target = OTHER[proto.label] if rewrite else proto
    with running_server(target, cache_dir=str(tmp_path)) as srv:
        report = replay([path], srv.host, srv.port, as_protocol=target if rewrite else None, until_compute=True)
    assert report.mismatches == []
    assert report.compared["exact"] >= 1
    assert report.target_version == target.label


@pytest.mark.parametrize(("path", "expected"), captures(
    {"v7-upstream-tiny-q8_0-cold.pcap": (V7, 16, 16), "v6-upstream-tiny-q8_0-cold.pcap": (V6, 16, 16)},
    {"v7-v7-test-backend-ops.pcap": (V7, 102, 15), "v7-v7-gen-cold.pcap": (V7, 17, 17),
     "v6-v6-gen-cold.pcap": (V6, 17, 17)}))
def test_every_graph_is_relocated_into_the_target_buffers(tmp_path, path, expected):
    """With an executor that computes nothing, the server still accepts every relocated graph (it checks each
    tensor's data lies inside its buffer) and the only mismatches are the computed reads."""
    seen = []

    def record(graph):
        seen.append(len(graph))

    proto, graphs, outputs = expected
    with running_server(proto, cache_dir=str(tmp_path), executor=record) as srv:
        report = replay([path], srv.host, srv.port)
    assert len(seen) == graphs
    assert {m.kind for m in report.mismatches} == {"computed"}
    assert len(report.mismatches) == outputs


@pytest.mark.parametrize("rewrite", [False, True], ids=["same-version", "as-other-version"])
@pytest.mark.parametrize(("path", "proto"), captures(GENERATION, {k: REAL[k] for k in (
    "v7-v7-gen-cold.pcap", "v6-v6-gen-cold.pcap", "v7-v7-test-backend-ops.pcap")}))
def test_real_capture_full_replay_reproduces_the_logits(path, proto, rewrite, capsys):
    args = ["replay", str(path)] + (["--as", str(OTHER[proto.label].major)] if rewrite else [])
    assert main(args) == 0, capsys.readouterr().out


@pytest.mark.parametrize(("path", "_"), captures({"v7-upstream-tiny-q8_0-cold.pcap": None},
                                                 {"v7-v7-gen-cold.pcap": None}))
def test_replaying_a_cold_capture_twice_expects_the_hit(path, _):
    assert main(["replay", "--until-compute", str(path), str(path)]) == 0


def test_graph_relocation_is_vectorised_and_matches_per_tensor_relocation():
    reloc = Relocator()
    reloc.buffer(0x10, 0x900)
    reloc.base(0x10, 0x7000, 0x1_0000_0000)
    reloc.buffer(0x20, 0xA00)  # handle known, base never asked: buffer moves, data stays
    rng = np.random.default_rng(1)
    dicts = []
    for i in range(50):
        buf = [0, 0x10, 0x20, 0x30][i % 4]
        data = 0 if i % 5 == 0 else 0x7000 + int(rng.integers(0, 4096))
        dicts.append(make_tensor(id=i + 1, ne=(4,), buffer=buf, data=data, name=f"t{i}"))
    from ggml_rpc.spec import tensors_array

    arr = reloc.tensor_array(tensors_array(dicts))
    for rec, d in zip(arr, dicts, strict=True):
        want = reloc.tensor(d)
        assert int(rec["buffer"]) == want["buffer"]
        assert int(rec["data"]) == want["data"]
    assert arr.dtype == TENSOR_DTYPE
    assert int(arr["buffer"][1]) == 0x900 and int(arr["data"][1]) == 0x1_0000_0000 + dicts[1]["data"] - 0x7000
    assert int(arr["buffer"][3]) == 0x30  # unknown handle untouched


def _session(read_back: bytes) -> list:
    """ALLOC, BASE, SET 16 bytes, GET them back (recorded reply ``read_back``)."""
    t = make_tensor(id=1, ne=(4,), buffer=0x55, data=0x1000, name="x")
    data = bytes(range(16))
    return [*hello(V7),
            (True, encode_request(V7, Command.ALLOC_BUFFER, {"device": 0, "size": 64})),
            (False, encode_reply(V7, Command.ALLOC_BUFFER, {"remote_ptr": 0x55, "remote_size": 64})),
            (True, encode_request(V7, Command.BUFFER_GET_BASE, {"remote_ptr": 0x55})),
            (False, encode_reply(V7, Command.BUFFER_GET_BASE, {"base_ptr": 0x1000})),
            (True, encode_request(V7, Command.SET_TENSOR, {"tensor": t, "cache_flag": 0, "offset": 0}, data)),
            (True, encode_request(V7, Command.GET_TENSOR, {"tensor": t, "offset": 0, "size": 16})),
            (False, encode_reply(V7, Command.GET_TENSOR, {}, read_back))]


def test_a_read_back_that_differs_is_reported_with_its_place(tmp_path, capsys):
    good, bad = tmp_path / "good.pcap", tmp_path / "bad.pcap"
    write_session(good, [_session(bytes(range(16)))])
    write_session(bad, [_session(bytes(range(15)) + b"\xff")])
    assert main(["replay", str(good)]) == 0
    capsys.readouterr()
    json_path = tmp_path / "r.json"
    assert main(["replay", str(bad), "--json", str(json_path)]) == 1
    out = capsys.readouterr().out
    assert "connection 0 message 4 GET_TENSOR [exact]" in out and "first difference at byte 15" in out
    assert '"ok": false' in json_path.read_text()


def test_a_recorded_close_must_be_reproduced(tmp_path):
    """The recorded server closed on a SET_TENSOR past its buffer (no reply to the probe after it)."""
    t = make_tensor(id=1, ne=(4,), buffer=0x55, data=0x1000 + 60, name="x")
    writes = [*_session(bytes(range(16)))[:6],
              (True, encode_request(V7, Command.SET_TENSOR, {"tensor": t, "cache_flag": 0, "offset": 0},
                                    bytes(16))),
              (True, encode_request(V7, Command.DEVICE_COUNT, {}))]
    path = tmp_path / "close.pcap"
    write_session(path, [writes])
    with running_server("7") as srv:
        report = replay([path], srv.host, srv.port)
    assert report.mismatches == [] and report.compared["close"] == 1


def test_user_mistakes_exit_2(tmp_path):
    path = str(UPSTREAM_FIXTURES / "v7client-v6server-hello.pcap")
    assert main(["replay", path, "--server", "nonsense"]) == 2
    assert main(["replay", path, str(UPSTREAM_FIXTURES / "v7-upstream-tiny-q8_0-cold.pcap")]) == 2  # mixed versions
    assert main(["replay", str(tmp_path / "missing.pcap")]) == 2


def test_load_refuses_captures_whose_server_side_does_not_decode(tmp_path):
    path = tmp_path / "junk.pcap"
    write_session(path, [[*hello(V7), (True, encode_request(V7, Command.DEVICE_COUNT, {})), (False, bytes(8))]])
    from ggml_rpc.conformance.sessions.replay import ReplayError

    with pytest.raises(ReplayError, match="replies do not decode"):
        load_captures([path])


def test_a_client_stream_that_breaks_the_spec_must_make_the_server_close(tmp_path):
    path = tmp_path / "broken.pcap"
    write_session(path, [[(True, b"\x03" + bytes(8))]])  # no HELLO first
    with running_server("7") as srv:
        report = replay([path], srv.host, srv.port, as_protocol=V7)
    assert report.mismatches == [] and report.compared["close"] == 1


def test_a_hit_the_target_cannot_have_and_no_capture_can_supply_is_a_mismatch_with_the_reason(tmp_path):
    t = make_tensor(id=1, ne=(4,), buffer=0x55, data=0x1000, name="w")
    writes = [*_session(bytes(range(16)))[:6],
              (True, encode_request(V7, Command.SET_TENSOR_HASH, {"tensor": t, "offset": 0, "hash": 0x1234})),
              (False, encode_reply(V7, Command.SET_TENSOR_HASH, {"result": 1}))]
    path = tmp_path / "warm.pcap"
    write_session(path, [writes])
    with running_server("7", cache_dir=str(tmp_path / "c")) as srv:
        report = replay([path], srv.host, srv.port)
    (m,) = report.mismatches
    assert m.command == "SET_TENSOR_HASH" and m.index == 3
    assert "no loaded capture holds data with that hash" in m.got


def test_reads_of_regions_written_after_a_graph_stay_exact(real_captures, tmp_path):
    with running_server("7", cache_dir=str(tmp_path)) as srv:
        report = replay([real_captures / "v7-v7-test-backend-ops.pcap"], srv.host, srv.port, until_compute=False)
    assert report.mismatches == []
    assert report.compared["exact"] > 100 and report.compared["computed"] > 100


def test_where_the_recorded_server_closed_is_known_for_every_request():
    """A send refused because the target closed a little early still matches a recording that closed there."""
    from pathlib import Path

    from ggml_rpc.conformance.sessions.replay import Replayer

    fixture = Path(__file__).resolve().parents[2] / "fixtures" / "v7-bad-input.pcap"
    (cap,) = load_captures([fixture])
    replayer = Replayer([cap], "127.0.0.1", 1)
    for dc in cap.connections:
        replies = {id(r.request): r for r in dc.replies}
        verdicts = [replayer._recorded_close_from(dc, r, replies) for r in dc.requests]
        if dc.requests and dc.error is None:  # (a stream that breaks the spec closes in its undecodable tail)
            assert verdicts[-1], f"connection {dc.conn.index} ends with the server closing"
        assert not any(v for r, v in zip(dc.requests, verdicts, strict=True) if r.command is Command.HELLO and
                       id(r) in replies), "HELLO was answered: the server was still there"


def test_a_server_that_is_not_a_ggml_rpc_server_is_refused_at_once(capsys):
    """An HTTP server on the replay's address answers HELLO with its own error page: the replay says so and exits
    2 before sending the captures (each connection once waited the whole reply timeout, 366 s for three)."""
    import http.server
    import threading
    import time

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # the server's own log stays out of the command's stderr
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        started = time.monotonic()
        code = main(["replay", "fixtures/v7-model-load.pcap", "--server", f"127.0.0.1:{httpd.server_address[1]}"])
        took = time.monotonic() - started
    finally:
        httpd.shutdown()
        httpd.server_close()
    err = capsys.readouterr().err
    assert code == 2, err
    assert "does not answer HELLO as a ggml RPC server" in err and err.count("\n") == 1, err
    assert took < 20, took


def test_a_capture_of_another_version_names_the_as_that_rewrites_it(tmp_path, capsys):
    with running_server(V7, cache_dir=str(tmp_path)) as srv:
        main(["replay", "fixtures/v6-model-load.pcap", "--server", f"{srv.host}:{srv.port}"])
    out = capsys.readouterr().out
    hint = f"{srv.host}:{srv.port} speaks 7.0.0, the captures are replayed as 6.0.0: replay them with --as 7"
    assert hint in out, out
