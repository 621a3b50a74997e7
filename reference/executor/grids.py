"""Dequantisation of the IQ grid types (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M), vectorised over
all blocks at once like :mod:`.dequant`.

Each block holds a scale, per-32-element sub-block scales, indices into a codebook of 8 (or 4) small integers and
sign bits.  The codebooks are upstream data this repository does not contain: whoever starts a server gives their
source (:func:`use_codebooks`; the kit's ``ggml-rpc serve`` reads them out of an installed upstream build) and they
are loaded here on first use.  Without them these types are refused: :func:`available` answers False (so
GET_DEVICE_SUPPORTS_OP says no) and dequantising raises an :class:`ExecutorError` that says how to get them.

The float arithmetic follows ggml-quants.c's order (scale products first, then times the grid value, then the
sign), so the values are upstream's bit for bit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import numpy as np
from ggml_rpc.spec import GgmlType, type_name

from ..graph import ExecutorError
from .formats import LAYOUT, half_field

log = logging.getLogger(__name__)

IQ2_XXS = int(GgmlType.IQ2_XXS)
IQ2_XS = int(GgmlType.IQ2_XS)
IQ2_S = int(GgmlType.IQ2_S)
IQ3_XXS = int(GgmlType.IQ3_XXS)
IQ3_S = int(GgmlType.IQ3_S)
IQ1_S = int(GgmlType.IQ1_S)
IQ1_M = int(GgmlType.IQ1_M)


@dataclass(frozen=True, slots=True)
class Codebook:
    """One of upstream's IQ codebooks: the types that index it and its shape (entries of ``width`` small ints)."""

    types: tuple[int, ...]
    entries: int
    width: int
    dtype: str


#: The codebooks by upstream's names; the single table both the executor and the kit's extraction from an upstream
#: build read.  IQ1_M indexes IQ1_S's.
CODEBOOKS: dict[str, Codebook] = {
    "iq2xxs_grid": Codebook((IQ2_XXS,), 256, 8, "uint8"),
    "iq2xs_grid": Codebook((IQ2_XS,), 512, 8, "uint8"),
    "iq2s_grid": Codebook((IQ2_S,), 1024, 8, "uint8"),
    "iq3xxs_grid": Codebook((IQ3_XXS,), 256, 4, "uint8"),
    "iq3s_grid": Codebook((IQ3_S,), 512, 4, "uint8"),
    "iq1s_grid": Codebook((IQ1_S, IQ1_M), 2048, 8, "int8"),
}
#: The codebook each type indexes.
_GRID_OF = {t: name for name, book in CODEBOOKS.items() for t in book.types}
#: Every type that needs a codebook, in ggml's numbering.
GRID_TYPES: tuple[int, ...] = tuple(sorted(_GRID_OF))

_I = np.arange(128, dtype=np.uint8)
#: Sign patterns of IQ2_XXS/XS and IQ3_XXS: 7 stored sign bits, the 8th chosen so the count of minus signs is even.
KSIGNS = _I | ((np.unpackbits(_I[:, None], axis=1).sum(axis=1) & 1).astype(np.uint8) << 7)
_BIT8 = np.arange(8, dtype=np.uint8)
#: IQ1_S/IQ1_M add this to every grid value, its sign chosen per group of 8 (ggml's IQ1S_DELTA).
IQ1S_DELTA = np.float32(0.125)


#: Where the codebooks come from: given by whoever starts a server (``ServerConfig.codebooks``; ``ggml-rpc serve``
#: reads them from an installed upstream peer).  The reference itself knows no upstream build.
_source: Callable[[], dict[str, np.ndarray] | None] | None = None


def use_codebooks(source: Callable[[], dict[str, np.ndarray] | None] | None) -> None:
    """Read the codebooks from ``source`` from now on (on first use; None: there are none).  Process-wide, as the
    executor's kernels are."""
    global _source
    if source is not _source:
        _source = source
        codebooks.cache_clear()


@cache
def codebooks() -> dict[str, np.ndarray] | None:
    """The tables (loaded once, on first use, from the source given to :func:`use_codebooks`), or None."""
    source = _source
    if source is None:
        return None
    try:
        return source()
    except Exception:  # any failure to read a build means "no codebooks", never a crashed server
        log.warning("could not read the IQ codebooks", exc_info=True)
        return None


def available(type_id: int) -> bool:
    """Whether ``type_id`` can be read: not a grid type, or one whose codebook is loaded."""
    return type_id not in _GRID_OF or codebooks() is not None


def _grid(type_id: int) -> np.ndarray:
    tables = codebooks()
    if tables is None:
        raise ExecutorError(
            f"type {type_name(type_id)} needs the IQ codebooks, which are read from an installed upstream build "
            "and none is installed: run `ggml-rpc upstream install`")
    return tables[_GRID_OF[type_id]]


def _signed(values: np.ndarray, sign_bytes: np.ndarray) -> np.ndarray:
    """``values`` (..., 8) times -1 where bit j of the matching sign byte (...) is set, as ggml multiplies."""
    minus = ((sign_bytes[..., None] >> _BIT8) & 1).astype(bool)
    return values * np.where(minus, np.float32(-1), np.float32(1))


def _half_scale(d: np.ndarray, nibble: np.ndarray, last: float) -> np.ndarray:
    """``d * (0.5 + nibble) * last`` in float32, in ggml's order."""
    return (d * (np.float32(0.5) + nibble.astype(np.float32))) * np.float32(last)


def _dq_iq2_xxs(b: np.ndarray) -> np.ndarray:
    # Per 32 elements: 4 grid indices (bytes), then a u32 of four 7-bit sign indices and a 4-bit scale on top.
    n, f = b.shape[0], LAYOUT[IQ2_XXS]
    qs = np.ascontiguousarray(b[:, f["qs"]]).reshape(n, 8, 8)
    aux = np.ascontiguousarray(qs[:, :, 4:]).view("<u4")  # (n, 8, 1)
    db = _half_scale(half_field(b, f["d"]), aux[:, :, 0] >> 28, 0.25)  # (n, 8)
    signs = KSIGNS[(aux >> (7 * np.arange(4, dtype=np.uint32))) & 127]  # (n, 8, 4)
    vals = db[:, :, None, None] * _grid(IQ2_XXS)[qs[:, :, :4]]
    return _signed(vals, signs).reshape(n, 256)


def _dq_iq2_xs(b: np.ndarray) -> np.ndarray:
    # 32 u16 of a 9-bit grid index and a 7-bit sign index; a 4-bit scale per 16 elements.
    n, f = b.shape[0], LAYOUT[IQ2_XS]
    q = np.ascontiguousarray(b[:, f["qs"]]).view("<u2").reshape(n, 8, 4)
    sc = b[:, f["scales"]]
    nib = np.stack((sc & 0x0F, sc >> 4), axis=2)[:, :, [0, 0, 1, 1]]  # the scale of each group of 8: (n, 8, 4)
    db = _half_scale(half_field(b, f["d"])[:, :, None], nib, 0.25)
    vals = db[..., None] * _grid(IQ2_XS)[q & 511]
    return _signed(vals, KSIGNS[q >> 9]).reshape(n, 256)


def _dq_iq2_s(b: np.ndarray) -> np.ndarray:
    # 32 low index bytes, 32 sign bytes (bits used as they are), 2 high index bits per group from qh, 4-bit scales.
    n, f = b.shape[0], LAYOUT[IQ2_S]
    qs = b[:, f["qs"]]
    low, signs = qs[:, :32].reshape(n, 8, 4), qs[:, 32:].reshape(n, 8, 4)
    qh = b[:, f["qh"]].astype(np.uint16)[:, :, None]
    idx = low | (((qh >> (2 * np.arange(4, dtype=np.uint16))) & 3) << 8)
    sc = b[:, f["scales"]]
    nib = np.stack((sc & 0x0F, sc >> 4), axis=2)[:, :, [0, 0, 1, 1]]
    db = _half_scale(half_field(b, f["d"])[:, :, None], nib, 0.25)
    vals = db[..., None] * _grid(IQ2_S)[idx]
    return _signed(vals, signs).reshape(n, 256)


def _dq_iq3_xxs(b: np.ndarray) -> np.ndarray:
    # 64 grid indices (4 values each), then per 32 elements a u32 of four 7-bit sign indices and a 4-bit scale.
    n, f = b.shape[0], LAYOUT[IQ3_XXS]
    qs = b[:, f["qs"]]
    aux = np.ascontiguousarray(qs[:, 64:]).view("<u4")  # (n, 8)
    db = _half_scale(half_field(b, f["d"]), aux >> 28, 0.5)
    signs = KSIGNS[(aux[:, :, None] >> (7 * np.arange(4, dtype=np.uint32))) & 127]  # (n, 8, 4)
    grid = _grid(IQ3_XXS)[qs[:, :64].reshape(n, 8, 4, 2)].reshape(n, 8, 4, 8)  # two entries per group of 8
    return _signed(db[:, :, None, None] * grid, signs).reshape(n, 256)


def _dq_iq3_s(b: np.ndarray) -> np.ndarray:
    # Per 32 elements: 8 low index bytes, their 9th bits in one qh byte, 4 sign bytes; odd 4-bit scales per 32.
    n, f = b.shape[0], LAYOUT[IQ3_S]
    low = b[:, f["qs"]].reshape(n, 8, 8).astype(np.uint16)
    qh = b[:, f["qh"]].astype(np.uint16)[:, :, None]
    idx = low | (((qh >> np.arange(8, dtype=np.uint16)) & 1) << 8)
    sc = b[:, f["scales"]]
    nib = np.stack((sc & 0x0F, sc >> 4), axis=2).reshape(n, 8).astype(np.float32)
    db = half_field(b, f["d"]) * (np.float32(1) + np.float32(2) * nib)
    grid = _grid(IQ3_S)[idx].reshape(n, 8, 4, 8)
    signs = b[:, f["signs"]].reshape(n, 8, 4)
    return _signed(db[:, :, None, None] * grid, signs).reshape(n, 256)


def _iq1_values(dl: np.ndarray, idx: np.ndarray, minus_delta: np.ndarray) -> np.ndarray:
    """``dl * (grid + delta)`` for groups of 8: dl and idx and minus_delta (n, 8, 4) -> (n, 256)."""
    delta = np.where(minus_delta, -IQ1S_DELTA, IQ1S_DELTA)
    grid = _grid(IQ1_S)[idx].astype(np.float32)  # (n, 8, 4, 8)
    return (dl[..., None] * (grid + delta[..., None])).reshape(idx.shape[0], 256)


def _dq_iq1_s(b: np.ndarray) -> np.ndarray:
    # 32 low index bytes; per 32 elements a u16 of four 3-bit high index parts, a 3-bit scale and the delta's sign.
    n, f = b.shape[0], LAYOUT[IQ1_S]
    low = b[:, f["qs"]].reshape(n, 8, 4).astype(np.uint16)
    qh = np.ascontiguousarray(b[:, f["qh"]]).view("<u2")  # (n, 8)
    idx = low | (((qh[:, :, None] >> (3 * np.arange(4, dtype=np.uint16))) & 7) << 8)
    dl = half_field(b, f["d"]) * (np.float32(2) * ((qh >> 12) & 7).astype(np.float32) + np.float32(1))
    minus = np.broadcast_to(((qh & 0x8000) != 0)[:, :, None], idx.shape)
    return _iq1_values(np.broadcast_to(dl[:, :, None], idx.shape), idx, minus)


def _dq_iq1_m(b: np.ndarray) -> np.ndarray:
    # No f16 field: the super-block scale's 16 bits are the top nibbles of the 4 u16 scale words; each word also
    # holds 3-bit scales for 4 groups of 16.  Each qh nibble: 3 high index bits, then the delta's sign.
    n, f = b.shape[0], LAYOUT[IQ1_M]
    sc = np.ascontiguousarray(b[:, f["scales"]]).view("<u2")  # (n, 4)
    top = (sc >> 12).astype(np.uint16) << (4 * np.arange(4, dtype=np.uint16))
    d = np.bitwise_or.reduce(top, axis=1).view(np.float16).astype(np.float32)[:, None, None]
    # Group l of sub-block ib: scale field 2 * (ib % 2) + l // 2 of word ib // 2.
    ib, l_ = np.arange(8)[:, None], np.arange(4)[None, :]
    shift = (6 * (ib % 2) + 3 * (l_ // 2)).astype(np.uint16)
    s3 = (sc[:, ib // 2] >> shift) & 7  # (n, 8, 4)
    dl = d * (np.float32(2) * s3.astype(np.float32) + np.float32(1))
    qh = b[:, f["qh"]].reshape(n, 8, 2)
    nib = np.stack((qh & 0x0F, qh >> 4), axis=3).reshape(n, 8, 4)
    low = b[:, f["qs"]].reshape(n, 8, 4).astype(np.uint16)
    idx = low | ((nib & 7).astype(np.uint16) << 8)
    return _iq1_values(dl, idx, (nib & 8) != 0)


GRID_DEQUANT: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    IQ2_XXS: _dq_iq2_xxs,
    IQ2_XS: _dq_iq2_xs,
    IQ2_S: _dq_iq2_s,
    IQ3_XXS: _dq_iq3_xxs,
    IQ3_S: _dq_iq3_s,
    IQ1_S: _dq_iq1_s,
    IQ1_M: _dq_iq1_m,
}
