"""The frames of a pcap or pcapng file, each with where it lies in the file, read in bounded memory.

Both formats are walked with :mod:`struct` over a memory map of the file.  Only record and block headers are
touched, and the pages behind the walk are dropped from the process as it goes (``MADV_DONTNEED``): a multi-GB
capture is indexed without its bytes ever being resident at once.  A frame is handed out as a view of the map with
its file offset, so the caller can record where a TCP payload lies instead of copying it.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator
from pathlib import Path

#: (timestamp, link type, frame bytes, file offset of the frame's first byte)
Frame = tuple[float, int, memoryview, int]

_PCAP_MAGICS = {  # magic as read little-endian -> (byte order, timestamp divisor)
    0xA1B2C3D4: ("<", 1e6),
    0xD4C3B2A1: (">", 1e6),
    0xA1B23C4D: ("<", 1e9),
    0x4D3CB2A1: (">", 1e9),
}
_PCAPNG_SHB = 0x0A0D0D0A
_PCAPNG_BYTE_ORDER = 0x1A2B3C4D
#: Bytes walked between two releases of the pages behind.
_RELEASE_EVERY = 64 << 20


class CaptureOpenError(Exception):
    """The file cannot be opened or mapped."""


def open_map(path: str | Path) -> mmap.mmap | bytes:
    """The file mapped read-only (not populated: pages come in as the walk touches them), or its bytes when it
    cannot be mapped (empty file, pipe)."""
    try:
        with open(path, "rb") as fh:
            try:
                return mmap.mmap(fh.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
            except (ValueError, OSError, AttributeError):
                return fh.read()
    except OSError as exc:
        raise CaptureOpenError(f"cannot open {path}: {exc.strerror}") from exc


class _Releaser:
    """Drops the mapped pages the walk has left behind, so resident memory stays at a window, not the file."""

    def __init__(self, data: mmap.mmap | bytes) -> None:
        self.data = data
        self.done = 0
        self.can = isinstance(data, mmap.mmap) and hasattr(data, "madvise") and hasattr(mmap, "MADV_DONTNEED")

    def passed(self, pos: int) -> None:
        if self.can and pos - self.done >= _RELEASE_EVERY:
            end = pos - pos % mmap.PAGESIZE
            self.data.madvise(mmap.MADV_DONTNEED, self.done, end - self.done)  # type: ignore[union-attr]
            self.done = end


def kind(data: mmap.mmap | bytes) -> str | None:
    """"pcap", "pcapng" or None for what the file's first bytes say."""
    if len(data) < 12:
        return None
    magic = struct.unpack_from("<I", data, 0)[0]
    if magic in _PCAP_MAGICS and len(data) >= 24:
        return "pcap"
    if magic == _PCAPNG_SHB:
        return "pcapng"
    return None


def pcap_frames(data: mmap.mmap | bytes, notes: list[str]) -> Iterator[Frame]:
    """Frames of a classic pcap file."""
    order, divisor = _PCAP_MAGICS[struct.unpack_from("<I", data, 0)[0]]
    linktype = struct.unpack_from(order + "I", data, 20)[0] & 0x0FFFFFFF
    record = struct.Struct(order + "IIII")
    mv = memoryview(data)
    release = _Releaser(data)
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
        yield sec + frac / divisor, linktype, mv[pos : pos + incl], pos
        pos += incl
        release.passed(pos)


def _tsresol(options: memoryview, order: str) -> tuple[float, int]:
    """(timestamp units per second, offset in seconds) from an interface description's options (computed as dpkt
    does, so timestamps come out the same)."""
    divisor, offset, at = 1e6, 0, 0
    while at + 4 <= options.nbytes:
        code, length = struct.unpack_from(order + "HH", options, at)
        value = options[at + 4 : at + 4 + length]
        if code == 0:
            break
        if code == 9 and length >= 1:
            v = value[0]
            divisor = float((2 if v & 0x80 else 10) ** (v & 0x7F))
        elif code == 14 and length >= 8:
            offset = struct.unpack_from(order + "q", value, 0)[0]
        at += 4 + length + (-length % 4)
    return divisor, offset


def pcapng_frames(data: mmap.mmap | bytes, notes: list[str]) -> Iterator[Frame]:
    """Frames of a pcapng file: enhanced and (obsolete) packet blocks, each interface its link type.  Simple packet
    blocks (no timestamp, no interface) are skipped, as dpkt skips them."""
    mv = memoryview(data)
    release = _Releaser(data)
    pos, size = 0, len(data)
    order = "<"
    ifaces: list[tuple[int, float, int]] = []  # (link type, timestamp units per second, offset in seconds)
    while pos < size:
        if pos + 12 > size:
            notes.append(f"capture file truncated: {size - pos} bytes of a block header")
            return
        btype = struct.unpack_from(order + "I", data, pos)[0]
        if btype == _PCAPNG_SHB:
            (magic,) = struct.unpack_from("<I", data, pos + 8)
            order = "<" if magic == _PCAPNG_BYTE_ORDER else ">"
            ifaces = []
        blen = struct.unpack_from(order + "I", data, pos + 4)[0]
        if blen < 12 or pos + blen > size:
            notes.append(f"capture file truncated: block of {blen} bytes has {size - pos}")
            return
        body = pos + 8
        if btype == 1 and blen >= 20:  # interface description
            (link,) = struct.unpack_from(order + "H", data, body)
            ifaces.append((link, *_tsresol(mv[body + 8 : pos + blen - 4], order)))
        elif btype in (6, 2) and blen >= 32:  # enhanced packet / obsolete packet
            if btype == 6:
                iface, hi, lo, caplen, _orig = struct.unpack_from(order + "IIIII", data, body)
            else:
                iface, _drops, hi, lo, caplen, _orig = struct.unpack_from(order + "HHIIII", data, body)
            start = body + 20
            if iface < len(ifaces) and start + caplen <= pos + blen:
                link, divisor, offset = ifaces[iface]
                yield offset + ((hi << 32) | lo) / divisor, link, mv[start : start + caplen], start
        pos += blen
        release.passed(pos)
