"""Reading pcap / pcapng files into reassembled TCP connections.

Each connection becomes two contiguous byte streams (client -> server and server -> client).  Retransmitted
segments are dropped, overlaps trimmed; a hole (lost packets) or a capture that starts after the handshake is
recorded on the connection and the stream is cut there, so decoding stops with that reason instead of misparsing.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path

import dpkt

# Link types we can strip down to IP.
_DLT_NULL, _DLT_EN10MB, _DLT_RAW, _DLT_LOOP, _DLT_LINUX_SLL, _DLT_RAW2, _DLT_LINUX_SLL2 = 0, 1, 12, 108, 113, 101, 276


class CaptureError(Exception):
    """A capture file that cannot be read at all."""


@dataclass
class Direction:
    """One direction of a TCP connection."""

    isn: int | None = None  # sequence number of the first payload byte (after SYN)
    segments: list[tuple[int, bytes, float]] = field(default_factory=list)
    fin: bool = False
    data: bytearray = field(default_factory=bytearray)
    #: Stream offset where bytes went missing (the stream is cut there), or None.
    gap_at: int | None = None
    #: Timestamps of the segment starting at each stream offset (for pairing with time).
    first_ts: float | None = None


@dataclass
class Connection:
    """A reassembled TCP connection."""

    index: int
    client: tuple[str, int]
    server: tuple[str, int]
    start: float
    c2s: Direction = field(default_factory=Direction)
    s2c: Direction = field(default_factory=Direction)
    saw_syn: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.client[0]}:{self.client[1]} -> {self.server[0]}:{self.server[1]}"


def _ip_from_link(linktype: int, buf: bytes):
    if linktype == _DLT_EN10MB:
        eth = dpkt.ethernet.Ethernet(buf)
        return eth.data
    if linktype == _DLT_LINUX_SLL:
        return dpkt.sll.SLL(buf).data
    if linktype == _DLT_LINUX_SLL2:
        return dpkt.sll2.SLL2(buf).data
    if linktype in (_DLT_NULL, _DLT_LOOP):
        return dpkt.loopback.Loopback(buf).data
    if linktype in (_DLT_RAW, _DLT_RAW2):
        return dpkt.ip.IP(buf) if buf and buf[0] >> 4 == 4 else dpkt.ip6.IP6(buf)
    raise CaptureError(f"unsupported link type {linktype}")


def _addr(ip) -> str:
    family = socket.AF_INET6 if isinstance(ip, dpkt.ip6.IP6) else socket.AF_INET
    return socket.inet_ntop(family, ip.src), socket.inet_ntop(family, ip.dst)


def _reader(fh):
    try:
        return dpkt.pcap.Reader(fh)
    except ValueError:
        fh.seek(0)
        try:
            return dpkt.pcapng.Reader(fh)
        except ValueError as exc:
            raise CaptureError("not a pcap or pcapng file") from exc


def read_connections(path: str | Path, *, port: int | None = None) -> list[Connection]:
    """All TCP connections in a capture (optionally only those with ``port`` on either side), in start order."""
    conns: dict[tuple, Connection] = {}
    order: list[Connection] = []
    try:
        fh = open(path, "rb")
    except OSError as exc:
        raise CaptureError(f"cannot open {path}: {exc.strerror}") from exc
    with fh:
        reader = _reader(fh)
        linktype = reader.datalink()
        try:
            for ts, buf in reader:
                try:
                    ip = _ip_from_link(linktype, buf)
                except (dpkt.UnpackError, IndexError, ValueError):
                    continue
                if not isinstance(ip, dpkt.ip.IP | dpkt.ip6.IP6) or not isinstance(ip.data, dpkt.tcp.TCP):
                    continue
                tcp = ip.data
                if port is not None and port not in (tcp.sport, tcp.dport):
                    continue
                src, dst = _addr(ip)
                a, b = (src, tcp.sport), (dst, tcp.dport)
                key = (a, b) if a <= b else (b, a)
                syn, ack = bool(tcp.flags & dpkt.tcp.TH_SYN), bool(tcp.flags & dpkt.tcp.TH_ACK)
                conn = conns.get(key)
                if conn is None or (syn and not ack and conn.saw_syn and conn.c2s.segments):
                    # A new connection (or a reused 4-tuple starting over with a fresh SYN).
                    if syn and not ack:
                        conn = Connection(len(order), a, b, ts, saw_syn=True)
                    else:
                        # Started mid-connection: guess the server as the side with the lower port.
                        client, server = (a, b) if tcp.sport > tcp.dport else (b, a)
                        conn = Connection(len(order), client, server, ts)
                        conn.notes.append("capture starts after the TCP handshake: stream start guessed")
                    conns[key] = conn
                    order.append(conn)
                d = conn.c2s if a == conn.client else conn.s2c
                if syn:
                    d.isn = (tcp.seq + 1) & 0xFFFFFFFF
                    continue
                if tcp.flags & dpkt.tcp.TH_FIN:
                    d.fin = True
                payload = bytes(tcp.data)
                if payload:
                    if d.isn is None:
                        d.isn = tcp.seq
                    d.segments.append((tcp.seq, payload, ts))
        except (dpkt.NeedData, ValueError) as exc:
            order and order[-1].notes.append(f"capture file truncated: {exc}")
    for conn in order:
        for d in (conn.c2s, conn.s2c):
            _reassemble(d)
        for name, d in (("client->server", conn.c2s), ("server->client", conn.s2c)):
            if d.gap_at is not None:
                conn.notes.append(f"{name}: bytes missing at stream offset {d.gap_at} (lost packets)")
    return order


def _reassemble(d: Direction) -> None:
    """Order segments by relative sequence number into one contiguous stream; stop at the first hole."""
    if not d.segments or d.isn is None:
        return
    isn = d.isn
    rel = sorted((((seq - isn) & 0xFFFFFFFF), data, ts) for seq, data, ts in d.segments)
    d.first_ts = rel[0][2]
    total = max(off + len(data) for off, data, _ in rel if off < 0x80000000) if rel else 0
    out = bytearray(total)
    pos = 0
    for off, data, _ts in rel:
        if off >= 0x80000000:  # before the ISN: a stale retransmission of something already seen
            continue
        end = off + len(data)
        if end <= pos:
            continue  # retransmission
        if off > pos:
            d.gap_at = pos
            break
        out[pos:end] = memoryview(data)[pos - off :]
        pos = end
    del out[pos:]
    d.data = out
    d.segments = []
