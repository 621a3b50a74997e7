"""FLASH_ATTN_EXT compiled (numba) as ggml's CPU backend runs it: the one-query recurrence with an F16 V (one query
row at a time; :func:`attend_f16` computes the scores too) or any other V (:func:`online_rows`), and the tiled
path (:func:`attend_tiled`).

For each KV position in order: a position whose score is -inf is skipped; on a new maximum the F16 accumulator is
rescaled by ``expf(old - new)`` (each value rounded back to F16) and the position's weight is 1, otherwise its weight
is ``expf(s - max)``; the weighted V row is added with one fused multiply-add per value (rounded once to float32,
then to F16); the denominator follows ``S = S * ms + vs``, fused too.  ``expf`` is the C library's.  Those are the
roundings upstream's build makes, measured against its FLASH_ATTN_EXT results; tests/executor/test_attention_online.py
checks this loop against the same recurrence written out in Python.  numpy could only take one step per KV position
over every row (a dozen calls each, 1.4 ms of a tiny model's 5 ms token); compiled, a row is a few microseconds.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .cmath32 import expf, half_value, tanhf, to_half
from .compiled import fma32
from .float_kernels import vec_dot_row
from .lanes8 import _halves_to
from .simd_sums import KIND_F16
from .softmax_rows import vec_max, vec_soft_max

F32 = np.float32


@njit(cache=True, nogil=True)
def online_rows(scores: np.ndarray, v: np.ndarray, v_of: np.ndarray, sinks: np.ndarray, has_sinks: bool,
                half: bool, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """out[r] = the attention of row r: scores (R, n_kv) float32 (scaled, masked), v (G, n_kv, dv) float32, v_of (R,)
    the V matrix of each row, sinks (R,) each row's sink (read when ``has_sinks``).  ``half``: V is F16 and so is the
    accumulator (each value rounded back to F16 at every step); otherwise (F32, BF16 or quantised V, each row
    converted to float32 as ggml does) the accumulator stays float32, rescaled by ``ggml_vec_scale_f32`` and added to
    by ``ggml_vec_mad_f32``."""
    n_rows, n_kv = scores.shape
    dv = v.shape[2]
    acc = np.empty(dv, dtype=F32)
    neg_inf = F32(-np.inf)
    zero = F32(0)
    for r in range(n_rows):
        acc[:] = zero
        m = neg_inf
        total = zero
        vr = v[v_of[r]]
        for ic in range(n_kv):
            s = scores[r, ic]
            if s == neg_inf:
                continue
            m, total = _step(acc, vr[ic], s, m, total, half)
        _finish(acc, m, total, sinks[r], has_sinks, out[r])


@njit(cache=True, nogil=True)
def softcapped(scores: np.ndarray, softcap: float) -> None:  # pragma: no cover - compiled
    """``softcap * tanhf(s)`` in place over a float32 array, with the C library's tanhf as ggml calls it."""
    cap = F32(softcap)
    flat = scores.reshape(-1)
    for i in range(flat.shape[0]):
        flat[i] = F32(cap * tanhf(flat[i]))


@njit(cache=True, inline="always")
def _step(acc, row, s, m, total, half):  # type: ignore[no-untyped-def]
    # One KV position of ggml's recurrence: on a new maximum the accumulator is rescaled (each value back to F16 when
    # ``half``) and the weight is 1, else the weight is expf(s - max); the weighted V row added by fused
    # multiply-adds, each result rounded to F16 when ``half``; the denominator S * ms + vs fused.  Returns the
    # maximum and the denominator.
    one = F32(1)
    ms, vs = one, one
    if s > m:
        ms = expf(F32(m - s))
        m = s
        for j in range(acc.shape[0]):
            scaled = F32(acc[j] * ms)
            acc[j] = to_half(scaled) if half else scaled
    else:
        vs = expf(F32(s - m))
    for j in range(acc.shape[0]):
        added = fma32(row[j], vs, acc[j])
        acc[j] = to_half(added) if half else added
    return m, fma32(total, ms, vs)


@njit(cache=True, inline="always")
def _finish(acc, m, total, sink, has_sink, out, fused=False):  # type: ignore[no-untyped-def]
    # The sink's share (as one more position that adds no value), then the division by the denominator.  Upstream's
    # build fuses this S * ms + vs in the tiled path (``fused``) but not in the one-query path, where the product is
    # rounded before the addition (both measured: test-backend-ops' FLASH_ATTN_EXT cases with sinks, hsk=64, nb=3
    # and nb=75, against upstream 7.0.0; the other form differed in a row of each).
    one, zero = F32(1), F32(0)
    scale = one
    if has_sink:
        ms, vs = one, one
        if sink > m:
            ms = expf(F32(m - sink))
        else:
            vs = expf(F32(sink - m))
        scale = ms
        total = fma32(total, ms, vs) if fused else F32(F32(total * ms) + vs)
    inv = one / total if total != zero else zero
    for j in range(acc.shape[0]):
        out[j] = F32(acc[j] * scale) * inv


@njit(cache=True, nogil=True)
def attend_f16(q: np.ndarray, k: np.ndarray, v: np.ndarray, rh: int, rs: int, mask: np.ndarray, has_mask: bool,
               slopes: np.ndarray, scale: float, softcap: float, sinks: np.ndarray, has_sinks: bool,
               out: np.ndarray) -> None:  # pragma: no cover - compiled
    """The whole one-query path for F16 K and V, as ggml's loop runs it: for each query row and KV position in
    order, a position whose mask is -inf is skipped before anything else; the score is ``ggml_vec_dot_f16`` of the
    K row and the query (float32 holding F16 values) times ``scale`` (with a ``softcap``: that times the C library's
    tanhf of it), plus the head's slope times the mask; then
    the recurrence of :func:`online_rows`.  q float32 (seq, head, rows, dk); k, v uint16 F16 bit patterns (kseq,
    khead, n_kv, d); mask float32 (m3, m2, rows or more, n_kv or more), repeating over sequences and heads by
    modulo; slopes float32 (head,); sinks float32 (head,); out float32 (seq, head, rows, dv)."""
    n_seq, n_head, n_rows, dk = q.shape
    n_kv, dv = k.shape[2], v.shape[3]
    m3, m2 = mask.shape[0], mask.shape[1]
    kf = np.empty(dk, dtype=F32)
    vf = np.empty(dv, dtype=F32)
    acc = np.empty(dv, dtype=F32)
    lanes8 = np.empty(8, dtype=F32)
    neg_inf = F32(-np.inf)
    zero, sc, cap = F32(0), F32(scale), F32(softcap)
    for s in range(n_seq):
        for h in range(n_head):
            kh, vh = k[s // rs, h // rh], v[s // rs, h // rh]
            slope = slopes[h]
            for qi in range(n_rows):
                qrow = q[s, h, qi]
                acc[:] = zero
                m = neg_inf
                total = zero
                for ic in range(n_kv):
                    mv = zero
                    if has_mask:
                        mv = F32(slope * mask[s % m3, h % m2, qi, ic])
                        if mv == neg_inf:
                            continue
                    _f16_row(kh[ic], kf)
                    score = F32(vec_dot_row(kf, qrow, KIND_F16, lanes8) * sc)
                    if cap != zero:
                        score = F32(cap * tanhf(score))
                    if has_mask:
                        score = F32(score + mv)
                    if score == neg_inf:
                        continue
                    _f16_row(vh[ic], vf)
                    m, total = _step(acc, vf, score, m, total, True)
                _finish(acc, m, total, sinks[h], has_sinks, out[s, h, qi])


@njit(cache=True, inline="always")
def _f16_row(src, dst):  # type: ignore[no-untyped-def]
    # F16 bit patterns (uint16, contiguous) to float32, eight at a time.
    n = src.shape[0]
    whole = n - n % 8
    for i in range(0, whole, 8):
        _halves_to(src, i, dst, i)
    for i in range(whole, n):
        dst[i] = half_value(src[i])


_TILE = 64  # ggml_fa_tile_config: 64 query rows by 64 KV positions


@njit(cache=True, nogil=True)
def attend_tiled(q: np.ndarray, k: np.ndarray, v: np.ndarray, rh: int, rs: int, mask: np.ndarray, has_mask: bool,
                 slopes: np.ndarray, scale: float, softcap: float, sinks: np.ndarray, has_sinks: bool,
                 out: np.ndarray) -> None:  # pragma: no cover - compiled
    """ggml's tiled path (64 query rows or more, F32 or F16 K and V), tile for tile: 64 query rows of one head at a
    time against 64 KV positions at a time; the scores a chain of fused multiply-adds over the head dimension per
    (row, position) in float32 (Q not rounded to F16); a tile whose every mask value is -inf skipped; per row the
    tile's maximum, the rescale of the running sum and output, ggml_vec_soft_max_f32 (ggml's vector exp eight at a
    time, each group's float sum added to a double); the output a chain of fused multiply-adds over the positions,
    continued from tile to tile; then the sink and the division.  q float32 (seq, head, rows, dk), k and v float32
    (kseq, khead, n_kv, d) holding the cache's values, the rest as for :func:`attend_f16`."""
    n_seq, n_head, n_rows, dk = q.shape
    n_kv, dv = k.shape[2], v.shape[3]
    m3, m2 = mask.shape[0], mask.shape[1]
    neg_inf, zero = F32(-np.inf), F32(0)
    sc, cap = F32(scale), F32(softcap)
    kq = np.empty((_TILE, _TILE), dtype=F32)
    mask32 = np.empty((_TILE, _TILE), dtype=F32)
    kt = np.empty((dk, _TILE), dtype=F32)
    v32 = np.empty((_TILE, dv), dtype=F32)
    vkq = np.empty((_TILE, dv), dtype=F32)
    s_sum = np.empty(_TILE, dtype=F32)
    m_max = np.empty(_TILE, dtype=F32)
    skip = np.empty(_TILE, dtype=np.bool_)
    for s in range(n_seq):
        for h in range(n_head):
            kh, vh = k[s // rs, h // rh], v[s // rs, h // rh]
            slope = slopes[h]
            for t0 in range(0, n_rows, _TILE):
                rows = min(_TILE, n_rows - t0)
                s_sum[:] = zero
                m_max[:] = neg_inf
                vkq[:, :] = zero
                mask32[:, :] = zero
                kt[:, :] = zero
                v32[:, :] = zero
                for ic in range(0, n_kv, _TILE):
                    kv_tile = min(_TILE, n_kv - ic)
                    if has_mask:
                        can_skip = True
                        for tq in range(rows):
                            for tk in range(_TILE):
                                val = neg_inf
                                if tk < kv_tile:
                                    val = F32(slope * mask[s % m3, h % m2, t0 + tq, ic + tk])
                                mask32[tq, tk] = val
                                if val != neg_inf:
                                    can_skip = False
                        if can_skip:
                            continue
                    for tk in range(kv_tile):
                        for d in range(dk):
                            kt[d, tk] = kh[ic + tk, d]
                    for tq in range(rows):
                        qrow = q[s, h, t0 + tq]
                        for tk in range(_TILE):
                            acc = zero
                            for d in range(dk):
                                acc = fma32(qrow[d], kt[d, tk], acc)
                            val = F32(acc * sc)
                            if cap != zero:
                                val = F32(tanhf(val) * cap)
                            if tk >= kv_tile:
                                val = neg_inf
                            elif has_mask:
                                val = F32(val + mask32[tq, tk])
                            kq[tq, tk] = val
                    for tq in range(rows):
                        row = kq[tq]
                        tile_max = vec_max(row)
                        skip[tq] = tile_max == neg_inf
                        if skip[tq]:
                            continue
                        m_old = m_max[tq]
                        m_new = max(m_old, tile_max) if not np.isnan(tile_max) else m_old
                        if m_new > m_old:
                            ms = expf(F32(m_old - m_new))
                            for d in range(dv):
                                vkq[tq, d] = F32(vkq[tq, d] * ms)
                            s_sum[tq] = F32(s_sum[tq] * ms)
                        m_max[tq] = m_new
                        s_sum[tq] = F32(np.float64(s_sum[tq]) + vec_soft_max(row, row, m_new))
                    for tk in range(kv_tile):
                        for d in range(dv):
                            v32[tk, d] = vh[ic + tk, d]
                    for tq in range(rows):
                        if skip[tq]:
                            kq[tq, :] = zero
                        for d in range(dv):
                            acc = vkq[tq, d]
                            for tk in range(_TILE):
                                acc = fma32(kq[tq, tk], v32[tk, d], acc)
                            vkq[tq, d] = acc
                for tq in range(rows):
                    _finish(vkq[tq], m_max[tq], s_sum[tq], sinks[h], has_sinks, out[s, h, t0 + tq], True)
