"""Protocol facts as functions: the hash, the threshold, tensor byte sizes, HELLO replies."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from .enums import GGML_TYPE_COUNT, TYPES

#: SET_TENSOR payloads strictly larger than this go through the hash path (and, in v6, into the cache).
HASH_THRESHOLD = 10 * 1024 * 1024
#: 8.0.0: graphs a server keeps per device before it empties that device's cache (client and server count alike).
GRAPH_CACHE_MAX = 1024
#: 8.0.0: COMM_ALLREDUCE sends an F32 tensor of at least this many elements over the servers' link as BF16.
COMM_BF16_FROM_ELEMENTS = 32768
_F32, _BF16 = (next(t.id for t in TYPES.values() if t.name == n) for n in ("F32", "BF16"))


def comm_wire_type(type_id: int, elements: int) -> int:
    """8.0.0: the ggml type a COMM_ALLREDUCE copy of a tensor travels as on the servers' link (F32 of
    :data:`COMM_BF16_FROM_ELEMENTS` elements or more as BF16, halving the bytes; anything else as it is)."""
    return _BF16 if type_id == _F32 and elements >= COMM_BF16_FROM_ELEMENTS else type_id

FNV_OFFSET_BASIS = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3

#: Upstream rpc-server's wire defaults (tools/rpc): bind address and port.
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50052

#: conn_caps is 24 bytes; a plain-TCP peer sends and answers all zeros.
CONN_CAPS_SIZE = 24

try:  # C implementation (fnv-c, cffi): takes any buffer without a copy through its ffi.
    from fnv_c.ext._fnv import ffi as _ffi
    from fnv_c.ext._fnv import lib as _lib

    def _fnv1a64_buffer(data: bytes | bytearray | memoryview) -> int:
        mv = memoryview(data)
        if not mv.c_contiguous:
            mv = memoryview(mv.tobytes())
        if mv.nbytes == 0:
            return FNV_OFFSET_BASIS
        return int(_lib.fnv1a_64(_ffi.from_buffer(mv.cast("B")), mv.nbytes))

except ImportError:  # pragma: no cover - the public fnv-c API wants bytes: one copy, same result
    import fnv_c

    def _fnv1a64_buffer(data: bytes | bytearray | memoryview) -> int:
        return int(fnv_c.fnv1a_64(bytes(data)))


_MASK64 = (1 << 64) - 1
#: Byte that takes the offset basis's low 8 bits to each value (FNV's low 8 bits evolve on their own).
_LEAD = {((FNV_OFFSET_BASIS ^ q) * FNV_PRIME) & 0xFF: q for q in range(256)}


def fnv1a64_continue(state: int, data: bytes | bytearray | memoryview) -> int:
    """FNV-1a-64 of the bytes that gave ``state`` followed by ``data``: hashing a payload piece by piece.

    The C hash only starts from the offset basis, so the continuation is derived from it.  XOR with a byte only
    changes a state's low 8 bits, which evolve on their own; so from any two states with the same low 8 bits the
    same bytes add the same terms, and the results differ by (difference of the states) * PRIME**len.  One
    leading byte brings the basis to ``state``'s low 8 bits; the C hash of that byte and ``data`` is then shifted
    by that difference.  Costs one copy of ``data`` (callers hash pieces of a few MiB).
    """
    mv = memoryview(data).cast("B") if memoryview(data).c_contiguous else memoryview(bytes(data))
    n = mv.nbytes
    if n == 0:
        return state
    if state == FNV_OFFSET_BASIS:
        return _fnv1a64_buffer(mv)
    lead = _LEAD[state & 0xFF]
    start = ((FNV_OFFSET_BASIS ^ lead) * FNV_PRIME) & _MASK64
    buf = bytearray(n + 1)
    buf[0] = lead
    buf[1:] = mv
    return (_fnv1a64_buffer(buf) + (state - start) * pow(FNV_PRIME, n, 1 << 64)) & _MASK64


def fnv1a64(data: bytes | bytearray | memoryview) -> int:
    """64-bit FNV-1a of ``data`` (what names a cache entry and what SET_TENSOR_HASH carries).

    Besides any buffer, takes an object that is not one but yields its bytes with ``chunks()`` (a capture's lazy
    bulk data, :mod:`ggml_rpc.conformance.sessions.spans`): hashed piece by piece, never held whole.
    """
    chunks = getattr(data, "chunks", None)
    if chunks is not None and not isinstance(data, bytes | bytearray | memoryview):
        state = FNV_OFFSET_BASIS
        for piece in chunks():
            state = fnv1a64_continue(state, piece)
        return state
    return _fnv1a64_buffer(data)


def cache_file_name(digest: int) -> str:
    """Cache entry name: the FNV-1a-64 hash as 16 lowercase, zero-padded hex digits, no extension."""
    return f"{digest & 0xFFFFFFFFFFFFFFFF:016x}"


def ggml_nbytes(type_id: int, ne: Sequence[int], nb: Sequence[int]) -> int:
    """Bytes a tensor spans, as every upstream bounds check computes it (strides trusted as sent).

    Any zero dimension gives 0.  A dimension with ``ne == 1`` contributes nothing whatever its stride.
    Raises ``KeyError`` for an id outside the type table and ``ZeroDivisionError``-free ``ValueError``
    for removed types (block size 0), which upstream rejects before it gets here.
    """
    info = TYPES[type_id]
    if info.blck == 0:
        raise ValueError(f"type {info.name} ({type_id}) was removed from ggml")
    if any(n <= 0 for n in ne):
        return 0
    if info.blck == 1:
        total = info.size
        for n, stride in zip(ne, nb, strict=True):
            total += (n - 1) * stride
        return total
    total = ne[0] * nb[0] // info.blck
    for n, stride in zip(ne[1:], nb[1:], strict=True):
        total += (n - 1) * stride
    return total


# Per-type geometry as arrays, so a whole graph's byte sizes are computed in one vectorised pass.
#: Elements per block of every type id (0 for removed types), as an array indexable by a column of type ids.
BLOCK_ELEMENTS = np.array([TYPES[t].blck for t in range(GGML_TYPE_COUNT)], dtype=np.uint64)
_TSIZE = np.array([TYPES[t].size for t in range(GGML_TYPE_COUNT)], dtype=np.uint64)
# Above this the exact (Python integer) size is computed instead of the uint64 one, which could wrap.
_EXACT_ABOVE = float(1 << 62)
_U64_MAX = (1 << 64) - 1


def ggml_nbytes_many(types: np.ndarray, ne: np.ndarray, nb: np.ndarray) -> tuple[list[int], np.ndarray]:
    """:func:`ggml_nbytes` of many tensors at once (a graph's): ``types`` (n,), ``ne`` and ``nb`` (n, 4), types
    inside the table and not removed.  Returns the exact sizes as Python integers and the same as uint64 saturated
    at 2^64 - 1 (a size that does not fit can never fit a buffer either).  The same rule as the scalar form: sizes
    large enough to wrap in uint64 are computed by it."""
    if len(types) == 0:
        return [], np.zeros(0, dtype=np.uint64)
    ne64, nb64 = ne.astype(np.uint64), nb.astype(np.uint64)
    blck, tsize = BLOCK_ELEMENTS[types], _TSIZE[types]
    empty = (ne64 == 0).any(axis=1)
    ne_m1 = np.where(empty[:, None], np.uint64(0), ne64 - np.uint64(1))
    tail = (ne_m1[:, 1:] * nb64[:, 1:]).sum(axis=1)
    blocked = blck > 1
    head = np.where(blocked, ne64[:, 0] * nb64[:, 0] // np.maximum(blck, np.uint64(1)),
                    tsize + ne_m1[:, 0] * nb64[:, 0])
    total = head + tail
    total[empty] = 0
    out = total.tolist()
    estimate = ne_m1.astype(np.float64) * nb64.astype(np.float64)
    big = estimate.sum(axis=1) + ne64[:, 0].astype(np.float64) * nb64[:, 0] > _EXACT_ABOVE
    for k in np.flatnonzero(big).tolist():
        out[k] = ggml_nbytes(int(types[k]), ne[k].tolist(), nb[k].tolist())
        total[k] = min(out[k], _U64_MAX)
    return out, total


def tensor_nbytes(tensor: Mapping) -> int:
    """:func:`ggml_nbytes` of a decoded rpc_tensor dict."""
    return ggml_nbytes(tensor["type"], tensor["ne"], tensor["nb"])


def contiguous_strides(type_id: int, ne: Sequence[int]) -> list[int]:
    """The nb[] ggml gives a freshly created contiguous tensor of this type and shape."""
    info = TYPES[type_id]
    if info.blck == 0:
        raise ValueError(f"type {info.name} ({type_id}) was removed from ggml")
    nb = [info.size, info.size * (ne[0] // info.blck)]
    nb.append(nb[1] * ne[1])
    nb.append(nb[2] * ne[2])
    return nb


def hello_reply(version: tuple[int, int, int]) -> dict:
    """The HELLO reply fields a server of ``version`` sends over plain TCP."""
    major, minor, patch = version
    return {"major": major, "minor": minor, "patch": patch, "pad": 0, "conn_caps": b"\0" * CONN_CAPS_SIZE}
