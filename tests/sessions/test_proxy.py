"""The recording proxy: transparent, records a pcap that decodes, tshark reads and replays cleanly, checks live."""

from __future__ import annotations

import time

import numpy as np
import pytest
from ggml_rpc.conformance.cli import main
from ggml_rpc.conformance.client import RpcClient
from ggml_rpc.conformance.sessions.decode import decode_file
from ggml_rpc.conformance.sessions.lint import lint_file
from ggml_rpc.conformance.sessions.proxy import running_proxy
from ggml_rpc.conformance.sessions.replay import replay
from ggml_rpc.conformance.sessions.scenarios import Session, cache_flag_abuse, inference, model_load
from ggml_rpc.reference import running_server
from ggml_rpc.spec import GgmlType, fnv1a64, make_tensor

from .conftest import tshark_problems


@pytest.mark.parametrize("proto", ["6", "7"])
def test_proxied_session_decodes_reads_and_replays_clean(tmp_path, proto):
    pcap = tmp_path / "proxied.pcap"
    seen = []
    with running_server(proto, cache_dir=str(tmp_path / "cache")) as srv, \
            running_proxy(srv.address, pcap=pcap, check=True, on_violation=seen.append) as px:
        session = Session(px.host, px.port, srv.protocol)
        model_load(session)
        inference(session)
    assert seen == []
    assert px.stats.connections == 4 and px.stats.violations == []
    decoded = decode_file(pcap)
    assert all(dc.error is None for dc in decoded) and len(decoded) == 4
    assert sum(len(dc.requests) for dc in decoded) == px.stats.requests
    assert main(["decode", str(pcap)]) == 0
    assert tshark_problems(pcap) == ""
    with running_server(proto, cache_dir=str(tmp_path / "cache2")) as srv:
        report = replay([pcap], srv.host, srv.port)
    assert report.mismatches == [] and report.compared["computed"] == 5


def test_bulk_bytes_pass_unchanged_at_small_mss(tmp_path):
    pcap = tmp_path / "bulk.pcap"
    data = np.random.default_rng(5).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    with running_server("7") as srv, running_proxy(srv.address, pcap=pcap, mss=1460) as px:
        with RpcClient.connect(px.host, px.port) as c:
            handle, _ = c.alloc_buffer(0, len(data))
            t = make_tensor(id=1, type=int(GgmlType.I8), ne=(len(data),), buffer=handle, data=c.buffer_get_base(handle))
            c.set_tensor(t, 0, data)
            assert bytes(c.get_tensor(t, 0, len(data))) == data
    assert px.stats.bytes_c2s > len(data) and px.stats.bytes_s2c > len(data)
    (dc,) = decode_file(pcap)
    assert dc.error is None
    assert fnv1a64(dc.replies[-1].data) == fnv1a64(data)


def test_live_check_reports_what_lint_reports(tmp_path):
    pcap = tmp_path / "abuse.pcap"
    seen = []
    with running_server("7", cache_dir=str(tmp_path / "c")) as srv, \
            running_proxy(srv.address, pcap=pcap, check=True, on_violation=seen.append) as px:
        cache_flag_abuse(Session(px.host, px.port, srv.protocol))
    assert [(v.rule, v.index) for v in seen] == [(v.rule, v.index) for v in lint_file(pcap)]
    assert len(seen) == 3


@pytest.mark.parametrize(("request_bytes", "answer", "rule"), [
    (b"\x0f" + bytes(8), bytes(8) + bytes(8), "REPLY-SIZE"),  # DEVICE_COUNT answered with 8 payload bytes
    (b"\x04" + (8).to_bytes(8, "little") + bytes(8), bytes(8), "NO-REPLY"),  # FREE_BUFFER answered, v5 style
])
def test_live_check_sees_wrong_replies(request_bytes, answer, rule):
    """A fake server that answers what it must not; the proxy reports it as the reply passes."""
    import socket
    import threading

    from ggml_rpc.spec import V7, Command, encode_reply, hello_reply

    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)

    def serve() -> None:
        conn, _ = lsock.accept()
        with conn:
            conn.recv(33)
            conn.sendall(encode_reply(V7, Command.HELLO, hello_reply(V7.version)))
            conn.recv(len(request_bytes))
            conn.sendall(answer)
            conn.recv(100)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    seen = []
    with running_proxy(lsock.getsockname(), check=True, on_violation=seen.append) as px:
        with RpcClient.connect(px.host, px.port) as c:
            c.send_raw(request_bytes)
            c.recv_reply_raw()
    t.join(5)
    lsock.close()
    assert [v.rule for v in seen] == [rule]


def test_cli_usage_errors():
    assert main(["proxy", "--upstream", "nonsense"]) == 2
    assert main(["pcap", "record", "--scenario", "inference"]) == 2
    assert main(["pcap", "record", "--scenario", "cache-flag-abuse", "--proto", "6", "-o", "/tmp/x.pcap"]) == 2


@pytest.mark.parametrize(("server_proto", "client_layout"), [("7", "6"), ("6", "7")])
def test_live_check_names_the_other_versions_framing(server_proto, client_layout):
    """A SET_TENSOR in the other version's layout is reported as FRAMING before the server sees it."""
    from ggml_rpc.spec import Command, encode_request, parse_version_option

    layout = parse_version_option(client_layout)
    data = bytes(range(1, 256)) * 4  # first byte non-zero: the v6-on-v7 shift runs past the tensor
    seen = []
    with running_server(server_proto) as srv, running_proxy(srv.address, check=True, on_violation=seen.append) as px:
        with RpcClient.connect(px.host, px.port) as c:
            handle, _ = c.alloc_buffer(0, 4096)
            t = make_tensor(id=1, type=int(GgmlType.I8), ne=(len(data),), buffer=handle, data=c.buffer_get_base(handle))
            fields = {"tensor": t, "offset": 0}
            if layout.cache_rule.flag_field:
                fields["cache_flag"] = 0
            c.send_raw(encode_request(layout, Command.SET_TENSOR, fields, data))
            c.expect_closed(2.0)
    assert [v.rule for v in seen] == ["FRAMING-OTHER-LAYOUT"]
    assert layout.label in seen[0].message


def test_proxy_command_records_and_checks_until_interrupted(tmp_path):
    """`ggml-rpc proxy` as a user runs it: listen on a free port, forward, record, report, stop on Ctrl-C."""
    import re
    import signal
    import subprocess
    import sys

    pcap = tmp_path / "cli.pcap"
    with running_server("7", cache_dir=str(tmp_path / "c")) as srv:
        proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from ggml_rpc.conformance.cli import main; sys.exit(main())",
             "proxy", "--listen", "127.0.0.1:0", "--upstream", f"{srv.host}:{srv.port}", "--pcap", str(pcap),
             "--check"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            port = int(re.search(r"127\.0\.0\.1:(\d+) ->", proc.stdout.readline()).group(1))  # type: ignore[union-attr]
            cache_flag_abuse(Session("127.0.0.1", port, srv.protocol))
            time.sleep(0.3)  # the proxy finishes the connection after both sides closed
        finally:
            proc.send_signal(signal.SIGINT)
            out, _err = proc.communicate(timeout=30)
    assert proc.returncode == 130  # stopped by a signal, as every command; the violations are on stdout
    assert out.count("VIOLATION") == 3 and "[CACHE-FLAG-NO-MISS]" in out
    assert "1 connection(s)" in out
    assert len(lint_file(pcap)) == 3
