"""A capture's TCP streams as file ranges, read on demand: what keeps memory bounded whatever the capture's size.

:class:`Stream` is one reassembled direction of a connection: an ordered list of pieces, each a range of the capture
file (or, for the rare packet only dpkt parses and for streams built from bytes, a buffer in memory).  Nothing is
read until asked; reads go through ``os.pread`` in windows of a few MiB, so what a reader holds is one window.

:class:`LazyBytes` is a range of a stream (a message's payload or bulk data): its length is known, its bytes are
read when asked -- as pieces (:meth:`LazyBytes.chunks`, :meth:`LazyBytes.slices`), hashed piece by piece (the
spec's ``fnv1a64`` takes it), or whole (``bytes(x)``, for small ranges).  Python 3.11 objects cannot offer the
buffer protocol, so code that needs a buffer of a possibly lazy value goes through :func:`as_buffer`.
"""

from __future__ import annotations

import os
import weakref
from array import array
from bisect import bisect_right
from collections.abc import Iterator
from pathlib import Path

#: Bytes read from the file at once (one pread when the pieces lie close together).
WINDOW = 4 << 20


class CaptureFile:
    """A capture file open for positional reads, shared by every stream of the capture (closed with the last)."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self.fd = os.open(path, os.O_RDONLY)
        weakref.finalize(self, os.close, self.fd)

    def pread(self, n: int, offset: int) -> bytes:
        data = os.pread(self.fd, n, offset)
        if len(data) != n:  # the file shrank since it was indexed
            raise OSError(f"{self.path}: {n} bytes at {offset} expected, {len(data)} read")
        return data


class Stream:
    """One direction's bytes: pieces in stream order, contiguous from offset 0 to ``size``.

    ``pos[i]`` is the stream offset where piece ``i`` starts (it ends where the next starts); ``off[i]`` its file
    offset, or ``-1 - k`` for ``memory[k]``.  The arrays take 16 bytes a piece (one per TCP segment kept).
    """

    __slots__ = ("file", "memory", "off", "pos", "size")

    def __init__(self, file: CaptureFile | None = None) -> None:
        self.file = file
        self.pos = array("q")
        self.off = array("q")
        self.memory: list[bytes | bytearray | memoryview] = []
        self.size = 0

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> Stream:
        out = cls()
        if memoryview(data).nbytes:
            out.add_memory(data)
        return out

    def add_file(self, offset: int, n: int) -> None:
        self.pos.append(self.size)
        self.off.append(offset)
        self.size += n

    def add_memory(self, data: bytes | bytearray | memoryview) -> None:
        self.pos.append(self.size)
        self.off.append(-1 - len(self.memory))
        self.memory.append(data)
        self.size += memoryview(data).nbytes

    @property
    def in_memory(self) -> bool:
        """Every byte is already in memory (a stream built from bytes): views cost nothing."""
        return self.file is None

    def windows(self, start: int = 0, stop: int | None = None, window: int = WINDOW) -> Iterator[list[memoryview]]:
        """The bytes in ``[start, stop)`` as lists of views, each list at most ``window`` bytes, read as it is
        reached (a consumer holds one window at a time)."""
        stop = self.size if stop is None else min(stop, self.size)
        if start >= stop:
            return
        pos, off, size = self.pos, self.off, self.size
        n = len(pos)
        i = bisect_right(pos, start) - 1
        p = start
        while p < stop:
            plan: list[tuple[int, int, int]] = []  # (off, offset within the piece, bytes)
            got = 0
            while p < stop and got < window:
                end = pos[i + 1] if i + 1 < n else size
                take = min(end - p, stop - p, window - got)
                plan.append((off[i], p - pos[i], take))
                got += take
                p += take
                if p == end:
                    i += 1
            yield self._read(plan, window)

    def _read(self, plan: list[tuple[int, int, int]], window: int) -> list[memoryview]:
        if all(o >= 0 for o, _, _ in plan) and self.file is not None:
            lo = min(o + w for o, w, _ in plan)
            hi = max(o + w + t for o, w, t in plan)
            # Pieces of one direction lie close together in the file (the other direction's packets and the
            # record headers in between): one read for the lot unless the gaps are large.
            if hi - lo <= 2 * window:
                buf = memoryview(self.file.pread(hi - lo, lo))
                return [buf[o + w - lo : o + w - lo + t] for o, w, t in plan]
        out = []
        for o, w, t in plan:
            if o >= 0:
                assert self.file is not None
                out.append(memoryview(self.file.pread(t, o + w)))
            else:
                out.append(memoryview(self.memory[-1 - o]).cast("B")[w : w + t])
        return out

    def chunks(self, start: int = 0, stop: int | None = None, window: int = WINDOW) -> Iterator[memoryview]:
        """The bytes in ``[start, stop)`` as views, in order (one window read at a time)."""
        for views in self.windows(start, stop, window):
            yield from views

    def read(self, start: int, stop: int) -> bytes:
        """The bytes in ``[start, stop)``, copied into one object."""
        return b"".join(self.chunks(start, stop))

    def view(self, start: int, stop: int) -> LazyBytes | memoryview:
        """``[start, stop)`` as a memoryview when the stream is in memory in one piece, else lazily."""
        if self.file is None and len(self.memory) == 1:
            return memoryview(self.memory[0]).cast("B")[start:stop]
        return LazyBytes(self, start, stop)


class LazyBytes:
    """A range of a :class:`Stream`, read when asked (a bulk payload that is not held)."""

    __slots__ = ("start", "stop", "stream")

    def __init__(self, stream: Stream, start: int, stop: int) -> None:
        self.stream, self.start, self.stop = stream, start, stop

    @property
    def nbytes(self) -> int:
        return self.stop - self.start

    def __len__(self) -> int:
        return self.stop - self.start

    def __bool__(self) -> bool:
        return self.stop > self.start

    def chunks(self, window: int = WINDOW) -> Iterator[memoryview]:
        """The bytes as views in order, one file window read at a time."""
        return self.stream.chunks(self.start, self.stop, window)

    def slices(self, size: int = WINDOW) -> Iterator[memoryview]:
        """The bytes as contiguous slices of ``size`` bytes (the last shorter): for element-aligned comparisons."""
        for at in range(self.start, self.stop, size):
            yield memoryview(self.stream.read(at, min(at + size, self.stop)))

    def read(self, start: int = 0, stop: int | None = None) -> bytes:
        """Bytes ``[start, stop)`` of this range, copied."""
        stop = self.nbytes if stop is None else min(stop, self.nbytes)
        return self.stream.read(self.start + start, self.start + stop)

    def sub(self, start: int, stop: int | None = None) -> LazyBytes:
        """A lazy sub-range."""
        stop = self.nbytes if stop is None else min(stop, self.nbytes)
        return LazyBytes(self.stream, self.start + start, self.start + max(start, stop))

    def tobytes(self) -> bytes:
        return self.read()

    def __bytes__(self) -> bytes:
        return self.read()

    def __getitem__(self, key: int | slice) -> int | memoryview:
        """An int for an index; for a slice, its bytes read into memory (what a header needs: keep slices small,
        or use :meth:`sub`)."""
        if isinstance(key, slice):
            start, stop, step = key.indices(self.nbytes)
            if step != 1:
                raise ValueError("LazyBytes slices take no step")
            return memoryview(self.read(start, max(start, stop)))
        n = self.nbytes
        index = key + n if key < 0 else key
        if not 0 <= index < n:
            raise IndexError("LazyBytes index out of range")
        return self.read(index, index + 1)[0]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LazyBytes):
            pieces = other.slices()
        elif isinstance(other, bytes | bytearray | memoryview):
            mv = memoryview(other).cast("B")
            pieces = (mv[i : i + WINDOW] for i in range(0, mv.nbytes, WINDOW))
        else:
            return NotImplemented
        if len(other) != self.nbytes:
            return False
        return all(a == b for a, b in zip(self.slices(), pieces, strict=False))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<LazyBytes {self.nbytes} bytes at stream offset {self.start}>"


def as_buffer(data: bytes | bytearray | memoryview | LazyBytes | None) -> bytes | bytearray | memoryview | None:
    """A buffer of ``data``: itself when it is one (or None), else its bytes read into memory (for small payloads,
    or for callers that need the whole of a large one anyway)."""
    if isinstance(data, LazyBytes):
        return memoryview(data.read())
    return data


__all__ = ["WINDOW", "CaptureFile", "LazyBytes", "Stream", "as_buffer"]
