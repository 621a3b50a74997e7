"""Writing ggml RPC sessions as standard pcap files with real TCP framing.

A session is, per connection, the bytes each side wrote, in order.  Each connection becomes what a loopback
``tcpdump`` would have seen: a three-way handshake (MSS and window-scale options), data cut into segments of at
most ``mss`` bytes with consistent sequence and acknowledgement numbers, pure ACKs from the receiver, and a FIN
teardown.  Any pcap tool (Wireshark, tshark, dpkt, scapy) reads the result without analysis warnings.

scapy builds the few packets that carry options (SYN, SYN-ACK) and the per-connection header templates; the bulk
data segments are then written from those templates with the header fields patched in place, because building one
scapy object per 64 KiB segment would cap the writer far below disk speed.  Payload bytes are written straight from
the caller's buffers (no copy); checksums are real (numpy sums the payload words).
"""

from __future__ import annotations

import ipaddress
import struct
import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
from scapy.layers.inet import IP, TCP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import Ether

#: Largest segment an IPv4 packet can carry (65535 - 20 IP - 20 TCP); also what Linux loopback announces.
MAX_MSS = 65495
DEFAULT_MSS = MAX_MSS
#: Window scale announced in the SYNs: 65535 << 7 = 8 MiB of window, so bulk transfers never fill it.
WINDOW_SCALE = 7
WINDOW = 0xFFFF
#: The receiver acknowledges at least every this many segments (and at the end of every write).
ACK_EVERY = 16
_PCAP_MAGIC = 0xA1B2C3D4
_LINKTYPE_ETHERNET = 1
_RECORD = struct.Struct("<IIII")
_ZERO_MAC = "00:00:00:00:00:00"
_FIN, _SYN, _PSH, _ACK = 0x01, 0x02, 0x08, 0x10

#: Which way a write goes, as the flows take it (``from_client``).
_FROM_CLIENT, _FROM_SERVER = True, False


def _fold(total: int) -> int:
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return total


def _words_sum(data: bytes | bytearray | memoryview) -> int:
    """Sum of the big-endian 16-bit words of ``data`` (odd length padded with a zero byte)."""
    mv = memoryview(data).cast("B")
    n = mv.nbytes
    even = n & ~1
    total = int(np.frombuffer(mv[:even], dtype=">u2").sum(dtype=np.uint64)) if even else 0
    if n & 1:
        total += mv[n - 1] << 8
    return total


@dataclass
class _Side:
    ip: bytes
    port: int
    seq: int  # next sequence number this side sends
    ip_id: int = 1


class TcpFlow:
    """One TCP connection being written: call :meth:`write` for each side's bytes, then :meth:`close`."""

    def __init__(self, writer: PcapWriter, client: tuple[str, int], server: tuple[str, int], *, mss: int,
                 isn: tuple[int, int]) -> None:
        if not 1 <= mss <= MAX_MSS:
            raise ValueError(f"mss must be 1 .. {MAX_MSS}, got {mss}")
        ca, sa = ipaddress.ip_address(client[0]), ipaddress.ip_address(server[0])
        if ca.version != sa.version:
            raise ValueError("client and server addresses must be of the same IP version")
        self._w = writer
        self.mss = mss
        self.v6 = ca.version == 6
        self._c = _Side(ca.packed, client[1], isn[0])
        self._s = _Side(sa.packed, server[1], isn[1])
        self._templates = {_FROM_CLIENT: self._template(self._c, self._s),
                           _FROM_SERVER: self._template(self._s, self._c)}
        # Word sums of the header fields that never change for a direction: the per-segment checksums are then
        # these plus a few integers (lengths, ip id, seq/ack, flags) plus the payload's sum.
        self._ip_const: dict[bool, int] = {}
        self._tcp_const: dict[bool, int] = {}
        for d, (a, b) in ((_FROM_CLIENT, (self._c, self._s)), (_FROM_SERVER, (self._s, self._c))):
            self._ip_const[d] = 0x4500 + 0x4000 + (64 << 8) + 6 + _words_sum(a.ip + b.ip)
            self._tcp_const[d] = _words_sum(a.ip + b.ip) + 6 + a.port + b.port + WINDOW
        self._unacked = {_FROM_CLIENT: 0, _FROM_SERVER: 0}  # segments sent since the receiver's last ACK
        self._open = False
        self._closed = False

    # ---- headers -------------------------------------------------------------------------------------------

    def _ether_ip(self, src: _Side, dst: _Side):
        ip_src, ip_dst = (str(ipaddress.ip_address(src.ip)), str(ipaddress.ip_address(dst.ip)))
        eth = Ether(src=_ZERO_MAC, dst=_ZERO_MAC)
        if self.v6:
            return eth / IPv6(src=ip_src, dst=ip_dst, hlim=64)
        return eth / IP(src=ip_src, dst=ip_dst, flags="DF", ttl=64, id=0)

    def _template(self, src: _Side, dst: _Side) -> bytearray:
        """Ethernet + IP + 20-byte TCP header built by scapy once; per segment only a few fields get patched."""
        pkt = self._ether_ip(src, dst) / TCP(sport=src.port, dport=dst.port, flags="A", window=WINDOW)
        return bytearray(bytes(pkt))

    def _control(self, direction: bool, flags: str, *, syn_options: bool = False) -> None:
        """A segment without payload that scapy builds entirely (handshake and teardown)."""
        src, dst = (self._c, self._s) if direction else (self._s, self._c)
        opts = [("MSS", self.mss), ("NOP", None), ("WScale", WINDOW_SCALE)] if syn_options else []
        ack = dst.seq if "A" in flags else 0
        pkt = self._ether_ip(src, dst) / TCP(sport=src.port, dport=dst.port, flags=flags, seq=src.seq, ack=ack,
                                             window=WINDOW, options=opts)
        if not self.v6:
            pkt[IP].id = src.ip_id
            src.ip_id = (src.ip_id + 1) & 0xFFFF
        self._w._record(bytes(pkt), b"")
        if "S" in flags or "F" in flags:
            src.seq = (src.seq + 1) & 0xFFFFFFFF

    def _segment(self, direction: bool, payload: memoryview, flags: int, payload_sum: int | None = None) -> None:
        """One data (or pure ACK) segment from the template; checksums by arithmetic on 16-bit word sums."""
        src, dst = (self._c, self._s) if direction else (self._s, self._c)
        hdr = self._templates[direction]
        n = payload.nbytes
        if self.v6:
            tcp_off = 54
            struct.pack_into(">H", hdr, 18, 20 + n)
        else:
            tcp_off = 34
            ip_sum = self._ip_const[direction] + 40 + n + src.ip_id
            struct.pack_into(">HH", hdr, 16, 40 + n, src.ip_id)
            struct.pack_into(">H", hdr, 24, 0xFFFF - _fold(ip_sum))
            src.ip_id = (src.ip_id + 1) & 0xFFFF
        seq, ack = src.seq, dst.seq
        struct.pack_into(">IIBB", hdr, tcp_off + 4, seq, ack, 5 << 4, flags)
        if payload_sum is None:
            payload_sum = _words_sum(payload) if n else 0
        total = (self._tcp_const[direction] + 20 + n + (seq >> 16) + (seq & 0xFFFF) + (ack >> 16) + (ack & 0xFFFF)
                 + ((5 << 12) | flags) + payload_sum)
        struct.pack_into(">H", hdr, tcp_off + 16, 0xFFFF - _fold(total))
        self._w._record(hdr, payload)
        src.seq = (seq + n) & 0xFFFFFFFF

    def _ack(self, direction: bool) -> None:
        """A pure ACK from the side opposite to ``direction`` (the receiver of those bytes)."""
        self._segment(not direction, memoryview(b""), _ACK)
        self._unacked[direction] = 0

    # ---- public ----------------------------------------------------------------------------------------------

    def open(self, ts: float | None = None) -> None:
        """The three-way handshake."""
        if self._open:
            return
        self._w._advance(ts)
        self._control(_FROM_CLIENT, "S", syn_options=True)
        self._control(_FROM_SERVER, "SA", syn_options=True)
        self._control(_FROM_CLIENT, "A")
        self._open = True

    def write(self, from_client: bool, data: bytes | bytearray | memoryview, ts: float | None = None) -> None:
        """Bytes one side wrote to its socket, segmented at the MSS and acknowledged by the other side."""
        if self._closed:
            raise ValueError("write on a closed flow")
        if not self._open:
            self.open(ts)
        mv = memoryview(data).cast("B")
        if not mv.nbytes:
            return
        self._w._advance(ts)
        n = mv.nbytes
        mss = self.mss
        full = n // mss
        sums = None
        if full > 1 and mss % 2 == 0:
            # Every full segment's payload word sum in one numpy pass.
            words = np.frombuffer(mv[: full * mss], dtype=">u2").reshape(full, mss // 2)
            sums = words.sum(axis=1, dtype=np.uint64).tolist()
        for i, start in enumerate(range(0, n, mss)):
            chunk = mv[start : start + mss]
            last = start + mss >= n
            psum = sums[i] if sums is not None and i < full else None
            self._segment(from_client, chunk, _ACK | (_PSH if last else 0), psum)
            self._unacked[from_client] += 1
            if not last and self._unacked[from_client] >= ACK_EVERY:
                self._ack(from_client)
        self._ack(from_client)

    def leave(self, reply: bytes | bytearray | memoryview = b"", ts: float | None = None) -> None:
        """The client closes before reading: its FIN goes out right after its last request, the server's ``reply``
        (what it writes into the closed socket) follows, and the client's host answers that with a reset."""
        if self._closed:
            return
        if not self._open:
            self.open(ts)
        self._w._advance(ts)
        self._control(_FROM_CLIENT, "FA")
        self._ack(_FROM_CLIENT)  # the server acknowledges the FIN
        mv = memoryview(reply).cast("B")
        if mv.nbytes:
            for start in range(0, mv.nbytes, self.mss):
                self._segment(_FROM_SERVER, mv[start : start + self.mss], _ACK | _PSH)
            self._control(_FROM_CLIENT, "R")
        self._closed = True

    def close(self, ts: float | None = None, *, client_first: bool = True) -> None:
        """FIN from one side, FIN-ACK from the other, final ACK."""
        if self._closed:
            return
        if not self._open:
            self.open(ts)
        self._w._advance(ts)
        first = _FROM_CLIENT if client_first else _FROM_SERVER
        self._control(first, "FA")
        self._control(not first, "FA")
        self._control(first, "A")
        self._closed = True


class PcapWriter:
    """A pcap file (Ethernet link type, microsecond timestamps) receiving TCP flows.

    Timestamps: pass the real time of each write (the proxy does) or let the writer invent a clock that starts at
    ``start`` and advances one microsecond per packet.  Either way they never go backwards.
    """

    def __init__(self, target: str | Path | BinaryIO, *, snaplen: int = 262144, start: float | None = None) -> None:
        if isinstance(target, str | Path):
            self._fh: BinaryIO = open(target, "wb", buffering=1 << 20)
            self._owned = True
        else:
            self._fh, self._owned = target, False
        self.snaplen = snaplen
        self._clock = time.time() if start is None else start
        self._next_port = 40000
        self.packets = 0
        self.payload_bytes = 0
        self._fh.write(struct.pack("<IHHiIII", _PCAP_MAGIC, 2, 4, 0, 0, snaplen, _LINKTYPE_ETHERNET))

    def _advance(self, ts: float | None) -> None:
        if ts is not None and ts > self._clock:
            self._clock = ts

    def _record(self, header: bytes | bytearray, payload: memoryview | bytes) -> None:
        n = len(header) + len(payload)
        sec = int(self._clock)
        usec = round((self._clock - sec) * 1e6)
        if usec >= 1000000:
            sec, usec = sec + 1, usec - 1000000
        self._fh.write(_RECORD.pack(sec, usec, n, n))
        self._fh.write(header)
        if len(payload):
            self._fh.write(payload)
        self._clock += 1e-6
        self.packets += 1
        self.payload_bytes += len(payload)

    def flow(
        self,
        client: tuple[str, int] | None = None,
        server: tuple[str, int] = ("127.0.0.1", 50052),
        *,
        mss: int = DEFAULT_MSS,
        isn: tuple[int, int] | None = None,
    ) -> TcpFlow:
        """A new TCP connection; the client port defaults to a fresh ephemeral-looking number per flow."""
        if client is None:
            client = (server[0], self._next_port)
            self._next_port = 40000 + (self._next_port - 40000 + 1) % 20000
        if isn is None:
            isn = ((client[1] * 2654435761) & 0xFFFFFFFF, (server[1] * 2246822519 + client[1]) & 0xFFFFFFFF)
        if mss > MAX_MSS:
            raise ValueError(f"mss must be at most {MAX_MSS}")
        if self.snaplen < mss + 74:
            raise ValueError(f"snaplen {self.snaplen} cannot hold a full {mss}-byte segment")
        return TcpFlow(self, client, server, mss=mss, isn=isn)

    def close(self) -> None:
        if self._owned:
            self._fh.close()
        else:
            self._fh.flush()

    def __enter__(self) -> PcapWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


Write = tuple[bool, bytes | bytearray | memoryview]


def write_session(
    path: str | Path,
    connections: Iterable[Sequence[Write]],
    *,
    server: tuple[str, int] = ("127.0.0.1", 50052),
    mss: int = DEFAULT_MSS,
    start: float | None = None,
    early: Collection[int] = (),
) -> None:
    """Write each connection's ordered writes ``(from_client, bytes)`` as one TCP flow of a new pcap file.

    ``early``: indices of connections whose client leaves before reading the reply to its last request (its FIN
    comes before that reply: :meth:`TcpFlow.leave`); ``ggml-rpc replay`` then leaves at the same point.
    """
    with PcapWriter(path, start=start) as w:
        for number, writes in enumerate(connections):
            flow = w.flow(server=server, mss=mss)
            flow.open()
            writes = list(writes)
            last = max((i for i, (from_client, _) in enumerate(writes) if from_client), default=-1) \
                if number in early else len(writes)
            for from_client, data in writes[: last + 1]:
                flow.write(from_client, data)
            if number in early:
                flow.leave(b"".join(bytes(data) for from_client, data in writes[last + 1 :] if not from_client))
            else:
                flow.close()
