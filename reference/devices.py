"""Devices and buffers of one connection: memory budget, unguessable handles, made-up base addresses.

Each buffer is real memory (a numpy array; large ones are lazily zero-filled pages, so an untouched buffer costs
no resident memory).  Clients never see Python addresses: a buffer is named by a random non-zero 64-bit handle and
its first byte by a random, page-aligned fake base address.  Tensor ``data`` fields the client sends are absolute
addresses in that fake space; :meth:`Buffer.region` turns an address range into a view of the real memory after
checking it lies inside the buffer.
"""

from __future__ import annotations

import random
import secrets
from dataclasses import dataclass, field

import numpy as np

U64_MASK = (1 << 64) - 1

#: Upstream CPU backend defaults, as its 6.0.0 and 7.0.0 servers answer: GET_ALIGNMENT 32, GET_MAX_SIZE 2^64 - 1.
CPU_ALIGNMENT = 32
CPU_MAX_SIZE = U64_MASK
DEFAULT_MEMORY = 4 << 30
_PAGE = 4096
# Fake bases live in the lower half of the canonical user address space, like real heap addresses.
_BASE_MIN = 1 << 40
_BASE_MAX = 1 << 46


@dataclass(frozen=True)
class DeviceConfig:
    """What every device of a server reports: memory budget, alignment, largest buffer."""

    memory: int = DEFAULT_MEMORY
    alignment: int = CPU_ALIGNMENT
    max_size: int = CPU_MAX_SIZE


@dataclass(eq=False)
class Buffer:
    """One allocated buffer (base and size never change, so its end and byte view are computed once)."""

    handle: int
    device: int
    base: int
    size: int
    memory: np.ndarray
    #: One past the last fake address: every single-command tensor check reads it.
    end: int = field(init=False, repr=False)
    _bytes: memoryview = field(init=False, repr=False)
    #: The write epoch: changed by :meth:`written` only, on every write into this buffer (SET_TENSOR(_2D), a hash
    #: hit, MEMSET_TENSOR, BUFFER_CLEAR, COPY_TENSOR, COMM_ALLREDUCE, a graph run): what the executor's cached
    #: conversions of its bytes are still valid for.
    epoch: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        self.end = self.base + self.size
        self._bytes = memoryview(self.memory)

    def view(self) -> memoryview:
        """The whole memory, to read (a write takes its destination from :meth:`write_view` or :meth:`write_array`)."""
        return self._bytes

    def written(self) -> None:
        """The buffer's bytes change (or may have): what was derived from them is stale.  The one write path: every
        write goes through here, before its first byte lands (a graph run, whose views were taken when the graph was
        built, right after it)."""
        self.epoch += 1

    def write_view(self, offset: int = 0, n: int | None = None) -> memoryview:
        """Bytes [offset, offset + n) of the buffer (n None: to its end), to be written: marked :meth:`written`."""
        self.written()
        return self._bytes[offset : self.size if n is None else offset + n]

    def write_array(self, offset: int = 0, n: int | None = None) -> np.ndarray:
        """:meth:`write_view`'s bytes as a numpy array (for numpy's fills, copies and sums)."""
        self.written()
        return self.memory[offset : self.size if n is None else offset + n]

    def slice(self, address: int, n: int) -> memoryview:
        """The ``n`` bytes at absolute ``address``; the caller has checked the range."""
        start = address - self.base
        return self._bytes[start : start + n]


@dataclass
class DeviceState:
    """Per-connection view of one device: how much of its budget this connection's buffers use."""

    index: int
    config: DeviceConfig
    used: int = 0

    @property
    def free(self) -> int:
        return max(0, self.config.memory - self.used)


@dataclass
class BufferTable:
    """The buffers one connection allocated, by handle; everything is released with the connection."""

    devices: list[DeviceState]
    buffers: dict[int, Buffer] = field(default_factory=dict)
    #: Where handles and bases are drawn from: None (a server) draws them unguessably; a seeded generator (the
    #: fuzzer's in-process model) draws the same ones for the same seed, so that a seeded example behaves the same
    #: every time it runs.
    rng: random.Random | None = None

    @classmethod
    def for_devices(cls, count: int, config: DeviceConfig, rng: random.Random | None = None) -> BufferTable:
        return cls([DeviceState(i, config) for i in range(count)], rng=rng)

    def _bits(self, k: int) -> int:
        return secrets.randbits(k) if self.rng is None else self.rng.getrandbits(k)

    def _below(self, n: int) -> int:
        return secrets.randbelow(n) if self.rng is None else self.rng.randrange(n)

    def _new_handle(self) -> int:
        while True:
            h = self._bits(64)
            if h and h not in self.buffers:
                return h

    def _new_base(self, size: int, alignment: int) -> int:
        unit = _PAGE if alignment <= 0 else alignment * -(-_PAGE // alignment)
        for _ in range(64):
            base = self._below((_BASE_MAX - _BASE_MIN) // unit) * unit + _BASE_MIN
            if all(base + size <= b.base or b.end <= base for b in self.buffers.values() if b.size):
                return base
        raise MemoryError("no free fake address range")

    def alloc(self, device: int, size: int) -> Buffer | None:
        """A new buffer, or None when the device's budget (or the host) cannot hold it."""
        dev = self.devices[device]
        if size > dev.config.max_size or size > dev.free:
            return None
        try:
            memory = np.zeros(size, dtype=np.uint8)
            # A zero-size buffer is upstream's dummy buffer: non-zero handle, base 0.
            base = self._new_base(size, dev.config.alignment) if size else 0
        except (MemoryError, ValueError):
            return None
        buf = Buffer(self._new_handle(), device, base, size, memory)
        self.buffers[buf.handle] = buf
        dev.used += size
        return buf

    def get(self, handle: int) -> Buffer | None:
        return self.buffers.get(handle)

    def free(self, handle: int) -> Buffer | None:
        buf = self.buffers.pop(handle, None)
        if buf is not None:
            self.devices[buf.device].used -= buf.size
        return buf

    def release_all(self) -> None:
        for handle in list(self.buffers):
            self.free(handle)
