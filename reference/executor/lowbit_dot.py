"""MUL_MAT of Q1_0 and Q2_0 weights (their activations Q8_0) in the arithmetic of upstream's x86 build.

Q1_0 (AVX2): per 128-weight block, eight float32 lanes (lane i: the signed sum of activation codes 4i..4i+3 of each
32) multiplied by the first activation block's scale, the next three folded in with fused multiply-adds by theirs,
then the block folded into the accumulators with a fused multiply-add by the weight scale; the pairwise lane sum.
Q2_0 has no vector kernel on x86 in 6.0.0's and 7.0.0's builds: the generic loop sums each 32's integer products,
``sumi += d1 * isum`` and ``sumf += d0 * sumi`` in float32, each a fused multiply-add as the compiler builds it.
8.0.0's build has one (``vector``; :mod:`.builds`): per 32 the eight lanes folded with a fused multiply-add by the
float32 product of the two scales, two accumulators taking alternate 64-weight blocks.
"""

from __future__ import annotations

import numpy as np

from .dequant import _bits_lsb_first, _crumbs_lsb_first
from .formats import LAYOUT, Q1_0, Q2_0, half_field
from .q8dot import activation_codes
from .simd_sums import fma32, hsum8

F = np.float32
F64 = np.float64
LOWBIT_TYPES: dict[int, int] = {Q1_0: 128, Q2_0: 64}


def pack_weights(type_id: int, blocks: np.ndarray) -> np.ndarray:
    """Blocks ``(m, nb, size)`` to float32 ``(m, nb * blck + nb)``: the signed codes (+-1 or -1..2), the scales."""
    m, nb, size = blocks.shape
    b = np.ascontiguousarray(blocks).reshape(m * nb, size)
    f = LAYOUT[type_id]
    if type_id == Q1_0:
        codes = np.where(_bits_lsb_first(b[:, f["qs"]]) != 0, 1.0, -1.0)
    else:
        codes = _crumbs_lsb_first(b[:, f["qs"]]).astype(F) - 1
    d = half_field(b, f["d"])
    return np.concatenate([codes.astype(F).reshape(m, -1), d.reshape(m, nb)], axis=1)


def products(type_id: int, packed: np.ndarray, x: np.ndarray, *, vector: bool = False) -> np.ndarray:
    """``x @ w^T`` as upstream computes it: weights as :func:`pack_weights` gives them, activations ``(n, k)``;
    ``vector``: Q2_0 by the AVX2 kernel of the builds that have one (:class:`~.builds.Build`)."""
    blck = LOWBIT_TYPES[type_id]
    n, k = x.shape
    m = packed.shape[0]
    nb = k // blck
    codes, wd = packed[:, :k], packed[:, k:]
    q, ad, _ = activation_codes(x, False)  # (n, k), (n, k / 32)
    ac = q.astype(F).reshape(n, k // 4, 4)
    # Lane sums of four: (k / 4, n, m), exact in float32.
    lanes = np.matmul(ac.transpose(1, 0, 2), codes.reshape(m, k // 4, 4).transpose(1, 2, 0))
    sub = blck // 32
    out = np.empty((n, m), dtype=F)
    if type_id == Q1_0:
        acc = np.zeros((8, n, m), dtype=F)
        for b in range(nb):
            first = b * sub
            blk = lanes[first * 8 : first * 8 + 8] * ad[None, :, first, None]  # a multiply, rounded
            for j in range(1, sub):
                blk = fma32(ad[None, :, first + j, None], lanes[(first + j) * 8 : (first + j) * 8 + 8], blk)
            acc = fma32(wd[None, None, :, b], blk, acc)
        out[...] = hsum8(np.moveaxis(acc, 0, -1))
        return out
    if vector:
        # Per 32: eight lanes folded by a fused multiply-add with fp16(d_w) * fp16(d_a) rounded to float32; the
        # 64-weight blocks alternate between two accumulators, added lane by lane before the pairwise sum.
        accs = np.zeros((2, 8, n, m), dtype=F)
        for q in range(nb * sub):
            scale = (ad[:, q, None] * wd[None, :, q // sub]).astype(F)
            accs[(q // sub) % 2] = fma32(scale[None], lanes[q * 8 : q * 8 + 8], accs[(q // sub) % 2])
        out[...] = hsum8(np.moveaxis(accs[0] + accs[1], 0, -1))
        return out
    sumf = np.zeros((n, m), dtype=F)
    for b in range(nb):
        sumi = np.zeros((n, m), dtype=F)
        for j in range(sub):
            q = b * sub + j
            isum = lanes[q * 8 : q * 8 + 8].sum(axis=0)  # the 32 products' integer sum
            sumi = fma32(ad[:, q, None], isum.astype(F), sumi)
        sumf = fma32(wd[None, :, b], sumi, sumf)
    out[...] = sumf
    return out
