"""Reading pcap / pcapng files into reassembled TCP connections, in bounded memory.

One pass over the file (:mod:`.pcapfiles`, struct over a memory map whose pages are dropped behind the walk) builds
an index: per connection and direction, where each TCP payload lies in the file (offset, length, sequence number,
timestamp), never the bytes.  Reassembly then orders each direction's segments by sequence number (unwrapped past
4 GiB): retransmitted segments are dropped, overlaps trimmed; a hole (lost packets) or a capture that starts after
the handshake is recorded on the connection and the stream is cut there, so decoding stops with that reason instead
of misparsing.  What remains is a :class:`~.spans.Stream` per direction: file ranges read on demand
(``HalfConnection.chunks()``), 16 bytes a kept segment.

Frames of the common link types (Ethernet, Linux cooked v1/v2, BSD loopback, raw IP) are parsed with
:mod:`struct`; any frame the fast path does not recognise (IPv6 extension headers, VLAN stacks beyond one tag...)
goes through dpkt, and its payload is kept in memory (those frames are rare).  A file neither walker reads is left
to dpkt's readers whole, payloads in memory.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator
from pathlib import Path

import dpkt
import numpy as np
from ggml_rpc.spec import Direction
from ggml_rpc.spec.facts import DEFAULT_PORT

from .connection import Connection, HalfConnection
from .pcapfiles import CaptureOpenError, Frame, kind, open_map, pcap_frames, pcapng_frames
from .spans import CaptureFile, Stream

# Link types we can strip down to IP.
_DLT_NULL, _DLT_EN10MB, _DLT_RAW, _DLT_LOOP, _DLT_LINUX_SLL, _DLT_RAW2, _DLT_LINUX_SLL2 = 0, 1, 12, 108, 113, 101, 276


class CaptureError(Exception):
    """A capture file that cannot be read at all."""


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


#: One TCP segment as the connection tracker needs it: (ts, family, src ip bytes, dst ip bytes, sport, dport, flags,
#: seq, payload file offset, payload length, payload bytes when only dpkt found it (else None)).
_Segment = tuple[float, int, bytes, bytes, int, int, int, int, int, int, bytes | None]

_TH_FIN, _TH_SYN, _TH_RST, _TH_ACK = dpkt.tcp.TH_FIN, dpkt.tcp.TH_SYN, dpkt.tcp.TH_RST, dpkt.tcp.TH_ACK
_ETH_VLAN = (0x8100, 0x88A8)
_ETHERTYPE_IP4, _ETHERTYPE_IP6 = 0x0800, 0x86DD
_TCP_HEAD = struct.Struct("!HHIIBB")  # sport, dport, seq, ack, data offset, flags
_IP4_HEAD = struct.Struct("!BxHHHBB")  # version/ihl, total length, id, flags/fragment, ttl, protocol
_U16 = struct.Struct("!H")
_FAST_LINKTYPES = frozenset({_DLT_EN10MB, _DLT_LINUX_SLL, _DLT_LINUX_SLL2, _DLT_NULL, _DLT_LOOP, _DLT_RAW, _DLT_RAW2})


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
    if linktype == _DLT_LINUX_SLL2:
        if n < 20:
            return -1
        (etype,) = _U16.unpack_from(buf, 0)
        return 20 if etype in (_ETHERTYPE_IP4, _ETHERTYPE_IP6) else -1
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
    """The slow, general path for one frame (its payload is kept: dpkt does not say where it lies)."""
    try:
        ip = _ip_from_link(linktype, buf)
    except (dpkt.UnpackError, IndexError, ValueError, CaptureError):
        return None
    if not isinstance(ip, dpkt.ip.IP | dpkt.ip6.IP6) or not isinstance(ip.data, dpkt.tcp.TCP):
        return None
    tcp = ip.data
    family = socket.AF_INET6 if isinstance(ip, dpkt.ip6.IP6) else socket.AF_INET
    payload = bytes(tcp.data)
    return ts, family, bytes(ip.src), bytes(ip.dst), tcp.sport, tcp.dport, tcp.flags, tcp.seq, -1, len(payload), \
        payload


def _segments(frames: Iterator[Frame]) -> Iterator[_Segment]:
    """The TCP segments of ``frames``, payloads located in the file (the struct path) or kept (dpkt's)."""
    tcp_head = _TCP_HEAD
    for ts, linktype, frame, at in frames:
        incl = frame.nbytes
        if linktype not in _FAST_LINKTYPES:
            seg = _dpkt_segment(linktype, ts, bytes(frame))
            if seg is not None:
                yield seg
            continue
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
        n = max(0, end - start)
        if at < 0:  # a frame dpkt's readers handed over: no file offset, the payload is kept
            yield ts, family, src, dst, sport, dport, flags, seq, -1, n, bytes(frame[start : start + n])
        else:
            yield ts, family, src, dst, sport, dport, flags, seq, at + start, n, None


def _dpkt_frames(data: bytes, notes: list[str], path: str | Path) -> Iterator[Frame]:
    """Frames of a file only dpkt's readers take (no file offsets: payloads are kept)."""
    import io

    reader = _reader(io.BytesIO(data), path)
    linktype = reader.datalink()
    try:
        for ts, buf in reader:
            yield ts, linktype, memoryview(buf), -1
    except (dpkt.NeedData, ValueError) as exc:
        notes.append(f"capture file truncated: {exc}")


def read_connections(path: str | Path, *, port: int | None = None) -> list[Connection]:
    """All TCP connections in a capture (optionally only those with ``port`` on either side), in start order.

    Each direction's bytes stay in the file: read them with ``HalfConnection.chunks()`` (or ``.data``, whole)."""
    conns: dict[tuple, Connection] = {}
    order: list[Connection] = []
    names: dict[tuple[int, bytes], str] = {}
    file_notes: list[str] = []

    def name(family: int, raw: bytes) -> str:
        text = names.get((family, raw))
        if text is None:
            text = names[(family, raw)] = socket.inet_ntop(family, raw)
        return text

    try:
        data = open_map(path)
        capture = CaptureFile(path)
    except (CaptureOpenError, OSError) as exc:
        raise CaptureError(str(exc) if isinstance(exc, CaptureOpenError) else f"cannot open {path}: {exc}") from exc
    fmt = kind(data)
    if fmt == "pcap":
        frames = pcap_frames(data, file_notes)
    elif fmt == "pcapng":
        frames = pcapng_frames(data, file_notes)
    else:
        frames = _dpkt_frames(bytes(data), file_notes, path)
    for ts, family, src_raw, dst_raw, sport, dport, flags, seq, at, n, kept in _segments(frames):
        if port is not None and port not in (sport, dport):
            continue
        a, b = (name(family, src_raw), sport), (name(family, dst_raw), dport)
        key = (a, b) if a <= b else (b, a)
        syn, ack = bool(flags & _TH_SYN), bool(flags & _TH_ACK)
        conn = conns.get(key)
        if conn is None or (syn and not ack and conn.saw_syn and conn.c2s.index is not None
                            and len(conn.c2s.index.seq)):
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
        if flags & _TH_RST:
            d.rst = True
        if flags & _TH_FIN and not d.fin:
            d.fin = True
            d.fin_peer_bytes = (conn.s2c if d is conn.c2s else conn.c2s).seen
        if n:
            d.seen += n
            if d.isn is None:
                d.isn = seq
            ix = d.index
            assert ix is not None
            ix.seq.append(seq)
            ix.length.append(n)
            ix.ts.append(ts)
            if kept is None and at >= 0:
                ix.off.append(at)
            else:
                ix.off.append(-1 - len(ix.memory))
                ix.memory.append(kept if kept is not None else b"")
    if file_notes and order:
        order[-1].notes.extend(file_notes)
    for conn in order:
        for d in (conn.c2s, conn.s2c):
            _reassemble(d, capture)
        _mark_cut(conn, truncated=bool(file_notes))
        for label, d in ((Direction.C2S, conn.c2s), (Direction.S2C, conn.s2c)):
            if d.gap_at is not None:
                conn.notes.append(f"{label}: bytes missing at stream offset {d.gap_at} (lost packets)")
    return order


def _mark_cut(conn: Connection, *, truncated: bool) -> None:
    """Which directions the capture stopped before they ended: without FIN or RST in a file cut short; in a whole
    file only when neither side closed (once one has, the other's silence is its own: a client that left before
    its reply, a server that never answered)."""
    closed = [d.fin or d.rst for d in (conn.c2s, conn.s2c)]
    for d, done in zip((conn.c2s, conn.s2c), closed, strict=True):
        d.cut = not done and (truncated or not any(closed))


def _reassemble(d: HalfConnection, capture: CaptureFile) -> None:
    """Order segments by sequence number into one contiguous stream of file ranges; stop at the first hole.

    Sequence numbers are unwrapped segment to segment (a direction may carry more than 4 GiB); a segment before
    the ISN is a stale retransmission.  Of two copies of a segment the first seen wins (a stable sort).
    """
    ix, d.index = d.index, None
    d.stream = Stream(capture)
    if ix is None or not len(ix.seq) or d.isn is None:
        return
    rel32 = (np.frombuffer(ix.seq, dtype=np.uint32).astype(np.int64) - d.isn) & 0xFFFFFFFF
    step = (np.diff(rel32) + (1 << 31)) % (1 << 32) - (1 << 31)
    first = int(rel32[0]) - (1 << 32 if rel32[0] >= 1 << 31 else 0)
    rel = np.concatenate(([first], first + np.cumsum(step)))
    order = np.argsort(rel, kind="stable")
    rel = rel[order]
    ts = np.frombuffer(ix.ts, dtype=np.float64)[order]
    lens = np.frombuffer(ix.length, dtype=np.uint32).astype(np.int64)[order]
    offs = np.frombuffer(ix.off, dtype=np.int64)[order]
    live = rel >= 0
    d.first_ts = float(ts[live][0] if live.any() else ts[0])
    rel, lens, offs = rel[live], lens[live], offs[live]
    if not len(rel):
        return
    ends = rel + lens
    before = np.maximum(np.concatenate(([0], np.maximum.accumulate(ends)[:-1])), 0)  # stream filled so far
    holes = np.flatnonzero(rel > before)
    if len(holes):
        cut = int(holes[0])
        d.gap_at = int(before[cut])
        rel, lens, offs, ends, before = rel[:cut], lens[:cut], offs[:cut], ends[:cut], before[:cut]
    new = ends > before  # anything else is a retransmission
    starts, trims, offs, ends = before[new], (before - rel)[new], offs[new], ends[new]
    stream = d.stream
    if (offs >= 0).all():
        stream.pos.frombytes(starts.astype(np.int64).tobytes())
        stream.off.frombytes((offs + trims).astype(np.int64).tobytes())
        stream.size = int(ends[-1]) if len(ends) else 0
        return
    for start, trim, off, end in zip(starts.tolist(), trims.tolist(), offs.tolist(), ends.tolist(), strict=True):
        if off >= 0:
            stream.add_file(off + trim, end - start)
        else:
            stream.add_memory(memoryview(ix.memory[-1 - off])[trim:])
