"""The capture reader: the struct walkers and dpkt's readers reassemble the same streams, for every link type; the
streams stay in the file (read on demand), and sequence numbers unwrap past 4 GiB."""

from __future__ import annotations

import socket
import struct
from pathlib import Path

import dpkt
import pytest
from ggml_rpc.conformance.sessions import capture
from ggml_rpc.conformance.sessions.capture import read_connections
from upstream_captures import captures

CLIENT4, SERVER4 = ("127.0.0.1", 40000), ("127.0.0.1", 50052)
CLIENT6, SERVER6 = ("::1", 40001), ("::1", 50052)
C2S = bytes(range(256)) * 40  # 10 KiB
S2C = b"reply-bytes" * 50


def _snapshot(conns):
    return [
        (c.index, c.client, c.server, c.saw_syn, tuple(c.notes), round(c.start, 6),
         bytes(c.c2s.data), bytes(c.s2c.data), c.c2s.fin, c.s2c.fin, c.c2s.gap_at, c.s2c.gap_at)
        for c in conns
    ]


def _read_both(path: Path, monkeypatch) -> tuple[list, list]:
    fast = _snapshot(read_connections(path))
    with monkeypatch.context() as m:
        m.setattr(capture, "kind", lambda data: None)  # dpkt's readers, payloads in memory
        slow = _snapshot(read_connections(path))
    return fast, slow


@pytest.mark.parametrize(("path", "_"), captures(
    dict.fromkeys(["v6-upstream-tiny-q8_0-cold.pcap", "v7-upstream-tiny-q8_0-cold.pcap", "v7client-v6server-hello.pcap",
                   "v8-upstream-tiny-q8_0-split-tensor.pcap"]),
    dict.fromkeys(["v7-v7-gen-cold.pcap", "v6-v6-gen-cold.pcap", "v7-v7-test-backend-ops.pcap",
                   "v7client-v6server-hello.pcap"])))
def test_fast_path_equals_dpkt_path_on_real_captures(path, _, monkeypatch):
    fast, slow = _read_both(path, monkeypatch)
    assert fast == slow and fast


def _ip_packet(src, sport, dst, dport, seq, flags, payload: bytes, v6: bool) -> bytes:
    tcp = dpkt.tcp.TCP(sport=sport, dport=dport, seq=seq, ack=0, flags=flags, data=payload)
    if v6:
        ip = dpkt.ip6.IP6(src=socket.inet_pton(socket.AF_INET6, src), dst=socket.inet_pton(socket.AF_INET6, dst),
                          nxt=6, hlim=64, data=tcp, plen=len(bytes(tcp)))
    else:
        ip = dpkt.ip.IP(src=socket.inet_aton(src), dst=socket.inet_aton(dst), p=6, data=tcp)
    return bytes(ip)


def _frames(v6: bool, *, reorder: bool = False, lose: bool = False) -> list[bytes]:
    """A TCP connection as IP packets: handshake, data both ways (64-byte segments), FIN."""
    client, server = (CLIENT6, SERVER6) if v6 else (CLIENT4, SERVER4)
    syn, ack, fin = dpkt.tcp.TH_SYN, dpkt.tcp.TH_ACK, dpkt.tcp.TH_FIN
    isn_c, isn_s = 0xFFFFFF00, 1000  # the client's sequence numbers wrap around 2^32
    out = [
        _ip_packet(*client, *server, isn_c, syn, b"", v6),
        _ip_packet(*server, *client, isn_s, syn | ack, b"", v6),
    ]
    data = []
    for i in range(0, len(C2S), 64):
        data.append(_ip_packet(*client, *server, (isn_c + 1 + i) & 0xFFFFFFFF, ack, C2S[i : i + 64], v6))
    if reorder:
        data[3], data[4] = data[4], data[3]
        data.insert(10, data[7])  # a retransmission
    if lose:
        del data[20]
    out += data
    out.append(_ip_packet(*server, *client, isn_s + 1, ack, S2C, v6))
    out.append(_ip_packet(*client, *server, (isn_c + 1 + len(C2S)) & 0xFFFFFFFF, fin | ack, b"", v6))
    return out


def _link(linktype: int, ip: bytes) -> bytes:
    v6 = ip[0] >> 4 == 6
    etype = 0x86DD if v6 else 0x0800
    if linktype == 1:  # Ethernet, padded to the 60-byte minimum like a real NIC
        frame = b"\x02" * 6 + b"\x04" * 6 + struct.pack("!H", etype) + ip
        return frame.ljust(60, b"\xee")
    if linktype == 113:  # Linux cooked
        return struct.pack("!HHH8sH", 0, 772, 6, b"", etype) + ip
    if linktype == 0:  # BSD loopback: address family in host byte order
        return struct.pack("=I", 30 if v6 else 2) + ip
    return ip  # raw IP


def _write(path: Path, linktype: int, frames: list[bytes], *, vlan: bool = False, nano: bool = False) -> Path:
    with open(path, "wb") as fh:
        w = dpkt.pcap.Writer(fh, linktype=linktype, nano=nano)
        for i, ip in enumerate(frames):
            frame = _link(linktype, ip)
            if vlan:
                frame = frame[:12] + struct.pack("!HH", 0x8100, 7) + frame[12:]
            w.writepkt(frame, ts=1700000000.25 + i * 0.001)
    return path


@pytest.mark.parametrize("linktype", [1, 113, 0, 101], ids=["ethernet", "linux-sll", "loopback", "raw"])
@pytest.mark.parametrize("v6", [False, True], ids=["ipv4", "ipv6"])
def test_link_types(tmp_path, monkeypatch, linktype, v6):
    path = _write(tmp_path / "c.pcap", linktype, _frames(v6))
    fast, slow = _read_both(path, monkeypatch)
    assert fast == slow
    ((_index, client, server, saw_syn, notes, start, c2s, s2c, fin_c, _fin_s, gap_c, gap_s),) = fast
    assert (client, server, saw_syn, notes) == ((CLIENT6 if v6 else CLIENT4), (SERVER6 if v6 else SERVER4), True, ())
    assert c2s == C2S and s2c == S2C and fin_c and gap_c is None and gap_s is None
    assert start == pytest.approx(1700000000.25)


def test_vlan_tag_and_nanosecond_timestamps(tmp_path, monkeypatch):
    path = _write(tmp_path / "vlan.pcap", 1, _frames(False), vlan=True, nano=True)
    fast, slow = _read_both(path, monkeypatch)
    assert fast == slow and fast[0][6] == C2S


def test_reordered_and_retransmitted_segments(tmp_path, monkeypatch):
    path = _write(tmp_path / "r.pcap", 101, _frames(False, reorder=True))
    fast, slow = _read_both(path, monkeypatch)
    assert fast == slow and fast[0][6] == C2S


def test_lost_segment_cuts_the_stream_and_says_so(tmp_path):
    (conn,) = read_connections(_write(tmp_path / "l.pcap", 101, _frames(False, lose=True)))
    assert conn.c2s.gap_at == 20 * 64 and bytes(conn.c2s.data) == C2S[: 20 * 64]
    assert any("bytes missing at stream offset 1280" in n for n in conn.notes)


def test_capture_starting_mid_connection(tmp_path):
    """Without a SYN the server is the side on the default port (or on --port), and the notes say so."""
    (conn,) = read_connections(_write(tmp_path / "m.pcap", 101, _frames(False)[5:]))
    assert not conn.saw_syn and conn.server == SERVER4 and conn.client == CLIENT4
    assert any("starts after the TCP handshake" in n for n in conn.notes)
    # the client's port is the lower one here, so only --port tells them apart
    (conn,) = read_connections(_write(tmp_path / "p.pcap", 101, _frames(False)[5:]), port=CLIENT4[1])
    assert conn.server == CLIENT4


def test_truncated_file(tmp_path, monkeypatch):
    path = _write(tmp_path / "t.pcap", 101, _frames(False))
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) - 30])
    fast, slow = _read_both(path, monkeypatch)
    assert any("capture file truncated" in n for n in fast[0][4])
    assert fast[0][6] == slow[0][6] == C2S  # the cut record is the FIN: all data is there


def test_pcapng_walker_equals_dpkt(tmp_path, monkeypatch):
    path = tmp_path / "c.pcapng"
    with open(path, "wb") as fh:
        w = dpkt.pcapng.Writer(fh, linktype=101)
        for i, ip in enumerate(_frames(False, reorder=True)):
            w.writepkt(ip, ts=1700000000 + i * 0.001)
    fast, slow = _read_both(path, monkeypatch)
    assert fast == slow and fast[0][6] == C2S and fast[0][7] == S2C


def test_streams_stay_in_the_file(tmp_path, monkeypatch):
    """Every kept segment is a file range (nothing copied) unless only dpkt could parse its frame."""
    path = _write(tmp_path / "c.pcap", 1, _frames(False, reorder=True))
    (conn,) = read_connections(path)
    stream = conn.c2s.stream
    assert stream.file is not None and not stream.memory and len(stream.off) == len(C2S) // 64
    assert conn.c2s.size == len(C2S) and b"".join(conn.c2s.chunks()) == C2S
    assert bytes(stream.read(100, 1000)) == C2S[100:1000]
    with monkeypatch.context() as m:
        m.setattr(capture, "_FAST_LINKTYPES", frozenset())  # every frame through dpkt: payloads kept
        (conn,) = read_connections(path)
    assert conn.c2s.stream.memory and bytes(conn.c2s.data) == C2S


def test_sequence_numbers_unwrap_past_4_gib():
    """A direction longer than 2**32 bytes: 1 GiB segments whose sequence numbers wrap (never read: sizes only)."""
    d = capture.HalfConnection(isn=0xF0000000)
    assert d.index is not None
    giga = 1 << 30
    for i in range(6):
        d.index.seq.append((0xF0000000 + i * giga) & 0xFFFFFFFF)
        d.index.off.append(i * (giga + 100))
        d.index.length.append(giga)
        d.index.ts.append(float(i))
    d.index.seq.append((0xF0000000 + giga) & 0xFFFFFFFF)  # a retransmission of the second segment
    d.index.off.append(1)
    d.index.length.append(giga)
    d.index.ts.append(7.0)
    capture._reassemble(d, None)  # type: ignore[arg-type]
    assert d.gap_at is None and d.size == 6 * giga and list(d.stream.pos) == [i * giga for i in range(6)]


def test_empty_and_unreadable_files(tmp_path):
    empty = tmp_path / "empty.pcap"
    empty.write_bytes(b"")
    with pytest.raises(capture.CaptureError, match="not a pcap"):
        read_connections(empty)
    with pytest.raises(capture.CaptureError, match="cannot open"):
        read_connections(tmp_path / "absent.pcap")
