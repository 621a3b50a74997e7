"""MUL_MAT of the weight types ggml's x86 CPU backend dots with 8-bit activations (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
IQ4_NL, MXFP4), in upstream's own arithmetic, so that a result agrees with upstream's bit for bit.

Upstream's AVX2 kernels (``ggml_vec_dot_*_q8_0``/``_q8_1`` for one token, llamafile's ``tinyBLAS_Q0_AVX`` for a
batch) all compute one output the same way: per 32-element block, eight int32 lanes each summing the products of
four consecutive elements (exact), a block scale ``fp16(d_w) * fp16(d_a)`` rounded to float32, and eight float32
accumulators updated with a fused multiply-add block after block; then the eight lanes are added pairwise (lane i
and i + 4, then 0+2 and 1+3, then the two).  Q4_1/Q5_1 add ``sum of fp16(min) * fp16(s)`` over the blocks, in
float32, after that sum.  For one token, IQ4_NL alternates its blocks between two accumulators, added lane by lane
before the pairwise sum (a batch goes through tinyBLAS: one accumulator); MXFP4 always does.

A product of float32 BLAS on dequantised weights adds in another order: its results differ in the last bits, which
is enough, in a model, to move one of the next matmul's 8-bit activation codes by one and the logits by NMSE 1e-5.
The fused multiply-add is computed in float64 and rounded once to float32 (the product of a float32 scale and a
lane sum below 2^21 is exact in float64; the sum rounds to float32 as the fused operation does, but for a double
rounding a few units in 2^29 of the time).
"""

from __future__ import annotations

import numpy as np
from ggml_rpc.spec import TYPES

from .exact_kernels import kernels
from .formats import (
    E2M1_DOUBLED,
    IQ4_NL,
    IQ4NL_LEVELS,
    LAYOUT,
    MXFP4,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
)
from .quant import _q8_scale
from .simd_sums import LANE_ORDER

#: Weight types computed here, and whether their activations carry the Q8_1 block sum.
EXACT_TYPES: dict[int, bool] = {Q4_0: False, Q5_0: False, Q8_0: False, IQ4_NL: False, MXFP4: False, Q4_1: True,
                                 Q5_1: True}


def in_lane_order(codes: np.ndarray) -> np.ndarray:
    """Codes ``(n, k)`` with each block's elements in :data:`~.simd_sums.LANE_ORDER` (the compiled kernels' order)."""
    n, k = codes.shape
    return np.ascontiguousarray(codes.reshape(n, k // 32, 32)[:, :, LANE_ORDER].reshape(n, k))


def _code_table(type_id: int) -> np.ndarray:
    # The code of each 4-bit value (with Q5's high bit: 5-bit) as the kernel multiplies it.
    v = np.arange(32)
    if type_id == Q4_0:
        return (v - 8).astype(np.int8)
    if type_id == Q5_0:
        return (v - 16).astype(np.int8)
    if type_id == IQ4_NL:
        return np.resize(IQ4NL_LEVELS, 32).astype(np.int8)
    if type_id == MXFP4:
        return np.resize(E2M1_DOUBLED, 32).astype(np.int8)
    return v.astype(np.int8)  # Q4_1, Q5_1 (unsigned); Q8_0 reads its bytes


def _block_form(type_id: int) -> tuple[int, int, bool, int, int, int, bool, np.ndarray]:
    """The arguments :func:`~.compiled.decode_q8_rows` reads a block of ``type_id`` with."""
    f = LAYOUT[type_id]

    def at(name: str) -> int:
        return f[name].start if name in f else -1

    mx = type_id == MXFP4
    return (TYPES[type_id].size, at("e") if mx else at("d"), mx, at("m"), at("qh"), at("qs"), type_id != Q8_0,
            _code_table(type_id))


#: Each type's block form, worked out once.
_FORMS = {t: _block_form(t) for t in EXACT_TYPES}


def activation_codes(x: np.ndarray, summed: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows ``(n, k)`` quantised as ggml's AVX2 ``quantize_row_q8_0``/``_q8_1`` does: (codes int8 ``(n, k)``, fp16
    scale as float32 ``(n, nb)``, fp16 block sum as float32 ``(n, nb)``, zeros unless ``summed``)."""
    n, k = x.shape
    nb = k // 32
    d, q = _q8_scale(np.ascontiguousarray(x, dtype=np.float32).reshape(n * nb, 32))
    d16 = d.astype(np.float16).astype(np.float32).reshape(n, nb)
    if summed:
        total = q.astype(np.int32).sum(axis=1, keepdims=True).astype(np.float32)
        s = (total * d).astype(np.float16).astype(np.float32).reshape(n, nb)
    else:
        s = np.zeros_like(d16)
    return q.reshape(n, k), d16, s


def pack_weights(type_id: int, blocks: np.ndarray) -> np.ndarray:
    """Blocks ``(m, nb, size)`` (or ``(m, nb * size)``) as one flat byte array: int8 codes ``(m, k)`` in lane order,
    then float32 scales and float32 mins or zeros ``(m, nb)`` each (1.25 bytes a weight; each section contiguous,
    so that the loops vectorise over a row), the form the executor keeps between graphs (its conversion cache holds
    one array per tensor); decoded by the compiled :func:`~.compiled.decode_q8_rows`."""
    raw = _block_rows(blocks)
    size = TYPES[type_id].size
    m, nb = raw.shape[0], raw.shape[1] // size
    packed = np.zeros(packed_size(m, nb * 32), dtype=np.uint8)
    codes, scales, mins = _views(packed, m)
    kernels().decode_q8_rows(raw, *_FORMS[type_id], codes, scales, mins)
    return packed


def _block_rows(blocks: np.ndarray) -> np.ndarray:
    # Blocks (m, nb, size) or (m, nb * size) as the uint8 rows the compiled kernels read.
    raw = blocks.reshape(blocks.shape[0], -1)
    if raw.dtype != np.uint8 or raw.strides[-1] != 1:
        raw = np.ascontiguousarray(raw).view(np.uint8)
    return raw


def _two(type_id: int, batch: bool) -> bool:
    # IQ4_NL and MXFP4 alternate their blocks between two accumulators (IQ4_NL's batch goes through tinyBLAS: one).
    return type_id == MXFP4 or (type_id == IQ4_NL and not batch)


def packed_size(m: int, k: int) -> int:
    """Bytes of :func:`pack_weights`' form of ``m`` rows of ``k`` weights."""
    return m * k // 32 * 40


def _views(packed: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    nb = packed.size // m // 40
    a, b = m * nb * 32, m * nb * 36
    return (packed[:a].view(np.int8).reshape(m, nb * 32), packed[a:b].view(np.float32).reshape(m, nb),
            packed[b:].view(np.float32).reshape(m, nb))


def products(type_id: int, packed: np.ndarray, x: np.ndarray, m: int, *, batch: bool) -> np.ndarray:
    """``x @ w^T`` as upstream's kernel computes it: weights as :func:`pack_weights` gives them for ``m`` rows,
    activations ``(n, k)`` float32 (``batch``: upstream runs its kernel for n > 1; a single token's otherwise).
    Returns float32 ``(n, m)``."""
    codes, scales, mins = _views(packed, m)
    summed = EXACT_TYPES[type_id]
    ac, ad, as_ = lane_codes(x, summed)
    out = np.empty((ac.shape[0], m), dtype=np.float32)
    kernels().q8_products(codes, scales, mins, ac, ad, as_, _two(type_id, batch), summed, out)
    return out


class TokenProduct:
    """:func:`products` of one activation row into ``out`` (float32 ``(1, m)``), for a prepared graph's product run
    again and again: the activation arrays made once, the packed weights' views kept while the packed array is the
    same object (the Python around the two compiled calls was most of a 256 x 256 product's 20 us)."""

    __slots__ = ("_acts", "_m", "_packed", "_summed", "_two", "_type", "_views", "out")

    def __init__(self, type_id: int, m: int, k: int, out: np.ndarray) -> None:
        self._type, self._m, self.out = type_id, m, out
        self._summed, self._two = EXACT_TYPES[type_id], _two(type_id, False)
        self._acts = (np.empty((1, k), dtype=np.int8), np.empty((1, k // 32), dtype=np.float32),
                      np.empty((1, k // 32), dtype=np.float32))
        self._packed: np.ndarray | None = None
        self._views: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def __call__(self, packed: np.ndarray, x: np.ndarray) -> None:
        """out = x @ w^T for packed weights (:func:`pack_weights`) and one contiguous float32 row ``x`` (1, k)."""
        if packed is not self._packed:
            self._packed, self._views = packed, _views(packed, self._m)
        acts = lane_codes(x, self._summed, self._acts)
        kernels().q8_products(*self._views, *acts, self._two, self._summed, self.out)  # type: ignore[misc]


def lane_codes(x: np.ndarray, summed: bool, into: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`activation_codes` with each block's codes in lane order, compiled (numpy's form for rows holding a
    value that is not finite); ``into``: the three arrays to fill (codes int8 ``(n, k)``, scales and sums float32
    ``(n, k / 32)``), made here when None."""
    from .q8_acts import activation_lanes

    x = np.ascontiguousarray(x, dtype=np.float32)
    n, k = x.shape
    if into is None:
        into = (np.empty((n, k), dtype=np.int8), np.empty((n, k // 32), dtype=np.float32),
                np.empty((n, k // 32), dtype=np.float32))
    if activation_lanes(x, summed, *into):
        return into
    ac, ad, as_ = activation_codes(x, summed)
    return in_lane_order(ac), ad, as_


def raw_products(type_id: int, blocks: np.ndarray, x: np.ndarray, *, batch: bool) -> np.ndarray:
    """:func:`products` from the weights' blocks ``(m, nb, size)`` (or ``(m, nb * size)``) as stored, without a
    packed copy: the same results, for weights the conversion cache does not keep."""
    from .raw_q8 import raw_q8_products

    raw = _block_rows(blocks)
    summed = EXACT_TYPES[type_id]
    ac, ad, as_ = activation_codes(x, summed)
    out = np.empty((ac.shape[0], raw.shape[0]), dtype=np.float32)
    raw_q8_products(raw, *_FORMS[type_id], ac, ad, as_, _two(type_id, batch), summed, out)
    return out
