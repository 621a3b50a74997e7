"""FLASH_ATTN_EXT's compiled one-query path for F16 K and V (scores and recurrence in one loop) against the same
step by step: ggml_vec_dot_f16 of each K row and the query rounded to F16, times the scale, plus the head's ALiBi
slope times the mask, then the online recurrence (:func:`_online`, itself checked against ggml's loop)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from ggml_rpc.reference.executor import execute
from ggml_rpc.reference.executor.arena import Arena, params
from ggml_rpc.reference.executor.attention import _float_scores, _online
from ggml_rpc.reference.executor.softmax import alibi_slopes
from ggml_rpc.spec import GgmlOp, GgmlType

F32, F16 = int(GgmlType.F32), int(GgmlType.F16)


@pytest.mark.parametrize("seed", range(24))
def test_fused_f16_attention_is_the_step_by_step_form(seed: int) -> None:
    r = np.random.default_rng(seed)
    d = int(r.choice([8, 40, 64, 80]))  # with and without a tail past the last 32
    dv = d if seed % 5 else 16
    n_q, n_kv = int(r.integers(1, 5)), int(r.integers(1, 40))
    khead, rh, k3, rs = int(r.integers(1, 3)), int(r.choice([1, 2, 4])), int(r.integers(1, 3)), int(r.choice([1, 2]))
    n_head, n_seq = khead * rh, k3 * rs
    max_bias = 8.0 if seed % 4 == 1 else 0.0
    cap = np.float32(10) if seed % 5 == 2 else np.float32(0)  # logit softcap: cap * tanhf(score), tanhf the C library's
    arena = Arena(1 << 20)
    q_vals = (r.standard_normal((n_seq, n_head, n_q, d)) * 2).astype(np.float32)
    k_vals = r.standard_normal((k3, khead, n_kv, d)).astype(np.float32)
    v_vals = r.standard_normal((k3, khead, n_kv, dv)).astype(np.float32)
    q = arena.tensor(F32, (d, n_q, n_head, n_seq))
    k = arena.tensor(F16, (d, n_kv, khead, k3))
    v = arena.tensor(F16, (dv, n_kv, khead, k3))
    for t, vals in ((q, q_vals), (k, k_vals), (v, v_vals)):
        arena.set(t, vals)
    srcs: list = [q, k, v, None, None]
    m_seq, m_head = (1, 1) if seed % 3 else (k3, n_head)  # a mask broadcast or one per sequence and head
    mask = None
    if seed % 6:
        mask = r.standard_normal((m_seq, m_head, n_q, n_kv)).astype(np.float32)
        mask[r.random(mask.shape) < 0.3] = -np.inf
        srcs[3] = arena.tensor(F16, (n_kv, n_q, m_head, m_seq))
        arena.set(srcs[3], mask)
        mask = arena.get(srcs[3])
    sinks = None
    if seed % 2:
        sinks = r.standard_normal(n_head).astype(np.float32)
        srcs[4] = arena.tensor(F32, (n_head,))
        arena.set(srcs[4], sinks)
    scale = np.float32(1 / math.sqrt(d))
    out = arena.tensor(F32, (dv, n_head, n_q, n_seq), op=GgmlOp.FLASH_ATTN_EXT, src=tuple(srcs),
                       params=params(float(scale * cap) if cap else float(scale), max_bias, float(cap)))
    execute([out])
    got = arena.get(out).swapaxes(1, 2)  # (seq, head, rows, dv)

    qh = q_vals.astype(np.float16).astype(np.float32)
    scaled = np.float32(np.float32(scale * cap) / cap) if cap else scale
    scores = _float_scores(F16, qh, arena.get(k), rh, rs) * scaled
    if cap:
        import ctypes
        import ctypes.util

        libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
        libm.tanhf.restype, libm.tanhf.argtypes = ctypes.c_float, [ctypes.c_float]
        scores = (cap * np.vectorize(lambda x: np.float32(libm.tanhf(float(x))), otypes=[np.float32])(scores))
    if mask is not None:
        full = np.tile(mask, (n_seq // m_seq, n_head // m_head, 1, 1))
        slopes = alibi_slopes(n_head, max_bias)[None, :, None, None]
        scores = scores + (slopes * full if max_bias > 0 else full)
    want = _online(scores, arena.get(v), None if sinks is None else sinks[None, :, None], rh, rs, half=True)
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize(("n_head", "max_bias"), [(4, 8.0), (12, 8.0), (16, 8.0), (32, 3.5), (40, 8.0)])
def test_alibi_slopes_are_the_c_librarys_powers(n_head: int, max_bias: float) -> None:
    """ggml's slopes: m0 = powf(2, -max_bias / n_head_log2), m1 = powf(2, -(max_bias / 2) / n_head_log2), then
    powf(m0, h + 1) or powf(m1, 2 (h - n_head_log2) + 1), every powf the C library's."""
    import ctypes
    import ctypes.util

    c = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
    c.powf.restype, c.powf.argtypes = ctypes.c_float, [ctypes.c_float, ctypes.c_float]
    f = np.float32
    log2 = 1 << math.floor(math.log2(n_head))
    m0 = f(c.powf(2.0, float(f(-f(max_bias) / f(log2)))))
    m1 = f(c.powf(2.0, float(f(-(f(max_bias) / f(2)) / f(log2)))))
    want = [f(c.powf(float(m0), float(h + 1))) if h < log2 else f(c.powf(float(m1), float(2 * (h - log2) + 1)))
            for h in range(n_head)]
    assert alibi_slopes(n_head, max_bias).tobytes() == np.array(want, dtype=f).tobytes()
