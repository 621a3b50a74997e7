"""Quantisation to the K-quant super-blocks (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) as ggml's reference quantisers do it.

ggml's CPU backend quantises a CPY or SET_ROWS destination of these types with its reference routines (no
importance matrix), whose scales come out of small searches: a handful of candidate scales per sub-block, least
squares fits, a few passes of per-element refinement.  test-backend-ops compares the dequantised results, so any
other choice of codes fails; every step here therefore follows the reference arithmetic in float32, in its order
(sums left to right, ``round`` to nearest even as ``nearest_int`` does).  Each step runs on all sub-blocks of the
tensor at once; the only Python loops are over candidate scales, refinement passes and positions in a sub-block.
"""

from __future__ import annotations

import numpy as np
from ggml_rpc.spec import GgmlType
from ggml_rpc.spec.blocks import pack_blocks

F = np.float32
_EPS = F(1e-15)  # GROUP_MAX_EPS: a sub-block whose largest magnitude is below this is all zero


def _seq(v: np.ndarray) -> np.ndarray:
    """Sums over the last axis added left to right in float32 (a C loop's order; numpy's own sum is pairwise)."""
    return np.cumsum(v, axis=-1, dtype=F)[..., -1]


def _signed_absmax(x: np.ndarray) -> np.ndarray:
    """Over the last axis, the value of largest magnitude (the first on ties)."""
    return np.take_along_axis(x, np.argmax(np.abs(x), axis=-1)[..., None], axis=-1)[..., 0]


def _half_round(v: np.ndarray) -> np.ndarray:
    """float32 through IEEE half and back (the block scales are stored as halves and re-read)."""
    return v.astype(np.float16).astype(F)


def _half_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype("<f2").view(np.uint8).reshape(v.shape[0], 2)


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a / b where b != 0, else 0 (the reference skips those cases; callers mask the result)."""
    return np.divide(a, b, out=np.zeros(np.broadcast(a, b).shape, dtype=F), where=b != 0)


# ---- scale searches --------------------------------------------------------------------------------------------


def make_qkx2(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int,
              use_mad: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Scale, minimum (returned negated, >= 0) and codes 0..nmax of ``x ~ scale * L - min`` per sub-block (rows of
    ``x``): an initial fit over [min(x, 0), max x], then ``nstep + 1`` rescaled candidates each fitted by weighted
    least squares, the one of least weighted error (absolute or squared) kept."""
    mn = np.minimum(x.min(axis=-1), F(0))
    mx = x.max(axis=-1)
    sum_w = _seq(w)
    sum_x = _seq(w * x)
    flat = mx == mn
    rng = np.where(flat, F(1), mx - mn)

    def err(scale: np.ndarray, m: np.ndarray, codes: np.ndarray) -> np.ndarray:
        diff = scale[:, None] * codes + m[:, None] - x
        return _seq(w * (np.abs(diff) if use_mad else diff * diff))

    iscale = F(nmax) / rng
    scale = F(1) / iscale
    codes = np.clip(np.rint(iscale[:, None] * (x - mn[:, None])), 0, nmax).astype(F)
    best = err(scale, mn, codes)
    for step in range(nstep + 1):
        # The range uses the current minimum: a fit taken in an earlier step moves it for the later ones.
        rng = np.where(flat, F(1), mx - mn)
        iscale = (F(rmin) + F(rdelta) * F(step) + F(nmax)) / rng
        aux = np.clip(np.rint(iscale[:, None] * (x - mn[:, None])), 0, nmax).astype(F)
        wl = w * aux
        sum_l, sum_l2, sum_xl = _seq(wl), _seq(wl * aux), _seq(wl * x)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        this_scale = _div(sum_w * sum_xl - sum_x * sum_l, det)
        this_min = _div(sum_l2 * sum_x - sum_l * sum_xl, det)
        clamp = this_min > 0
        this_min = np.where(clamp, F(0), this_min)
        this_scale = np.where(clamp, _div(sum_xl, sum_l2), this_scale)
        cur = err(this_scale, this_min, aux)
        take = ok & (cur < best)
        codes = np.where(take[:, None], aux, codes)
        best = np.where(take, cur, best)
        scale = np.where(take, this_scale, scale)
        mn = np.where(take, this_min, mn)
    scale = np.where(flat, F(0), scale)
    codes = np.where(flat[:, None], F(0), codes)
    return scale, -mn, codes.astype(np.uint8)


def make_qx(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric scale and codes 0..2*nmax-1 per sub-block, x^2-weighted (ggml's rmse_type 1): the scale -max/nmax
    and 18 neighbours -max/(nmax +- 0.1 k), the best least-squares fit kept."""
    mx = _signed_absmax(x)
    dead = np.abs(mx) < _EPS
    mx = np.where(dead, F(1), mx)
    w = x * x

    def fit(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        lv = np.clip(np.rint(iscale[:, None] * x), -nmax, nmax - 1).astype(F)
        wx = w * x
        return lv, _seq(wx * lv), _seq(w * lv * lv)

    lv, sumlx, suml2 = fit(F(-nmax) / mx)
    scale = _div(sumlx, suml2)
    best = scale * sumlx
    for k in (*range(-9, 0), *range(1, 10)):
        cand, slx, sl2 = fit(-(F(nmax) + F(0.1) * F(k)) / mx)
        take = (sl2 > 0) & (slx * slx > best * sl2)
        lv = np.where(take[:, None], cand, lv)
        scale = np.where(take, _div(slx, sl2), scale)
        best = np.where(take, scale * slx, best)
    codes = np.where(dead[:, None], F(0), lv + F(nmax))
    return np.where(dead, F(0), scale), codes.astype(np.int8)


def make_q3(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Q3_K's sub-block fit: codes for -max/nmax, then up to 5 passes moving one code at a time (in element order,
    each move seen by the next) while the x^2-weighted fit improves.  Returns the scale and codes 0..2*nmax-1."""
    mx = _signed_absmax(x)
    dead = np.abs(mx) < _EPS
    mx = np.where(dead, F(1), mx)
    w = x * x
    wx = w * x
    lv = np.clip(np.rint((F(-nmax) / mx)[:, None] * x), -nmax, nmax - 1).astype(F)
    sumlx = _seq(wx * lv)
    suml2 = _seq(w * lv * lv)
    for _ in range(5):  # a pass that changes nothing leaves the state as it was, so later passes change nothing
        # Element i of every sub-block at once; the running sums carry each accepted move to element i + 1.
        for i in range(x.shape[1]):
            li, wi, xi, wxi = lv[:, i], w[:, i], x[:, i], wx[:, i]
            slx = sumlx - wxi * li
            sl2 = suml2 - wi * li * li
            new = np.clip(np.rint(_div(xi * sl2, slx)), -nmax, nmax - 1).astype(F)
            slx2 = slx + wxi * new
            sl22 = sl2 + wi * new * new
            take = (slx > 0) & (new != li) & (sl22 > 0) & (slx2 * slx2 * suml2 > sumlx * sumlx * sl22)
            lv[:, i] = np.where(take, new, li)
            sumlx = np.where(take, slx2, sumlx)
            suml2 = np.where(take, sl22, suml2)
    scale = np.where(dead, F(0), _div(sumlx, suml2))
    codes = np.where(dead[:, None], F(0), lv + F(nmax))
    return scale, codes.astype(np.int8)


# ---- super-block quantisers ------------------------------------------------------------------------------------


def _pack_2bit(q: np.ndarray) -> np.ndarray:
    """(n, 256) codes < 4 to 64 bytes: byte 32 h + l holds elements 128 h + l + 32 k at bits 2 k."""
    g = q.reshape(-1, 2, 4, 32).astype(np.uint8) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
    return np.bitwise_or.reduce(g, axis=2).reshape(-1, 64)


def _max_positive(v: np.ndarray) -> np.ndarray:
    """The largest value per row, or 0 when none is positive (the reference starts its running maximum at 0)."""
    return np.maximum(v.max(axis=-1), F(0))


def _requant(x: np.ndarray, d: np.ndarray, dm: np.ndarray, top: int, codes: np.ndarray) -> np.ndarray:
    """Codes re-picked with the stored (half-rounded, integer-scaled) sub-block scales; sub-blocks whose scale
    came out 0 keep the codes of their search, as the reference's ``continue`` keeps them."""
    new = np.clip(np.rint(_div(x + dm[..., None], d[..., None])), 0, top)
    return np.where((d != 0)[..., None], new, codes).astype(np.uint8)


def quantize_q2_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    sub = x.reshape(n * 16, 16)
    scales, mins, codes = make_qkx2(sub, np.abs(sub), 3, -0.5, 0.1, 15, True)
    scales, mins, codes = scales.reshape(n, 16), mins.reshape(n, 16), codes.reshape(n, 16, 16)
    max_scale, max_min = _max_positive(scales), _max_positive(mins)
    ls = np.rint(_div(F(15), max_scale)[:, None] * scales).astype(np.int32)
    lm = np.rint(_div(F(15), max_min)[:, None] * mins).astype(np.int32)
    ls = np.where(max_scale[:, None] > 0, ls, 0)
    lm = np.where(max_min[:, None] > 0, lm, 0)
    sc = ((ls | (lm << 4)) & 0xFF).astype(np.uint8)
    d = np.where(max_scale > 0, max_scale / F(15), F(0))
    dmin = np.where(max_min > 0, max_min / F(15), F(0))
    dl = _half_round(d)[:, None] * (sc & 0x0F).astype(F)
    ml = _half_round(dmin)[:, None] * (sc >> 4).astype(F)
    codes = _requant(x.reshape(n, 16, 16), dl, ml, 3, codes)
    return pack_blocks(GgmlType.Q2_K, n, scales=sc, qs=_pack_2bit(codes.reshape(n, 256)), d=_half_bytes(d),
                       dmin=_half_bytes(dmin))


def quantize_q3_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    scales, codes = make_q3(x.reshape(n * 16, 16), 4)
    scales, codes = scales.reshape(n, 16), codes.reshape(n, 16, 16)
    max_scale = _signed_absmax(scales)
    live = max_scale != 0
    iscale = _div(F(-32), max_scale)
    ls = (np.clip(np.rint(iscale[:, None] * scales), -32, 31) + 32).astype(np.uint8)
    ls = np.where(live[:, None], ls, np.uint8(0))
    packed = np.zeros((n, 12), dtype=np.uint8)
    packed[:, 0:8] = (ls[:, 0:8] & 0x0F) | ((ls[:, 8:16] & 0x0F) << 4)
    high = (ls >> 4) << (2 * (np.arange(16) // 4)).astype(np.uint8)
    packed[:, 8:12] = np.bitwise_or.reduce(high.reshape(n, 4, 4), axis=1)
    d = np.where(live, _div(F(1), iscale), F(0))
    sc = ls.astype(np.int32) - 32  # the stored 6-bit scales read back (zero where the block is empty)
    dl = _half_round(d)[:, None] * sc.astype(F)
    new = np.clip(np.rint(_div(x.reshape(n, 16, 16), dl[:, :, None])), -4, 3) + 4
    lv = np.where((dl != 0)[:, :, None], new, codes.astype(F)).astype(np.uint8).reshape(n, 256)
    # High bit of element j goes to bit j // 32 of hmask byte j % 32; the low two bits pack like Q2_K's.
    hbit = (lv > 3).astype(np.uint8).reshape(n, 8, 32) << np.arange(8, dtype=np.uint8)[None, :, None]
    return pack_blocks(GgmlType.Q3_K, n, hmask=np.bitwise_or.reduce(hbit, axis=1),
                       qs=_pack_2bit(np.where(lv > 3, lv - 4, lv)), scales=packed, d=_half_bytes(d))


def _pack_scale_min_k4(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins to Q4_K/Q5_K's 12 bytes."""
    out = np.empty((ls.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    out[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:8] & 0x0F) | ((lm[:, 4:8] & 0x0F) << 4)
    return out


def _q45_k(x: np.ndarray, nmax: int, rmin: float, nstep: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Q4_K / Q5_K: 8 sub-blocks of 32 fitted with weights rms + |x|, 6-bit scales and mins under two half
    super-scales; returns the header fields (d, dmin, scales) and the 256 re-picked codes."""
    n = x.shape[0]
    sub = x.reshape(n * 8, 32)
    av = np.sqrt(_seq(sub * sub) / F(32))
    scales, mins, codes = make_qkx2(sub, av[:, None] + np.abs(sub), nmax, rmin, 0.1, nstep, False)
    scales, mins, codes = scales.reshape(n, 8), mins.reshape(n, 8), codes.reshape(n, 8, 32)
    max_scale, max_min = _max_positive(scales), _max_positive(mins)
    inv_s = np.where(max_scale > 0, _div(F(63), max_scale), F(0))
    inv_m = np.where(max_min > 0, _div(F(63), max_min), F(0))
    ls = np.minimum(np.rint(inv_s[:, None] * scales).astype(np.int32) & 0xFF, 63).astype(np.uint8)
    lm = np.minimum(np.rint(inv_m[:, None] * mins).astype(np.int32) & 0xFF, 63).astype(np.uint8)
    d, dmin = max_scale / F(63), max_min / F(63)
    head = {"d": _half_bytes(d), "dmin": _half_bytes(dmin), "scales": _pack_scale_min_k4(ls, lm)}
    dl = _half_round(d)[:, None] * ls.astype(F)
    ml = _half_round(dmin)[:, None] * lm.astype(F)
    return head, _requant(x.reshape(n, 8, 32), dl, ml, nmax, codes).reshape(n, 256)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    head, q = _q45_k(x, 15, -1.0, 20)
    g = q.reshape(n, 4, 2, 32)
    return pack_blocks(GgmlType.Q4_K, n, **head, qs=(g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, 128))


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    head, q = _q45_k(x, 31, -0.5, 15)
    g = q.reshape(n, 4, 2, 32)
    # The fifth bit of sub-block 2 c (+1) goes to bit 2 c (+1) of qh byte j.
    hi = (g >> 4).reshape(n, 8, 32) << np.arange(8, dtype=np.uint8)[None, :, None]
    low = g & 0x0F
    return pack_blocks(GgmlType.Q5_K, n, **head, qh=np.bitwise_or.reduce(hi, axis=1),
                       qs=(low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128))


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    scales, codes = make_qx(x.reshape(n * 16, 16), 32)
    scales, codes = scales.reshape(n, 16), codes.reshape(n, 16, 16)
    max_scale = _signed_absmax(scales)
    live = np.abs(max_scale) >= _EPS
    iscale = _div(F(-128), np.where(live, max_scale, F(1)))
    d = np.where(live, F(1) / iscale, F(0))
    sc = np.minimum(np.rint(iscale[:, None] * scales), 127).astype(np.int8)
    dl = _half_round(d)[:, None] * sc.astype(F)
    new = np.clip(np.rint(_div(x.reshape(n, 16, 16), dl[:, :, None])), -32, 31) + 32
    lv = np.where((dl != 0)[:, :, None], new, codes.astype(F)).astype(np.uint8).reshape(n, 2, 4, 32)
    low = lv & 0x0F
    # Per half h: ql[64 h + l] = q[l] | q[l + 64] << 4, ql[64 h + 32 + l] = q[l + 32] | q[l + 96] << 4.
    ql = np.concatenate((low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)),
                        axis=2).reshape(n, 128)
    hi = (lv >> 4) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
    out = pack_blocks(GgmlType.Q6_K, n, ql=ql, qh=np.bitwise_or.reduce(hi, axis=2).reshape(n, 64),
                      scales=sc.view(np.uint8), d=_half_bytes(d))
    return np.where(live[:, None], out, np.uint8(0))
