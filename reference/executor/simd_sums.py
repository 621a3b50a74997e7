"""The float32 arithmetic of ggml's AVX2 kernels, shared by every kernel that reproduces it bit for bit.

A fused multiply-add rounds once: it is computed in float64 (a product of two float32 or F16 values is exact there)
and rounded to float32 (a double rounding only a few units in 2^29 of the time).  ggml folds eight lanes in two ways:
``hsum_float_8`` (and tinyBLAS's ``hsum``) adds lane i + 4 to lane i, then 0 + 2 and 1 + 3, then the two;
``GGML_F32_VEC_REDUCE`` (the float vector dots) adds the halves with two horizontal adds: (0 + 1) + (2 + 3).
"""

from __future__ import annotations

import numpy as np

F = np.float32
F64 = np.float64


def fma32(a: np.ndarray | float, b: np.ndarray | float, c: np.ndarray | float) -> np.ndarray:
    """a * b + c rounded once to float32."""
    return (np.asarray(a, dtype=F64) * b + c).astype(F)


def hsum8(acc: np.ndarray) -> np.ndarray:
    """hsum_float_8 over the last axis (8 lanes), float32 throughout."""
    r = acc[..., 4:] + acc[..., :4]
    return (r[..., 0] + r[..., 2]) + (r[..., 1] + r[..., 3])


def hadd_sum8(acc: np.ndarray) -> np.ndarray:
    """GGML_F32_VEC_REDUCE's last steps over the last axis (8 lanes): the halves, then (0 + 1) + (2 + 3)."""
    t = acc[..., :4] + acc[..., 4:]
    return (t[..., 0] + t[..., 1]) + (t[..., 2] + t[..., 3])


def four_accumulators(w: np.ndarray, x: np.ndarray, whole: int) -> np.ndarray:
    """The vector dots' main loop: per 32 elements of ``w`` ``(m, k)`` and ``x`` ``(n, k)`` (first ``whole``),
    four accumulators of eight lanes updated by fused multiply-adds, then accumulators (0 + 2) + (1 + 3): float32
    lanes ``(n, m, 8)``."""
    n, m = x.shape[0], w.shape[0]
    acc = np.zeros((n, m, 4, 8), dtype=F)
    for i in range(0, whole, 32):
        a = w[None, :, i : i + 32].reshape(1, m, 4, 8).astype(F64)
        b = x[:, None, i : i + 32].reshape(n, 1, 4, 8)
        acc = (a * b + acc).astype(F)
    return (acc[:, :, 0] + acc[:, :, 2]) + (acc[:, :, 1] + acc[:, :, 3])
