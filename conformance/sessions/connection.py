"""One TCP connection as the session decoder reads it: two directions, each a byte stream (:class:`~.spans.Stream`)
with what the capture said of its end (FIN, RST, a cut, a hole).  :mod:`.capture` builds them from a pcap; a check's
recorded exchange (:mod:`ggml_rpc.conformance.harness.exchange`) and tests build them from bytes
(:meth:`Connection.from_streams`), so captured and recorded traffic are one type.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field

from .spans import Stream


class _Index:
    """Where a direction's TCP payloads lie, in capture order (24 bytes a segment; dropped after reassembly)."""

    __slots__ = ("length", "memory", "off", "seq", "ts")

    def __init__(self) -> None:
        self.seq = array("I")
        self.off = array("q")  # file offset, or -1 - k for memory[k] (a payload only dpkt could find)
        self.length = array("I")
        self.ts = array("d")
        self.memory: list[bytes] = []


@dataclass
class HalfConnection:
    """One direction of a TCP connection (a TCP half-connection): its bytes, and how it ended."""

    isn: int | None = None  # sequence number of the first payload byte (after SYN)
    fin: bool = False
    rst: bool = False
    #: The capture stopped before this direction ended (see :func:`_mark_cut`): a message cut at the end of its
    #: stream is damage to the capture, not a peer breaking the spec.
    cut: bool = False
    #: Bytes the other direction had carried when this side's FIN came (a client FIN before replies it never read).
    fin_peer_bytes: int | None = None
    #: Payload bytes seen so far in this direction (retransmissions included: an upper bound, exact when clean).
    seen: int = 0
    #: Stream offset where bytes went missing (the stream is cut there), or None.
    gap_at: int | None = None
    #: Timestamp of the segment that starts the stream.
    first_ts: float | None = None
    #: The reassembled bytes, read from the capture on demand.
    stream: Stream = field(default_factory=Stream)
    index: _Index | None = field(default_factory=_Index, repr=False)

    @property
    def size(self) -> int:
        """Bytes in the reassembled stream."""
        return self.stream.size

    def chunks(self, start: int = 0, stop: int | None = None) -> Iterator[memoryview]:
        """The stream's bytes in order, as views read a window (a few MiB) at a time."""
        return self.stream.chunks(start, stop)

    @property
    def data(self) -> bytes:
        """The whole stream, read into memory: for small captures and tests; large ones use :meth:`chunks`."""
        return self.stream.read(0, self.stream.size)

    @data.setter
    def data(self, value: bytes | bytearray | memoryview) -> None:
        # Streams that exist only in memory (the harness's recorded exchanges, tests) are set as bytes.
        self.stream = Stream.from_bytes(value)


@dataclass
class Connection:
    """A reassembled TCP connection."""

    index: int
    client: tuple[str, int]
    server: tuple[str, int]
    start: float
    c2s: HalfConnection = field(default_factory=HalfConnection)
    s2c: HalfConnection = field(default_factory=HalfConnection)
    saw_syn: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.client[0]}:{self.client[1]} -> {self.server[0]}:{self.server[1]}"

    @classmethod
    def from_streams(cls, index: int, client: tuple[str, int], server: tuple[str, int], start: float,
                     c2s: bytes | bytearray | memoryview, s2c: bytes | bytearray | memoryview, *,
                     cut: bool = False) -> Connection:
        """A connection known as its two byte streams rather than from a capture: a check's recorded exchange
        (:mod:`ggml_rpc.conformance.harness.exchange`), a test's bytes.  ``cut``: the streams end where recording
        stopped, not where the peers stopped, so a decoder must not call the cut a violation."""
        conn = cls(index, client, server, start, saw_syn=True)
        conn.c2s.data, conn.s2c.data = c2s, s2c
        if cut:
            conn.c2s.gap_at, conn.s2c.gap_at = conn.c2s.size, conn.s2c.size
        return conn


__all__ = ["Connection", "HalfConnection"]
