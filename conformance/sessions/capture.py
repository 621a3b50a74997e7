"""Reading pcap / pcapng files into reassembled TCP connections.

Each connection becomes two contiguous byte streams (client -> server and server -> client).  Retransmitted
segments are dropped, overlaps trimmed; a hole (lost packets) or a capture that starts after the handshake is
recorded on the connection and the stream is cut there, so decoding stops with that reason instead of misparsing.

Speed: classic pcap files of the common link types (Ethernet, Linux cooked, BSD loopback, raw IP) are parsed with
:mod:`struct` straight from one in-memory copy of the file, and TCP payloads stay memoryview slices of it until
reassembly copies each direction once into its stream.  pcapng files and any packet the fast path does not
recognise (IP options are fine; IPv6 extension headers, VLAN stacks beyond one tag...) go through dpkt.
"""

from __future__ import annotations

import mmap
import socket
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import dpkt
from ggml_rpc.spec.facts import DEFAULT_PORT

# Link types we can strip down to IP.
_DLT_NULL, _DLT_EN10MB, _DLT_RAW, _DLT_LOOP, _DLT_LINUX_SLL, _DLT_RAW2, _DLT_LINUX_SLL2 = 0, 1, 12, 108, 113, 101, 276


class CaptureError(Exception):
    """A capture file that cannot be read at all."""


@dataclass
class Direction:
    """One direction of a TCP connection."""

    isn: int | None = None  # sequence number of the first payload byte (after SYN)
    segments: list[tuple[int, bytes | memoryview, float]] = field(default_factory=list)
    fin: bool = False
    #: Bytes the other direction had carried when this side's FIN came (a client FIN before replies it never read).
    fin_peer_bytes: int | None = None
    #: Payload bytes seen so far in this direction (retransmissions included: an upper bound, exact when clean).
    seen: int = 0
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


def _reader(fh, path: str | Path):
    # dpkt signals a short or foreign file header with ValueError or NeedData (an UnpackError)
    try:
        return dpkt.pcap.Reader(fh)
    except (ValueError, dpkt.UnpackError):
        fh.seek(0)
        try:
            return dpkt.pcapng.Reader(fh)
        except (ValueError, dpkt.UnpackError) as exc:
            raise CaptureError(f"{path}: not a pcap or pcapng file") from exc


#: One TCP segment as the connection tracker needs it.
#: (ts, family, src ip bytes, dst ip bytes, sport, dport, flags, seq, payload)
_Segment = tuple[float, int, bytes, bytes, int, int, int, int, memoryview]

_TH_FIN, _TH_SYN, _TH_ACK = dpkt.tcp.TH_FIN, dpkt.tcp.TH_SYN, dpkt.tcp.TH_ACK
_PCAP_MAGICS = {  # magic as read little-endian -> (byte order, timestamp divisor)
    0xA1B2C3D4: ("<", 1e6),
    0xD4C3B2A1: (">", 1e6),
    0xA1B23C4D: ("<", 1e9),
    0x4D3CB2A1: (">", 1e9),
}
_ETH_VLAN = (0x8100, 0x88A8)
_ETHERTYPE_IP4, _ETHERTYPE_IP6 = 0x0800, 0x86DD
_TCP_HEAD = struct.Struct("!HHIIBB")  # sport, dport, seq, ack, data offset, flags
_IP4_HEAD = struct.Struct("!BxHHHBB")  # version/ihl, total length, id, flags/fragment, ttl, protocol
_U16 = struct.Struct("!H")
_FAST_LINKTYPES = frozenset({_DLT_EN10MB, _DLT_LINUX_SLL, _DLT_NULL, _DLT_LOOP, _DLT_RAW, _DLT_RAW2})


def _ip_offset(linktype: int, buf: memoryview, n: int) -> int:
    """Offset of the IP header in a frame of ``linktype``, or -1 when the frame is not IP (or not handled)."""
    if linktype == _DLT_EN10MB:
        if n < 14:
            return -1
        off, (etype,) = 14, _U16.unpack_from(buf, 12)
        if etype in _ETH_VLAN and n >= 18:
            off, (etype,) = 18, _U16.unpack_from(buf, 16)
        return off if etype in (_ETHERTYPE_IP4, _ETHERTYPE_IP6) else -1
    if linktype == _DLT_LINUX_SLL:
        if n < 16:
            return -1
        (etype,) = _U16.unpack_from(buf, 14)
        return 16 if etype in (_ETHERTYPE_IP4, _ETHERTYPE_IP6) else -1
    if linktype in (_DLT_NULL, _DLT_LOOP):
        return 4 if n >= 4 else -1  # the address family word's byte order varies; the IP version nibble decides
    if linktype in (_DLT_RAW, _DLT_RAW2):
        return 0
    return -1


def _tcp_of_ip(buf: memoryview, off: int, n: int) -> tuple[int, bytes, bytes, int, int] | None:
    """(family, src, dst, tcp offset, end of IP payload) of a plain TCP-over-IP packet at ``off``, else None."""
    if n - off < 20:
        return None
    version = buf[off] >> 4
    if version == 4:
        vihl, total, _ident, frag, _ttl, proto = _IP4_HEAD.unpack_from(buf, off)
        ihl = (vihl & 0x0F) * 4
        if proto != 6 or frag & 0x3FFF or ihl < 20:  # not TCP, or a fragment
            return None
        end = min(off + total, n) if total else n  # 0: length left to the NIC (segmentation offload)
        return socket.AF_INET, bytes(buf[off + 12 : off + 16]), bytes(buf[off + 16 : off + 20]), off + ihl, end
    if version == 6:
        if n - off < 40 or buf[off + 6] != 6:  # extension headers: left to dpkt
            return None
        (plen,) = _U16.unpack_from(buf, off + 4)
        end = min(off + 40 + plen, n)
        return socket.AF_INET6, bytes(buf[off + 8 : off + 24]), bytes(buf[off + 24 : off + 40]), off + 40, end
    return None


def _dpkt_segment(linktype: int, ts: float, buf: bytes) -> _Segment | None:
    """The slow, general path for one frame."""
    try:
        ip = _ip_from_link(linktype, buf)
    except (dpkt.UnpackError, IndexError, ValueError, CaptureError):
        return None
    if not isinstance(ip, dpkt.ip.IP | dpkt.ip6.IP6) or not isinstance(ip.data, dpkt.tcp.TCP):
        return None
    tcp = ip.data
    family = socket.AF_INET6 if isinstance(ip, dpkt.ip6.IP6) else socket.AF_INET
    return ts, family, bytes(ip.src), bytes(ip.dst), tcp.sport, tcp.dport, tcp.flags, tcp.seq, memoryview(tcp.data)


def _fast_segments(data: bytes | mmap.mmap, notes: list[str]) -> Iterator[_Segment] | None:
    """Segments of a classic pcap file parsed with struct; None if the file is not one this path reads."""
    if len(data) < 24:
        return None
    magic = struct.unpack_from("<I", data, 0)[0]
    if magic not in _PCAP_MAGICS:
        return None
    order, divisor = _PCAP_MAGICS[magic]
    linktype = struct.unpack_from(order + "I", data, 20)[0] & 0x0FFFFFFF
    if linktype not in _FAST_LINKTYPES:
        return None
    record = struct.Struct(order + "IIII")
    tcp_head = _TCP_HEAD

    def gen() -> Iterator[_Segment]:
        mv = memoryview(data)
        pos, size = 24, len(data)
        while pos < size:
            if pos + 16 > size:
                notes.append(f"capture file truncated: {size - pos} bytes of a record header")
                return
            sec, frac, incl, _orig = record.unpack_from(data, pos)
            pos += 16
            if pos + incl > size:
                notes.append(f"capture file truncated: record of {incl} bytes has {size - pos}")
                return
            frame = mv[pos : pos + incl]
            pos += incl
            ts = sec + frac / divisor
            off = _ip_offset(linktype, frame, incl)
            ip = _tcp_of_ip(frame, off, incl) if off >= 0 else None
            if ip is None:
                if off >= 0 and incl - off >= 1 and (frame[off] >> 4) == 6:
                    seg = _dpkt_segment(linktype, ts, bytes(frame))  # IPv6 with extension headers
                    if seg is not None:
                        yield seg
                continue
            family, src, dst, t, end = ip
            if end - t < 20:
                continue
            sport, dport, seq, _ack, doff, flags = tcp_head.unpack_from(frame, t)
            start = t + (doff >> 4) * 4
            yield ts, family, src, dst, sport, dport, flags, seq, frame[start:end] if end > start else frame[0:0]

    return gen()


def _dpkt_segments(fh, notes: list[str], path: str | Path) -> Iterator[_Segment]:
    reader = _reader(fh, path)
    linktype = reader.datalink()
    try:
        for ts, buf in reader:
            seg = _dpkt_segment(linktype, ts, buf)
            if seg is not None:
                yield seg
    except (dpkt.NeedData, ValueError) as exc:
        notes.append(f"capture file truncated: {exc}")


def _load(path: str | Path) -> bytes | mmap.mmap:
    """The whole file, memory-mapped when possible.

    Mapping the page cache avoids filling fresh memory with a copy of the file (on a small machine that copy costs
    as much as the reassembly itself).  The map is never closed explicitly: payload views keep it alive until
    reassembly has copied them, and it is released with the last of them.
    """
    try:
        with open(path, "rb") as fh:
            try:
                flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0)
                return mmap.mmap(fh.fileno(), 0, flags=flags, prot=mmap.PROT_READ)
            except (ValueError, OSError, AttributeError):  # empty file, a pipe, or no mmap flags on this platform
                return fh.read()
    except OSError as exc:
        raise CaptureError(f"cannot open {path}: {exc.strerror}") from exc


def read_connections(path: str | Path, *, port: int | None = None) -> list[Connection]:
    """All TCP connections in a capture (optionally only those with ``port`` on either side), in start order."""
    conns: dict[tuple, Connection] = {}
    order: list[Connection] = []
    names: dict[tuple[int, bytes], str] = {}
    file_notes: list[str] = []

    def name(family: int, raw: bytes) -> str:
        text = names.get((family, raw))
        if text is None:
            text = names[(family, raw)] = socket.inet_ntop(family, raw)
        return text

    data = _load(path)
    segments = _fast_segments(data, file_notes)
    if segments is None:
        import io

        segments = _dpkt_segments(io.BytesIO(data), file_notes, path)
    for ts, family, src_raw, dst_raw, sport, dport, flags, seq, payload in segments:
        if port is not None and port not in (sport, dport):
            continue
        a, b = (name(family, src_raw), sport), (name(family, dst_raw), dport)
        key = (a, b) if a <= b else (b, a)
        syn, ack = bool(flags & _TH_SYN), bool(flags & _TH_ACK)
        conn = conns.get(key)
        if conn is None or (syn and not ack and conn.saw_syn and conn.c2s.segments):
            # A new connection (or a reused 4-tuple starting over with a fresh SYN).
            if syn and not ack:
                conn = Connection(len(order), a, b, ts, saw_syn=True)
            else:
                # Started mid-connection: the server is the side on the port asked for, else on the protocol's
                # default port, else (a guess) the side with the lower port.
                server_port = port if port is not None else DEFAULT_PORT
                if server_port in (sport, dport) and sport != dport:
                    client, server = (a, b) if dport == server_port else (b, a)
                else:
                    client, server = (a, b) if sport > dport else (b, a)
                conn = Connection(len(order), client, server, ts)
                conn.notes.append("capture starts after the TCP handshake: stream start guessed")
            conns[key] = conn
            order.append(conn)
        d = conn.c2s if a == conn.client else conn.s2c
        if syn:
            d.isn = (seq + 1) & 0xFFFFFFFF
            continue
        if flags & _TH_FIN and not d.fin:
            d.fin = True
            d.fin_peer_bytes = (conn.s2c if d is conn.c2s else conn.c2s).seen
        if payload.nbytes:
            d.seen += payload.nbytes
            if d.isn is None:
                d.isn = seq
            d.segments.append((seq, payload, ts))
    if file_notes and order:
        order[-1].notes.extend(file_notes)
    for conn in order:
        for d in (conn.c2s, conn.s2c):
            _reassemble(d)
        for label, d in (("client->server", conn.c2s), ("server->client", conn.s2c)):
            if d.gap_at is not None:
                conn.notes.append(f"{label}: bytes missing at stream offset {d.gap_at} (lost packets)")
    return order


def _reassemble(d: Direction) -> None:
    """Order segments by relative sequence number into one contiguous stream; stop at the first hole.

    The payloads are views of the capture: this is the one copy each direction's bytes make.
    """
    if not d.segments or d.isn is None:
        return
    isn = d.isn
    rel = [((seq - isn) & 0xFFFFFFFF, data, ts) for seq, data, ts in d.segments]
    if any(rel[i][0] > rel[i + 1][0] for i in range(len(rel) - 1)):
        rel.sort(key=lambda item: item[0])  # stable: of two copies of a segment, the first seen wins
    d.first_ts = rel[0][2]
    pieces: list[memoryview] = []
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
        pieces.append(memoryview(data)[pos - off :])
        pos = end
    # join sizes the result first and copies each piece once, into memory it does not zero beforehand
    out = bytearray().join(pieces)
    d.data = out
    d.segments = []
