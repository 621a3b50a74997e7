"""FLASH_ATTN_EXT's one-query recurrence (F16 V): the vectorised form against ggml's loop written out per row.

The loop below is the recurrence as ggml's CPU backend runs it for one query row: walk the KV positions in order,
skip masked (-inf) ones, on a new maximum rescale the F16 accumulator (rounded to F16) and restart the weight at 1,
otherwise weight the row by exp(s - max); add the weighted V row with a fused multiply-add (rounded once to
float32) and round to F16 after every step; the denominator S = S * ms + vs fused too; exp the C library's expf.
Those are the roundings upstream's build makes (its compiler fuses the multiply-adds), measured against its
FLASH_ATTN_EXT results.  The sink's own S * ms + vs, after the loop, is not fused there.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np
import pytest
from ggml_rpc.reference.executor.attention import _online

_LIBM = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
_LIBM.expf.restype, _LIBM.expf.argtypes = ctypes.c_float, [ctypes.c_float]


def _expf(x: np.float32) -> np.float32:
    return np.float32(_LIBM.expf(float(x)))


def _fma(a: np.float32, b: np.float32, c: np.float32) -> np.float32:
    return np.float32(np.float64(a) * np.float64(b) + np.float64(c))


def _one_row(s: np.ndarray, v: np.ndarray, sink: float | None, half: bool = True) -> np.ndarray:
    # ``half``: an F16 V, its accumulator rounded back to F16 at every step; otherwise a float32 accumulator,
    # rescaled by a product per value (ggml_vec_scale_f32) and added to by a fused multiply-add (ggml_vec_mad_f32).
    store = np.float16 if half else np.float32
    acc = np.zeros(v.shape[-1], dtype=store)
    m, total = np.float32(-np.inf), np.float32(0)
    for ic in range(len(s)):
        if np.isneginf(s[ic]):
            continue
        ms, vs = np.float32(1), np.float32(1)
        if s[ic] > m:
            ms = _expf(np.float32(m - s[ic]))
            m = s[ic]
            acc = (acc.astype(np.float32) * ms).astype(store)
        else:
            vs = _expf(np.float32(s[ic] - m))
        acc = (acc.astype(np.float64) + v[ic].astype(np.float64) * np.float64(vs)).astype(np.float32).astype(store)
        total = _fma(total, ms, vs)
    out = acc.astype(np.float32)
    if sink is not None:
        sink = np.float32(sink)
        ms, vs = (_expf(np.float32(m - sink)), np.float32(1)) if sink > m else (np.float32(1), _expf(sink - m))
        out, total = out * np.float32(ms), np.float32(np.float32(total * ms) + vs)  # not fused in upstream's build
    return (out * (np.float32(1) / total if total != 0 else np.float32(0))).astype(np.float32)


@pytest.mark.parametrize("seed", range(40))
def test_vectorised_recurrence_is_ggmls_loop_bit_for_bit(seed: int) -> None:
    r = np.random.default_rng(seed)
    seq, head, rows, n_kv, dv = (int(x) for x in (r.integers(1, 3), r.integers(1, 4), r.integers(1, 6),
                                                   r.integers(1, 30), r.choice([4, 16, 64])))
    scores = (r.standard_normal((seq, head, rows, n_kv)) * r.choice([0.1, 1.0, 8.0])).astype(np.float32)
    if seed % 3:
        scores[r.random(scores.shape) < 0.4] = -np.inf  # masked positions, some rows fully masked
    # V as an F16 cache holds it, read back to float32; a transposed copy makes the input non-contiguous.
    v = np.ascontiguousarray(r.standard_normal((seq, head, dv, n_kv)).astype(np.float16).astype(np.float32))
    v = v.swapaxes(-1, -2)
    sinks = r.standard_normal((1, head, 1)).astype(np.float32) if seed % 2 else None
    got = _online(scores, v, sinks, 1, 1, half=True)
    for i in np.ndindex(seq, head, rows):
        want = _one_row(scores[i], v[i[0], i[1]], None if sinks is None else float(sinks[0, i[1], 0]))
        assert got[i].tobytes() == want.tobytes(), i


def test_every_position_masked_gives_zeros_or_the_sink_alone() -> None:
    scores = np.full((1, 2, 1, 5), -np.inf, dtype=np.float32)
    v = np.ones((1, 2, 5, 4), dtype=np.float32)
    assert not _online(scores, v, None, 1, 1, half=True).any()
    assert not _online(scores, v, np.zeros((1, 2, 1), dtype=np.float32), 1, 1, half=True).any()


@pytest.mark.parametrize(("rh", "rs"), [(2, 1), (4, 1), (1, 2), (2, 3)])
def test_shared_kv_heads_read_their_own_v(rh: int, rs: int) -> None:
    """Query head h reads V head h // rh, sequence s V sequence s // rs: the same as V repeated per query head."""
    r = np.random.default_rng(rh * 10 + rs)
    k3, khead, n_kv, dv, rows = 2, 2, 9, 8, 3
    scores = r.standard_normal((k3 * rs, khead * rh, rows, n_kv)).astype(np.float32)
    scores[r.random(scores.shape) < 0.3] = -np.inf
    v = r.standard_normal((k3, khead, n_kv, dv)).astype(np.float16).astype(np.float32)
    repeated = np.repeat(np.repeat(v, rh, axis=1), rs, axis=0)
    sinks = r.standard_normal((1, khead * rh, 1)).astype(np.float32)
    got = _online(scores, v, sinks, rh, rs, half=True)
    assert got.tobytes() == _online(scores, repeated, sinks, 1, 1, half=True).tobytes()
    for i in np.ndindex(*scores.shape[:3]):
        want = _one_row(scores[i], v[i[0] // rs, i[1] // rh], float(sinks[0, i[1], 0]))
        assert got[i].tobytes() == want.tobytes(), i


@pytest.mark.parametrize("seed", range(30))
def test_float32_accumulator_recurrence_is_ggmls_loop_bit_for_bit(seed: int) -> None:
    r = np.random.default_rng(1000 + seed)
    seq, head, rows, n_kv, dv = (int(x) for x in (r.integers(1, 3), r.integers(1, 4), r.integers(1, 6),
                                                   r.integers(1, 30), r.choice([4, 16, 64])))
    scores = (r.standard_normal((seq, head, rows, n_kv)) * r.choice([0.1, 1.0, 8.0])).astype(np.float32)
    if seed % 3:
        scores[r.random(scores.shape) < 0.4] = -np.inf
    v = r.standard_normal((seq, head, n_kv, dv)).astype(np.float32)  # an F32 (or dequantised) V
    sinks = r.standard_normal((1, head, 1)).astype(np.float32) if seed % 2 else None
    got = _online(scores, v, sinks, 1, 1, half=False)
    for s_, h, i in np.ndindex(seq, head, rows):
        want = _one_row(scores[s_, h, i], v[s_, h], None if sinks is None else sinks[0, h, 0], half=False)
        assert got[s_, h, i].tobytes() == want.tobytes(), (s_, h, i)
    # The F16 recurrence on the same input differs (it rounds its accumulator): the two paths are distinct.
    if seed == 0:
        assert not np.array_equal(_online(scores, v, sinks, 1, 1, half=True), got)
