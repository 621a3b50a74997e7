"""The exact products' inner loops, compiled (numba): one output at a time, in the order upstream's AVX2 kernels add.

numpy can only run these loops a block at a time over every output (a float64 temporary, a multiply, an add and a
rounding per step, each a pass over memory), which made a tiny model's token four times slower than BLAS's
(``BENCHMARKS.md``).  Compiled, each output's accumulators stay in registers and the weights are read once, as
int8 codes for the 8-bit-activation types instead of float32.

The arithmetic is the one :mod:`.simd_sums` describes, with one difference: a fused multiply-add here is LLVM's
``llvm.fma.f32``, rounded once as the AVX2 instruction ggml uses is (numpy's float64 emulation rounds twice a few
units in 2^29 of the time).  Every other float32 operation is written in float32 and compiled without fast-math, so
it is neither reordered nor fused.  The 8-bit codes of a block are kept with lane i's four elements eight apart
(:data:`~.simd_sums.LANE_ORDER`), so that a block's eight lane sums are four vector adds.  The loops run on one
thread (the server's ``threads`` default: the machine's other cores belong to the client) with the interpreter lock
released; weight rows are the outer loop, so a batch reads each row once.  Its modules import it when they first
compute (:func:`.exact_kernels.kernels`), so that a process that never computes an exact product does not load numba.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit
from numba.core import types
from numba.extending import intrinsic

from .lanes8 import (
    _q8_one,
    _q8_one4,
    _q8_two,
    _q8_two4,
)
from .simd_sums import (
    K_CORRECTED,
    K_MINS_FIRST,
    K_MINS_FOUR,
    K_MINS_SUM,
    LANE_ORDER,
)

F32 = np.float32
F64 = np.float64


@intrinsic
def fma32(typingctx, a, b, c):  # type: ignore[no-untyped-def]
    """a * b + c rounded once (float32 operands)."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        f = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.fma", [f], ir.FunctionType(f, [f, f, f]))
        return builder.call(fn, args)

    return sig, codegen


@njit(cache=True, inline="always")
def _group8(p, o):  # type: ignore[no-untyped-def]
    # The eight integer lane sums of one 32-element group in lane order (lane i at o + i, o + 8 + i, ...).
    return (p[o] + p[o + 8] + p[o + 16] + p[o + 24], p[o + 1] + p[o + 9] + p[o + 17] + p[o + 25],
            p[o + 2] + p[o + 10] + p[o + 18] + p[o + 26], p[o + 3] + p[o + 11] + p[o + 19] + p[o + 27],
            p[o + 4] + p[o + 12] + p[o + 20] + p[o + 28], p[o + 5] + p[o + 13] + p[o + 21] + p[o + 29],
            p[o + 6] + p[o + 14] + p[o + 22] + p[o + 30], p[o + 7] + p[o + 15] + p[o + 23] + p[o + 31])


@njit(cache=True, inline="always")
def _add8(a, b):  # type: ignore[no-untyped-def]
    return (a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3], a[4] + b[4], a[5] + b[5], a[6] + b[6], a[7] + b[7])


@njit(cache=True, inline="always")
def _hsum8(v: np.ndarray) -> np.float32:
    # hsum_float_8: lane i + lane i + 4, then (0 + 2) + (1 + 3)
    return _hsum8_at(v, 0)


@njit(cache=True, inline="always")
def _hsum8_at(v: np.ndarray, at: int) -> np.float32:
    # _hsum8 of v[at:at + 8], without a view of them
    r0, r1, r2, r3 = v[at + 4] + v[at], v[at + 5] + v[at + 1], v[at + 6] + v[at + 2], v[at + 7] + v[at + 3]
    return (r0 + r2) + (r1 + r3)


@njit(cache=True, inline="always")
def _hadd_sum8(v: np.ndarray) -> np.float32:
    # GGML_F32_VEC_REDUCE's end: the halves, then (0 + 1) + (2 + 3)
    t0, t1, t2, t3 = v[0] + v[4], v[1] + v[5], v[2] + v[6], v[3] + v[7]
    return (t0 + t1) + (t2 + t3)


@njit(cache=True, inline="always")
def _half(lo, hi):  # type: ignore[no-untyped-def]
    # An IEEE half (two little-endian bytes) as float32, exactly.
    bits = np.int32(lo) | (np.int32(hi) << 8)
    e = (bits >> 10) & 0x1F
    f = bits & 0x3FF
    if e == 0:
        v = math.ldexp(F64(f), -24)
    elif e == 31:
        v = np.inf if f == 0 else np.nan
    else:
        v = math.ldexp(F64(f | 0x400), e - 25)
    return F32(-v if bits & 0x8000 else v)


@njit(cache=True, nogil=True)
def decode_q8_rows(raw: np.ndarray, size: int, scale_at: int, e8m0: bool, min_at: int, qh_at: int, qs_at: int,
                   nibbles: bool, table: np.ndarray, codes: np.ndarray, scales: np.ndarray,
                   mins: np.ndarray) -> None:  # pragma: no cover - compiled
    """Blocks of an 8-bit-activation type to the codes the kernel multiplies, in :data:`~.simd_sums.LANE_ORDER`.

    raw uint8 (m, nb * size): the blocks; the block's scale at ``scale_at`` (fp16, or an E8M0 exponent halved to
    pair with doubled codes when ``e8m0``), its fp16 min at ``min_at`` (-1: none), the 32 high bits at ``qh_at``
    (-1: none), codes at ``qs_at``: bytes, or with ``nibbles`` 16 bytes of two 4-bit values (elements j and
    j + 16), the high bit added, mapped through ``table`` (32 int8).  Fills codes int8 (m, k), scales and mins
    float32 (m, nb) (mins left alone without ``min_at``)."""
    m, k = codes.shape
    nb = k // 32
    for c in range(m):
        row = raw[c]
        w = codes[c]
        for b in range(nb):
            o = b * size
            if e8m0:
                scales[c, b] = F32(math.ldexp(1.0, np.int32(row[o + scale_at]) - 128))
            else:
                scales[c, b] = _half(row[o + scale_at], row[o + scale_at + 1])
            if min_at >= 0:
                mins[c, b] = _half(row[o + min_at], row[o + min_at + 1])
            base = b * 32
            if qh_at >= 0:
                qh = (np.uint32(row[o + qh_at]) | (np.uint32(row[o + qh_at + 1]) << 8)
                      | (np.uint32(row[o + qh_at + 2]) << 16) | (np.uint32(row[o + qh_at + 3]) << 24))
                for pos in range(32):
                    e = LANE_ORDER[pos]
                    v = (np.int32(row[o + qs_at + (e & 15)]) >> ((e >> 4) << 2)) & 15
                    w[base + pos] = table[v | (np.int32((qh >> np.uint32(e)) & np.uint32(1)) << 4)]
            elif nibbles:
                for pos in range(32):  # element e: the low nibble of byte e (e < 16) or the high one of e - 16
                    e = LANE_ORDER[pos]
                    w[base + pos] = table[(np.int32(row[o + qs_at + (e & 15)]) >> ((e >> 4) << 2)) & 15]
            else:
                for pos in range(32):
                    w[base + pos] = np.int8(row[o + qs_at + LANE_ORDER[pos]])


@njit(cache=True, nogil=True)
def q8_products(wq: np.ndarray, wd: np.ndarray, wm: np.ndarray, xq: np.ndarray, xd: np.ndarray, xs: np.ndarray,
                two: bool, summed: bool, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """out[r, c] = the dot of weight row c and activation row r as ggml's 8-bit-activation kernels compute it.

    wq int8 (m, k) codes in lane order (:func:`decode_q8_rows`), wd float32 (m, nb) scales, wm float32 (m, nb)
    mins (Q4_1/Q5_1, ``summed``); xq int8 (n, k) in the same order, xd float32 (n, nb) fp16 scales, xs float32
    (n, nb) fp16 block sums; ``two``: blocks alternate between two accumulators (the odd last block added
    to the total by one fused multiply-add)."""
    # One copy of the loop per flag pair, each flag a constant in it: with the flags read at run time, the loop
    # took three times as long (32,000 x 256 Q8_0: 1.31 ms against 0.44).
    if summed:
        if two:
            _q8_rows(wq, wd, wm, xq, xd, xs, True, True, out)
        else:
            _q8_rows(wq, wd, wm, xq, xd, xs, False, True, out)
    elif two:
        _q8_rows(wq, wd, wm, xq, xd, xs, True, False, out)
    else:
        _q8_rows(wq, wd, wm, xq, xd, xs, False, False, out)


@njit(cache=True, inline="always")
def _q8_rows(wq, wd, wm, xq, xd, xs, two, summed, out):  # type: ignore[no-untyped-def]
    m, k = wq.shape
    n = xq.shape[0]
    nb = k // 32
    last = nb - nb % 2 if two else nb
    lanes = np.empty(32, dtype=F32)
    c = 0
    while c < m:
        rm = 4 if c + 4 <= m else 1
        for r in range(n):
            if rm == 4:
                if two:
                    _q8_two4(wq, wd, c, xq, xd, r, last, lanes)
                else:
                    _q8_one4(wq, wd, c, xq, xd, r, last, lanes)
            elif two:
                _q8_two(wq, wd, c, xq, xd, r, last, lanes)
            else:
                _q8_one(wq, wd, c, xq, xd, r, last, lanes)
            for a in range(rm):
                out[r, c + a] = _q8_end(wq, wd, wm, xq, xd, xs, c + a, r, nb, last, summed, lanes, 8 * a)
        c += rm


@njit(cache=True, inline="always")
def _q8_end(wq, wd, wm, xq, xd, xs, c, r, nb, last, summed, lanes, at):  # type: ignore[no-untyped-def]
    # One output from its block loop's eight lanes (lanes[at:at + 8]): their sum, an odd last block of a
    # two-accumulator kernel by one fused multiply-add, the mins' sums last.
    total = _hsum8_at(lanes, at)
    if last < nb:
        t = np.int32(0)
        for j in range(last * 32, nb * 32):
            t += np.int32(wq[c, j]) * np.int32(xq[r, j])
        total = fma32(wd[c, last] * xd[r, last], F32(t), total)
    if summed:
        summs = F32(0)
        for b in range(nb):
            summs = summs + wm[c, b] * xs[r, b]
        total = total + summs
    return total


@njit(cache=True, nogil=True)
def k_products(eff: np.ndarray, wsum: np.ndarray, wd: np.ndarray, wdmin: np.ndarray, xq: np.ndarray,
               yd: np.ndarray, bsums: np.ndarray, mode: int, grid: bool, grid_scale: np.float32,
               out: np.ndarray) -> None:  # pragma: no cover - compiled
    """out[r, c] as ggml's ``ggml_vec_dot_*_q8_K`` computes it (see :mod:`.kdot`): eff int16 (m, k) each code
    times its sub-block scale, in lane order per 32; wsum int32 (m, nsb * 16) the per-16 weights of the
    block sums; wd, wdmin float32 (m, nsb); xq int8 (n, k) Q8_K codes in the same order, yd float32 (n, nsb),
    bsums int32 (n, nsb * 16).  ``mode``: K_CORRECTED subtracts wsum x bsums from the lanes (Q6_K, TQ1_0, TQ2_0);
    K_MINS_FIRST folds the mins into the same accumulators first (Q2_K); K_MINS_FOUR through a four-lane accumulator
    (Q4_K); K_MINS_SUM through a float32 running sum (Q5_K).  ``grid``: the total times ``grid_scale``."""
    m, k = eff.shape
    n = xq.shape[0]
    nsb = k // 256
    p = np.empty(k, dtype=np.int32)
    lanes = np.empty(8, dtype=np.int64)
    pair = np.empty(8, dtype=np.int64)
    prod = np.empty(4, dtype=np.int64)
    zero = F32(0)
    for c in range(m):
        w = eff[c]
        for r in range(n):
            x = xq[r]
            for j in range(k):
                p[j] = np.int32(w[j]) * np.int32(x[j])
            a = (zero, zero, zero, zero, zero, zero, zero, zero)
            m0 = m1 = m2 = m3 = summs = zero
            for s in range(nsb):
                o = s * 256
                q = s * 16
                t = _group8(p, o)
                for g in range(1, 8):
                    t = _add8(t, _group8(p, o + g * 32))
                for i in range(8):
                    lanes[i] = t[i]
                if mode == K_CORRECTED or mode == K_MINS_FIRST:
                    for i in range(8):
                        pair[i] = (np.int64(wsum[c, q + 2 * i]) * bsums[r, q + 2 * i]
                                   + np.int64(wsum[c, q + 2 * i + 1]) * bsums[r, q + 2 * i + 1])
                    if mode == K_CORRECTED:
                        for i in range(8):
                            lanes[i] -= pair[i]
                    else:
                        dm = -yd[r, s] * wdmin[c, s]
                        a = (fma32(dm, F32(pair[0]), a[0]), fma32(dm, F32(pair[1]), a[1]),
                             fma32(dm, F32(pair[2]), a[2]), fma32(dm, F32(pair[3]), a[3]),
                             fma32(dm, F32(pair[4]), a[4]), fma32(dm, F32(pair[5]), a[5]),
                             fma32(dm, F32(pair[6]), a[6]), fma32(dm, F32(pair[7]), a[7]))
                d = yd[r, s] * wd[c, s]
                a = (fma32(d, F32(lanes[0]), a[0]), fma32(d, F32(lanes[1]), a[1]), fma32(d, F32(lanes[2]), a[2]),
                     fma32(d, F32(lanes[3]), a[3]), fma32(d, F32(lanes[4]), a[4]), fma32(d, F32(lanes[5]), a[5]),
                     fma32(d, F32(lanes[6]), a[6]), fma32(d, F32(lanes[7]), a[7]))
                if mode == K_MINS_FOUR or mode == K_MINS_SUM:
                    # q8s[j] = bsum[2j] + bsum[2j + 1]; prod[t] = min[2t] q8s[2t] + min[2t + 1] q8s[2t + 1]
                    for t in range(4):
                        prod[t] = (np.int64(wsum[c, q + 4 * t]) * (bsums[r, q + 4 * t] + bsums[r, q + 4 * t + 1])
                                   + np.int64(wsum[c, q + 4 * t + 2])
                                   * (bsums[r, q + 4 * t + 2] + bsums[r, q + 4 * t + 3]))
                    dmin = -yd[r, s] * wdmin[c, s]
                    if mode == K_MINS_SUM:
                        summs = fma32(dmin, F32(prod[0] + prod[1] + prod[2] + prod[3]), summs)
                    else:
                        m0 = fma32(dmin, F32(prod[0]), m0)
                        m1 = fma32(dmin, F32(prod[1]), m1)
                        m2 = fma32(dmin, F32(prod[2]), m2)
                        m3 = fma32(dmin, F32(prod[3]), m3)
            total = _hsum8(a)
            if mode == K_MINS_SUM:
                total = total + summs
            elif mode == K_MINS_FOUR:
                total = total + ((m0 + m2) + (m1 + m3))
            if grid:
                total = total * grid_scale
            out[r, c] = total
