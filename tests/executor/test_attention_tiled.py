"""FLASH_ATTN_EXT's tiled path (64 query rows or more, F32/F16 K and V) against ggml's tiled loop written out with
numpy, tile for tile: 64 rows by 64 positions, the scores a fused multiply-add chain over the head dimension,
tiles whose mask is all -inf skipped, ggml's vector exp in the softmax with each 8-lane group's float sum added to
a double, the output a fused multiply-add chain over the positions continued across tiles, the sink fused."""

from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np
import pytest
from ggml_rpc.reference.executor import execute
from ggml_rpc.reference.executor.arena import Arena, params
from ggml_rpc.reference.executor.softmax import alibi_slopes
from ggml_rpc.spec import GgmlOp, GgmlType

from .test_vsilu import _v_expf

F = np.float32
T = 64
_C = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
for _name in ("expf", "tanhf"):
    getattr(_C, _name).restype, getattr(_C, _name).argtypes = ctypes.c_float, [ctypes.c_float]


def _fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    return (np.asarray(a, dtype=np.float64) * b + c).astype(F)


def _tiled_head(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None, slope: F, scale: F,
                cap: F, sink: F | None) -> np.ndarray:
    """One head: q (rows, dk), k (n_kv, dk), v (n_kv, dv), mask (rows, n_kv) or None -> (rows, dv)."""
    n_rows, n_kv, dv = q.shape[0], k.shape[0], v.shape[1]
    out = np.empty((n_rows, dv), dtype=F)
    for t0 in range(0, n_rows, T):
        qt = q[t0 : t0 + T]
        rows = len(qt)
        s_sum, m_max = np.zeros(rows, dtype=F), np.full(rows, -np.inf, dtype=F)
        vkq = np.zeros((rows, dv), dtype=F)
        for ic in range(0, n_kv, T):
            kv = min(T, n_kv - ic)
            m32 = np.full((rows, T), -np.inf, dtype=F)
            if mask is not None:
                m32[:, :kv] = slope * mask[t0 : t0 + rows, ic : ic + kv]
                if np.isneginf(m32).all():
                    continue
            kq = np.zeros((rows, T), dtype=F)
            kt = np.zeros((T, k.shape[1]), dtype=F)
            kt[:kv] = k[ic : ic + kv]
            for d in range(k.shape[1]):
                kq = _fma(qt[:, d][:, None], kt[:, d][None, :], kq)
            kq = (kq * scale).astype(F)
            if cap:
                kq = (np.array([[_C.tanhf(float(x)) for x in row] for row in kq], dtype=F) * cap).astype(F)
            kq[:, kv:] = -np.inf
            if mask is not None:
                kq = (kq + m32).astype(F)
            skip = np.zeros(rows, dtype=bool)
            for tq in range(rows):
                tile_max = kq[tq].max()
                if np.isneginf(tile_max):
                    skip[tq] = True
                    continue
                m_new = max(m_max[tq], tile_max)
                if m_new > m_max[tq]:
                    ms = F(_C.expf(float(F(m_max[tq] - m_new))))
                    vkq[tq] = (vkq[tq] * ms).astype(F)
                    s_sum[tq] = F(s_sum[tq] * ms)
                m_max[tq] = m_new
                with np.errstate(invalid="ignore", over="ignore"):
                    kq[tq] = _v_expf((kq[tq] - m_new).astype(F))
                lanes = kq[tq].reshape(8, 8)
                r = lanes[:, 4:] + lanes[:, :4]
                groups = (r[:, 0] + r[:, 2]) + (r[:, 1] + r[:, 3])
                s_sum[tq] = F(np.float64(s_sum[tq]) + sum(np.float64(g) for g in groups))
            kq[skip] = 0
            vt = np.zeros((T, dv), dtype=F)
            vt[:kv] = v[ic : ic + kv]
            for tk in range(T):
                vkq = _fma(kq[:, tk][:, None], vt[tk][None, :], vkq)
        for tq in range(rows):
            total, acc = s_sum[tq], vkq[tq]
            if sink is not None:
                ms, vs = F(1), F(1)
                if sink > m_max[tq]:
                    ms = F(_C.expf(float(F(m_max[tq] - sink))))
                    acc = (acc * ms).astype(F)
                else:
                    vs = F(_C.expf(float(F(sink - m_max[tq]))))
                total = _fma(total, ms, vs)[()]
            inv = F(1) / total if total != 0 else F(0)
            out[t0 + tq] = (acc * inv).astype(F)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_tiled_attention_is_ggmls_tiled_loop(seed: int) -> None:
    r = np.random.default_rng(seed)
    kv_type = int(GgmlType.F16) if seed % 2 else int(GgmlType.F32)
    dk, n_rows, n_kv, n_head = 8, int(r.choice([64, 70, 130])), int(r.choice([50, 64, 150])), 2
    max_bias, cap = (8.0 if seed % 3 == 1 else 0.0), (F(10) if seed == 4 else F(0))
    arena = Arena(1 << 20)
    q = arena.tensor(int(GgmlType.F32), (dk, n_rows, n_head))
    k = arena.tensor(kv_type, (dk, n_kv, n_head))
    v = arena.tensor(kv_type, (dk, n_kv, n_head))
    for t in (q, k, v):
        arena.set(t, r.standard_normal(arena.get(t).shape).astype(F))
    mask_vals = r.standard_normal((1, 1, n_rows, n_kv)).astype(F)
    mask_vals[..., : n_kv // 3][..., :, :] = np.where(r.random((n_rows, n_kv // 3)) < 0.5, -np.inf, 0)
    if n_kv > T:
        mask_vals[..., : T // 2, T:] = -np.inf  # the first tile of rows sees nothing of the second KV tile
    m = arena.tensor(int(GgmlType.F16), (n_kv, n_rows))
    arena.set(m, mask_vals)
    sinks = arena.tensor(int(GgmlType.F32), (n_head,))
    arena.set(sinks, (r.standard_normal(n_head) + 6).astype(F))  # above most rows' maximum: the rescaling branch
    scale = F(0.3)
    out = arena.tensor(int(GgmlType.F32), (dk, n_head, n_rows), op=GgmlOp.FLASH_ATTN_EXT,
                       src=(q, k, v, m, sinks if seed % 2 == 0 else None),
                       params=params(float(scale * cap if cap else scale), max_bias, float(cap)))
    execute([out])
    got = arena.get(out)[0]  # (rows, head, dv)
    slopes = alibi_slopes(n_head, max_bias)
    eff_scale = F(F(scale * cap) / cap) if cap else scale
    for h in range(n_head):
        want = _tiled_head(arena.get(q)[0, h], arena.get(k)[0, h], arena.get(v)[0, h], arena.get(m)[0, 0],
                           slopes[h], eff_scale, cap, arena.get(sinks)[0, 0, 0, h] if seed % 2 == 0 else None)
        assert got[:, h].tobytes() == want.tobytes(), h
