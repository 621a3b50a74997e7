"""What bytes a server never wrote look like: the classification behind DATA-030 and the fuzzer's info-leak findings.

A buffer the client never wrote should read back as one constant (zeros, or a poison fill).  Anything else came
from some other allocation; the evidence says which kind, because pointer-like words are what turns an
uninitialised read into an address-space leak (ASLR defeated, heap layout exposed).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

#: x86-64 / arm64 Linux user space: where mmap'd regions, shared libraries, thread arenas and stacks live.
MMAP_LOW, MMAP_HIGH = 0x0000_7F00_0000_0000, 0x0000_7FFF_FFFF_FFFF
#: Where the brk heap of a PIE program lives (just above the executable, randomised in 0x55.. / 0x56..).
HEAP_LOW, HEAP_HIGH = 0x0000_5500_0000_0000, 0x0000_56FF_FFFF_FFFF
#: Pointer-like words quoted in the evidence.
QUOTED = 4


@dataclass(slots=True)
class LeakReport:
    """How a never-written region read back."""

    size: int
    #: The region holds one repeated byte value that is not the freed allocation's fill (nothing leaked).
    constant: bool
    #: Bytes equal to the marker byte of an earlier, freed allocation.
    marker_bytes: int = 0
    #: 8-byte aligned little-endian words in the mmap/library/stack range, and in the brk-heap range.
    mmap_words: list[int] = field(default_factory=list)
    heap_words: list[int] = field(default_factory=list)
    nonzero: int = 0

    @property
    def leaked(self) -> bool:
        return not self.constant

    @property
    def looks_like_addresses(self) -> bool:
        return bool(self.mmap_words or self.heap_words)

    @property
    def symptom(self) -> str:
        """A short, stable name for the kind of leak (a deduplication key for the fuzzer)."""
        if not self.leaked:
            return "none"
        if self.looks_like_addresses:
            return "pointers"
        if self.marker_bytes:
            return "freed-data"
        return "stale-bytes"

    def describe(self) -> str:
        if not self.leaked:
            return f"{self.size} bytes, all one value"
        parts = [f"{self.nonzero} of {self.size} bytes non-zero"]
        if self.marker_bytes:
            parts.append(f"{self.marker_bytes} bytes of a freed buffer's fill")
        if self.mmap_words:
            parts.append(f"{len(self.mmap_words)} words look like mmap/library/stack addresses ("
                         + ", ".join(f"{w:#x}" for w in self.mmap_words[:QUOTED]) + ")")
        if self.heap_words:
            parts.append(f"{len(self.heap_words)} words look like heap addresses ("
                         + ", ".join(f"{w:#x}" for w in self.heap_words[:QUOTED]) + ")")
        return "; ".join(parts)


def classify(data: bytes | bytearray | memoryview, marker: int | None = None) -> LeakReport:
    """Classify bytes read from a region the client never wrote (``marker``: the fill of a freed allocation)."""
    raw = bytes(data)
    values = set(raw)
    # A region that is all the freed buffer's fill is that buffer's data handed out again, not a poison fill.
    report = LeakReport(size=len(raw), constant=len(values) <= 1 and (marker is None or values != {marker}))
    if report.constant:
        return report
    report.nonzero = len(raw) - raw.count(0)
    if marker is not None:
        report.marker_bytes = raw.count(bytes([marker]))
    whole = len(raw) // 8
    for (word,) in struct.iter_unpack("<Q", raw[: whole * 8]):
        if MMAP_LOW <= word <= MMAP_HIGH:
            report.mmap_words.append(word)
        elif HEAP_LOW <= word <= HEAP_HIGH:
            report.heap_words.append(word)
    return report


def pointer_words(data: bytes | bytearray | memoryview) -> list[int]:
    """The 8-byte aligned words of ``data`` that look like user-space addresses (either range)."""
    raw = bytes(data)
    whole = len(raw) // 8
    return [w for (w,) in struct.iter_unpack("<Q", raw[: whole * 8])
            if MMAP_LOW <= w <= MMAP_HIGH or HEAP_LOW <= w <= HEAP_HIGH]


__all__ = ["HEAP_HIGH", "HEAP_LOW", "MMAP_HIGH", "MMAP_LOW", "LeakReport", "classify", "pointer_words"]
