"""MUL_MAT of the K-quants (Q2_K ... Q6_K), IQ4_XS and TQ2_0 in the arithmetic of upstream's AVX2 dot products
with Q8_K activations (``ggml_vec_dot_*_q8_K``).

Per super-block of 256, the kernels sum integer products into eight int32 lanes (lane i takes elements 4i..4i+3 of
every 32, each times its sub-block's scale; Q6_K then subtracts 32 x scale x the Q8_K block sums of elements
32i..32i+31 from lane i), convert the lanes to float32 and fold them into eight float32 accumulators with a fused
multiply-add by ``y.d * fp16(x.d)``.  The mins of Q2_K go into the same accumulators first (lane i: the mins of
groups 2i and 2i+1 times their block sums, by ``-y.d * fp16(x.dmin)``), those of Q4_K through a second, four-lane
accumulator, those of Q5_K through a float32 running sum; the result is the pairwise lane sum plus that.  IQ4_XS is
Q4_K's main part with its lookup values and no mins; TQ2_0 subtracts each block sum once (its codes are q - 1) and
adds ``lanes * d`` (written as a multiply and an add, which the compiler fuses).  Integer
lanes are computed exactly in float64; each fused multiply-add is one float64 operation rounded once to float32.
"""

from __future__ import annotations

import numpy as np

from .dequant import (
    _Q3_HBIT,
    _Q3_HBYTE,
    _Q6_HBYTE,
    _Q6_HSHIFT,
    _Q6_LBYTE,
    _Q6_LSHIFT,
    _Q23_BYTE,
    _Q23_SHIFT,
    _iq4_xs_scales,
    _k_scales_6bit,
    _nibble_chunks,
    dequantize,
)
from .formats import (
    IQ4_XS,
    IQ4NL_LEVELS,
    LAYOUT,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    SHIFT2,
    TQ1_0,
    TQ2_0,
    half_field,
    low_high,
)
from .grids import IQ2_S, IQ2_XS, IQ2_XXS, IQ3_S, IQ3_XXS
from .quant import signed_absmax
from .simd_sums import fma32, hsum8

F = np.float32
F64 = np.float64
#: The grid types whose kernels sum (2 x scale + 1) x grid value x sign in integer lanes and scale the lane sum at
#: the end: the integer per element is the type's dequantised value with d = 1 times this factor, the final
#: multiplier its inverse (0.125f, 0.25f, 1).
GRID_FACTORS: dict[int, int] = {IQ2_XXS: 8, IQ2_XS: 8, IQ2_S: 8, IQ3_XXS: 4, IQ3_S: 1}
K_TYPES: tuple[int, ...] = (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, TQ1_0, TQ2_0, *GRID_FACTORS)
#: Types whose lanes subtract block sums (Q6_K: 32 x scale per 16; TQ1_0/TQ2_0: each once, their codes being q - 1).
_CORRECTED = (Q6_K, TQ1_0, TQ2_0)
#: Lane products are computed in chunks of at most this many (lanes x rows x columns) float64 values.
_CHUNK = 2 << 20


def pack_weights(type_id: int, blocks: np.ndarray) -> np.ndarray:
    """Blocks ``(m, nsb, size)`` to one float64 array ``(m, nsb, 256 + 16 + 3)``: each element's code times its
    sub-block scale (what the kernel's integer lanes multiply by the activation codes), then the 16 per-16 values the
    block sums are weighted by (Q6_K: 32 x scale; Q4_K/Q5_K: the 8 mins, each twice), then fp16 d, fp16 dmin (0 for
    Q6_K) and a kind flag (1: mins through a running float32 sum, Q5_K)."""
    m, nsb, size = blocks.shape
    b = np.ascontiguousarray(blocks).reshape(m * nsb, size)
    f = LAYOUT[type_id]
    out = np.zeros((m * nsb, 256 + 16 + 3), dtype=F64)
    if type_id in GRID_FACTORS or type_id == TQ1_0:
        unit = b.copy()
        unit[:, f["d"]] = np.frombuffer(np.float16(1).tobytes(), np.uint8)  # d = 1: the integer part alone
        values = dequantize(type_id, unit.reshape(m, nsb, size)).reshape(-1, 256).astype(F64)
        if type_id == TQ1_0:  # the trits 0..2 the kernel multiplies (it subtracts the block sums for the - 1)
            out[:, :256] = np.rint(values) + 1
            out[:, 256:272] = 1.0
        else:
            out[:, :256] = np.rint(values * GRID_FACTORS[type_id])
    elif type_id == IQ4_XS:
        q = IQ4NL_LEVELS[low_high(np.ascontiguousarray(b[:, f["qs"]]).reshape(-1, 16))].reshape(-1, 8, 32)
        out[:, :256] = (q.astype(F64) * _iq4_xs_scales(b).astype(F64)[:, :, None]).reshape(-1, 256)
    elif type_id == TQ2_0:
        q = (b[:, f["qs"]].reshape(-1, 2, 1, 32) >> SHIFT2[None, None, :, None]) & 3
        out[:, :256] = q.reshape(-1, 256).astype(F64)
        out[:, 256:272] = 1.0
    elif type_id in (Q2_K, Q3_K):
        q = ((b[:, f["qs"]][:, _Q23_BYTE] >> _Q23_SHIFT) & 3).astype(F64)
        sc = b[:, f["scales"]]
        if type_id == Q2_K:
            out[:, :256] = q * np.repeat((sc & 0x0F).astype(F64), 16, axis=1)
            out[:, 256:272] = (sc >> 4).astype(F64)
            out[:, 273] = half_field(b, f["dmin"])[:, 0]
        else:
            k = np.arange(16)
            low = np.where(k < 8, sc[:, k % 8] & 0x0F, sc[:, k % 8] >> 4)
            high = (sc[:, 8 + k % 4] >> (2 * (k // 4)).astype(np.uint8)) & 3
            scales = (low | (high << 4)).astype(F64) - 32
            hbit = (b[:, f["hmask"]][:, _Q3_HBYTE] >> _Q3_HBIT) & 1
            out[:, :256] = (q - np.where(hbit == 0, 4.0, 0.0)) * np.repeat(scales, 16, axis=1)
    elif type_id == Q6_K:
        low = (b[:, f["ql"]][:, _Q6_LBYTE] >> _Q6_LSHIFT) & 0x0F
        high = (b[:, f["qh"]][:, _Q6_HBYTE] >> _Q6_HSHIFT) & 3
        q = (low | (high << 4)).astype(F64)
        sc = b[:, f["scales"]].view(np.int8).astype(F64)  # (n, 16), one per 16 elements
        out[:, :256] = q * np.repeat(sc, 16, axis=1)
        out[:, 256:272] = 32 * sc
        out[:, 273] = 0.0
    else:
        q = _nibble_chunks(np.ascontiguousarray(b[:, f["qs"]]))  # (n, 8, 32)
        if type_id == Q5_K:
            high = (b[:, f["qh"]][:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
            q = q | (high << 4)
        sc, mn = _k_scales_6bit(b[:, f["scales"]])
        out[:, :256] = (q.astype(F64) * sc[:, :, None]).reshape(-1, 256)
        out[:, 256:272] = np.repeat(mn.astype(F64), 2, axis=1)
        out[:, 273] = half_field(b, f["dmin"])[:, 0]
    out[:, 272] = half_field(b, f["d"])[:, 0]
    out[:, 274] = float(type_id)
    return out.reshape(m, nsb, -1)


def q8k_codes(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows ``(n, k)`` as ggml's ``quantize_row_q8_K_ref``: (codes float64 ``(n, nsb, 256)``, d float32
    ``(n, nsb)``, block sums float64 ``(n, nsb, 16)``)."""
    n, k = x.shape
    flat = np.ascontiguousarray(x, dtype=F).reshape(-1, 256)
    mx = signed_absmax(flat)
    iscale = np.divide(F(-127), mx, out=np.zeros_like(mx), where=mx != 0)
    q = np.minimum(np.rint(flat * iscale), 127)
    d = np.divide(F(1), iscale, out=np.zeros_like(iscale), where=iscale != 0).astype(F)
    codes = q.astype(F64).reshape(n, k // 256, 256)
    return codes, d.reshape(n, k // 256), codes.reshape(n, k // 256, 16, 16).sum(axis=3)


def products(type_id: int, packed: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``x @ w^T`` as upstream's kernel computes it: weights as :func:`pack_weights` gives them, activations
    ``(n, k)`` float32.  Returns float32 ``(n, m)``."""
    m, nsb, _ = packed.shape
    n = x.shape[0]
    codes, yd, bsums = q8k_codes(x)
    weff = packed[:, :, :256]
    wsum = packed[:, :, 256:272]
    xd, xdmin = packed[:, :, 272].astype(F), packed[:, :, 273].astype(F)
    q6 = type_id in _CORRECTED
    # Q2_K: lane i of the same accumulators first takes min[2i] * bsum[2i] + min[2i+1] * bsum[2i+1] by dmin.
    pre = type_id == Q2_K
    # (nsb, lane, m, 32) weights and (nsb, lane, 32, n) codes: lane i takes elements 4i..4i+3 of every 32.
    w_l = weff.reshape(m, nsb, 8, 8, 4).transpose(1, 3, 0, 2, 4).reshape(nsb, 8, m, 32)
    a_l = codes.reshape(n, nsb, 8, 8, 4).transpose(1, 3, 2, 4, 0).reshape(nsb, 8, 32, n)
    out = np.empty((n, m), dtype=F)
    cols = max(1, min(m, _CHUNK // max(1, nsb * 8 * n)))
    for c0 in range(0, m, cols):
        c1 = min(m, c0 + cols)
        lanes = np.matmul(w_l[:, :, c0:c1], a_l)  # (nsb, 8, c, n), exact integers
        if q6:
            # lane i -= 32 * (sc[2i] * bsum[2i] + sc[2i+1] * bsum[2i+1])
            corr = np.einsum("mslg,nslg->slmn", wsum[c0:c1].reshape(-1, nsb, 8, 2), bsums.reshape(n, nsb, 8, 2))
            lanes = lanes - corr
        d = (yd.T[:, None, :] * xd[c0:c1].T[:, :, None]).astype(F)  # (nsb, c, n): y.d * fp16(x.d)
        acc = np.zeros((8, c1 - c0, n), dtype=F)
        if pre:
            mins_l = np.einsum("mslg,nslg->slmn", wsum[c0:c1].reshape(-1, nsb, 8, 2), bsums.reshape(n, nsb, 8, 2))
            dmin2 = (-yd.T[:, None, :] * xdmin[c0:c1].T[:, :, None]).astype(F)
        for s in range(nsb):
            if pre:
                acc = fma32(dmin2[s], mins_l[s].astype(F), acc)
            acc = fma32(d[s], lanes[s].astype(F), acc)
        total = hsum8(np.moveaxis(acc, 0, -1))
        if type_id in (Q4_K, Q5_K):
            # q8s[j] = bsum[2j] + bsum[2j+1]; prod[k] = min[2k] q8s[2k] + min[2k+1] q8s[2k+1]
            q8s = bsums.reshape(n, nsb, 8, 2).sum(axis=3)  # (n, nsb, 8)
            mins = wsum[c0:c1, :, ::2]  # (c, nsb, 8)
            prod = np.einsum("msjk,nsjk->smnj", mins.reshape(-1, nsb, 4, 2), q8s.reshape(n, nsb, 4, 2))
            dmin = (-yd.T[:, None, :] * xdmin[c0:c1].T[:, :, None]).astype(F)  # (nsb, c, n)
            if type_id == Q5_K:
                summs = np.zeros((c1 - c0, n), dtype=F)
                for s in range(nsb):  # summs += dmin * (integer sum of the four lanes), fused by the compiler
                    summs = fma32(dmin[s], prod[s].sum(axis=-1).astype(F), summs)
                total = total + summs
            else:
                acc_m = np.zeros((4, c1 - c0, n), dtype=F)
                for s in range(nsb):
                    acc_m = fma32(dmin[s], np.moveaxis(prod[s], -1, 0).astype(F), acc_m)
                total = total + ((acc_m[0] + acc_m[2]) + (acc_m[1] + acc_m[3]))
        if type_id in GRID_FACTORS:
            total = total * F(1 / GRID_FACTORS[type_id])  # *s = 0.125f * hsum, a float32 multiply
        out[:, c0:c1] = total.T
    return out
