"""pcap writing: real TCP framing that tshark reads without warnings and our reader reassembles byte for byte."""

from __future__ import annotations

import pytest
from ggml_rpc.conformance.sessions.capture import read_connections
from ggml_rpc.conformance.sessions.decode import decode_connection, decode_file
from ggml_rpc.conformance.sessions.pcapwrite import PcapWriter, write_session
from ggml_rpc.spec import Reply
from hypothesis import given, settings
from hypothesis import strategies as st
from upstream_captures import captures

from .conftest import tshark_problems


def _writes(conn):
    """One connection of a capture as the ordered writes of each side (a request, then its reply)."""
    dc = decode_connection(conn)
    out = []
    for msg in dc.messages():
        stream = conn.s2c.data if isinstance(msg, Reply) else conn.c2s.data
        out.append((not isinstance(msg, Reply), bytes(stream[msg.offset : msg.offset + msg.wire_size])))
    return out


@pytest.mark.parametrize("mss", [536, 1460, 65495])
@pytest.mark.parametrize(("path", "_"), captures({"v7-upstream-tiny-q8_0-cold.pcap": None},
                                                 {"v7-v7-test-backend-ops.pcap": None}))
def test_real_capture_rewritten_reassembles_identically(path, _, tmp_path, mss):
    src = read_connections(path)
    out = tmp_path / "rewritten.pcap"
    write_session(out, [_writes(c) for c in src], mss=mss)
    back = read_connections(out)
    assert len(back) == len(src)
    for a, b in zip(back, src, strict=True):
        assert a.saw_syn and not a.notes
        assert a.c2s.data == b.c2s.data
        assert a.s2c.data == b.s2c.data
    original = decode_file(path)
    for a, b in zip(decode_file(out), original, strict=True):
        assert a.error is None
        assert [(m.command, m.size, bytes(m.raw)) for m in a.messages()] == \
               [(m.command, m.size, bytes(m.raw)) for m in b.messages()]
    assert tshark_problems(out) == ""


def test_bulk_segments_and_teardown_read_cleanly_by_tshark(tmp_path):
    big = bytes(range(256)) * 40000  # 10 MB in one write: segmentation and periodic ACKs
    out = tmp_path / "bulk.pcap"
    with PcapWriter(out) as w:
        flow = w.flow(server=("127.0.0.1", 50052))
        flow.write(True, big)
        flow.write(False, b"\x01" * 9)
        flow.close(client_first=False)
    (conn,) = read_connections(out)
    assert conn.c2s.data == big and conn.s2c.data == b"\x01" * 9
    assert conn.c2s.fin and conn.s2c.fin
    assert tshark_problems(out) == ""


def test_ipv6_loopback_flow(tmp_path):
    out = tmp_path / "v6.pcap"
    with PcapWriter(out) as w:
        flow = w.flow(client=("::1", 41000), server=("::1", 50052), mss=1000)
        flow.write(True, b"a" * 5000)
        flow.write(False, b"b" * 3)
        flow.close()
    (conn,) = read_connections(out)
    assert conn.client == ("::1", 41000) and conn.server == ("::1", 50052)
    assert conn.c2s.data == b"a" * 5000 and conn.s2c.data == b"bbb"
    assert tshark_problems(out) == ""


def test_bad_parameters_are_refused(tmp_path):
    with PcapWriter(tmp_path / "x.pcap") as w:
        with pytest.raises(ValueError):
            w.flow(mss=70000)
        with pytest.raises(ValueError):
            w.flow(client=("::1", 1), server=("127.0.0.1", 2))


@settings(max_examples=40, deadline=None)
@given(
    writes=st.lists(st.tuples(st.booleans(), st.binary(min_size=0, max_size=3000)), max_size=12),
    mss=st.integers(min_value=1, max_value=1500),
    client_first=st.booleans(),
)
def test_any_writes_at_any_mss_reassemble_to_the_same_streams(tmp_path_factory, writes, mss, client_first):
    path = tmp_path_factory.mktemp("h") / "h.pcap"
    with PcapWriter(path, start=1_700_000_000.0) as w:
        flow = w.flow(mss=mss)
        flow.open()
        for from_client, data in writes:
            flow.write(from_client, data)
        flow.close(client_first=client_first)
    (conn,) = read_connections(path)
    assert conn.saw_syn and not conn.notes
    assert bytes(conn.c2s.data) == b"".join(d for c, d in writes if c)
    assert bytes(conn.s2c.data) == b"".join(d for c, d in writes if not c)
    assert conn.c2s.fin and conn.s2c.fin
