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

from .dequant import _q5_values, e8m0_half
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
    half_field,
    low_high,
)
from .quant import _q8_scale
from .simd_sums import hsum8

#: Weight types computed here, and whether their activations carry the Q8_1 block sum.
EXACT_TYPES: dict[int, bool] = {Q4_0: False, Q5_0: False, Q8_0: False, IQ4_NL: False, MXFP4: False, Q4_1: True,
                                 Q5_1: True}

#: Lane sums are computed in chunks of at most this many (lanes x rows x columns): 16 MiB of float32.
_CHUNK = 4 << 20


def weight_codes(type_id: int, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Blocks ``(m, nb, size)`` to (codes float32 ``(m, nb * 8, 4)``, scale ``(m, nb)``, min ``(m, nb)`` or None),
    the codes as the kernel multiplies them (signed for Q4_0/Q5_0/Q8_0/IQ4_NL, unsigned for Q4_1/Q5_1)."""
    m, nb, size = blocks.shape
    flat = np.ascontiguousarray(blocks).reshape(m * nb, size)
    f = LAYOUT[type_id]
    if type_id == Q4_0:
        q = low_high(flat[:, f["qs"]]).astype(np.int8) - np.int8(8)
    elif type_id == Q5_0:
        q = _q5_values(flat[:, f["qh"]], flat[:, f["qs"]]).astype(np.int8) - np.int8(16)
    elif type_id == Q8_0:
        q = flat[:, f["qs"]].view(np.int8)
    elif type_id == IQ4_NL:
        q = IQ4NL_LEVELS[low_high(flat[:, f["qs"]])]
    elif type_id == MXFP4:
        q = E2M1_DOUBLED[low_high(flat[:, f["qs"]])]
    elif type_id == Q4_1:
        q = low_high(flat[:, f["qs"]])
    elif type_id == Q5_1:
        q = _q5_values(flat[:, f["qh"]], flat[:, f["qs"]])
    else:
        raise ValueError(f"type {type_id} is not dotted with 8-bit activations")
    codes = q.astype(np.float32).reshape(m, nb * 8, 4)
    # MXFP4's scale is an E8M0 exponent, halved to pair with the doubled E2M1 codes (as ggml's table holds them).
    d = (e8m0_half(flat[:, f["e"]]) if type_id == MXFP4 else half_field(flat, f["d"])).reshape(m, nb)
    mins = half_field(flat, f["m"]).reshape(m, nb) if "m" in f else None
    return codes, d, mins


def pack_weights(type_id: int, blocks: np.ndarray) -> np.ndarray:
    """:func:`weight_codes` as one float32 array ``(m, nb * 32 + 2 * nb)`` (codes, scales, mins or zeros), the form
    the executor keeps between graphs (its conversion cache holds one array per tensor)."""
    codes, d, mins = weight_codes(type_id, blocks)
    m, nb = d.shape
    return np.concatenate([codes.reshape(m, nb * 32), d, mins if mins is not None else np.zeros_like(d)], axis=1)


def _unpack(type_id: int, packed: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    m, width = packed.shape
    nb = width // 34
    codes = packed[:, : nb * 32].reshape(m, nb * 8, 4)
    d = packed[:, nb * 32 : nb * 33]
    return codes, d, packed[:, nb * 33 :] if EXACT_TYPES[type_id] else None


def activation_codes(x: np.ndarray, summed: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Rows ``(n, k)`` quantised as ggml's AVX2 ``quantize_row_q8_0``/``_q8_1`` does: (codes float32
    ``(n, nb * 8, 4)``, fp16 scale as float32 ``(n, nb)``, fp16 block sum as float32 ``(n, nb)`` or None)."""
    n, k = x.shape
    nb = k // 32
    d, q = _q8_scale(np.ascontiguousarray(x, dtype=np.float32).reshape(n * nb, 32))
    codes = q.astype(np.float32).reshape(n, nb * 8, 4)
    d16 = d.astype(np.float16).astype(np.float32).reshape(n, nb)
    s = None
    if summed:
        total = q.astype(np.int32).sum(axis=1, keepdims=True).astype(np.float32)
        s = (total * d).astype(np.float16).astype(np.float32).reshape(n, nb)
    return codes, d16, s


def _accumulate(lanes: np.ndarray, scale: np.ndarray, acc: np.ndarray, blocks: range) -> None:
    """acc = fma(scale[b], lanes[b], acc) for the blocks ``blocks`` in order; lanes ``(nb, 8, n, m)``,
    scale ``(nb, n, m)`` float32, acc ``(8, n, m)`` float32, updated in place."""
    for b in blocks:
        acc[...] = (scale[b].astype(np.float64) * lanes[b] + acc).astype(np.float32)


def products(type_id: int, packed: np.ndarray, x: np.ndarray, *, batch: bool) -> np.ndarray:
    """``x @ w^T`` as upstream's kernel computes it: weights as :func:`pack_weights` gives them, activations
    ``(n, k)`` float32 (``batch``: upstream runs its kernel for n > 1; a single token's otherwise).  Returns float32
    ``(n, m)``."""
    wc, wd, wm = _unpack(type_id, packed)
    summed = EXACT_TYPES[type_id]
    ac, ad, as_ = activation_codes(x, summed)
    m, n, nb = wc.shape[0], ac.shape[0], wd.shape[1]
    out = np.empty((n, m), dtype=np.float32)
    # IQ4_NL and MXFP4 alternate their blocks between two accumulators (IQ4_NL's batch goes through tinyBLAS: one).
    two = type_id == MXFP4 or (type_id == IQ4_NL and not batch)
    rows = max(1, min(n, _CHUNK // max(1, nb * 8 * m)))
    cols = m if rows > 1 or nb * 8 * m <= _CHUNK else max(1, _CHUNK // (nb * 8))
    wt = wc.transpose(1, 2, 0)  # (P, 4, m)
    for r0 in range(0, n, rows):
        a = ac[r0 : r0 + rows].transpose(1, 0, 2)  # (P, r, 4)
        for c0 in range(0, m, cols):
            # Lane sums: at most 4 x 128 x 127 in magnitude, exact in float32 products and sums.
            lanes = np.matmul(a, wt[:, :, c0 : c0 + cols]).reshape(nb, 8, a.shape[1], -1)
            scale = (ad[r0 : r0 + rows, None, :] * wd[None, c0 : c0 + cols, :]).transpose(2, 0, 1)  # (nb, r, c)
            acc = np.zeros((8, a.shape[1], lanes.shape[-1]), dtype=np.float32)
            if two:
                odd = np.zeros_like(acc)
                pairs = nb - nb % 2
                _accumulate(lanes, scale, acc, range(0, pairs, 2))
                _accumulate(lanes, scale, odd, range(1, pairs, 2))
                total = hsum8(np.moveaxis(acc + odd, 0, -1))
                for b in range(pairs, nb):  # the odd block left: sumf += d * isum, which the compiler fuses
                    total = (scale[b].astype(np.float64) * lanes[b].sum(axis=0) + total).astype(np.float32)
            else:
                _accumulate(lanes, scale, acc, range(nb))
                total = hsum8(np.moveaxis(acc, 0, -1))
            if summed:
                assert wm is not None and as_ is not None
                summs = np.zeros_like(total)
                mins = wm[c0 : c0 + cols]
                for b in range(nb):  # summs += fp16(m) * fp16(s), float32, block by block
                    summs = summs + as_[r0 : r0 + rows, b, None] * mins[None, :, b]
                total = total + summs
            out[r0 : r0 + rows, c0 : c0 + cols] = total
    return out
