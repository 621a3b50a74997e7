"""The float32 arithmetic of ggml's AVX2 kernels, shared by every kernel that reproduces it bit for bit.

A fused multiply-add rounds once: it is computed in float64 (a product of two float32 or F16 values is exact there)
and rounded to float32 (a double rounding only a few units in 2^29 of the time).  ggml folds eight lanes in two ways:
``hsum_float_8`` (and tinyBLAS's ``hsum``) adds lane i + 4 to lane i, then 0 + 2 and 1 + 3, then the two;
``GGML_F32_VEC_REDUCE`` (the float vector dots) adds the halves with two horizontal adds: (0 + 1) + (2 + 3).
The products' own loops, one output at a time, are compiled in :mod:`.compiled` with the same arithmetic (loaded
through :func:`.exact_kernels.kernels`).
"""

from __future__ import annotations

import numpy as np

F = np.float32
F64 = np.float64

#: Position in a 32-code block of the compiled kernels' packed forms -> element of the block: lane i's elements
#: 4i..4i+3 at i, i + 8, i + 16, i + 24 (a block's eight lane sums are then four vector adds).
LANE_ORDER = np.arange(32).reshape(8, 4).T.reshape(-1)
#: vec_dot kinds: how the lanes are folded and the tail added (ggml_vec_dot_f32 / _f16 / _bf16).
KIND_F32, KIND_F16, KIND_BF16 = 0, 1, 2
#: How a K-quant kernel treats the block sums (:func:`.compiled.k_products`'s ``mode``).
K_PLAIN, K_CORRECTED, K_MINS_FIRST, K_MINS_FOUR, K_MINS_SUM = 0, 1, 2, 3, 4


def fma32(a: np.ndarray | float, b: np.ndarray | float, c: np.ndarray | float) -> np.ndarray:
    """a * b + c rounded once to float32."""
    return (np.asarray(a, dtype=F64) * b + c).astype(F)


def hsum8(acc: np.ndarray) -> np.ndarray:
    """hsum_float_8 over the last axis (8 lanes), float32 throughout."""
    r = acc[..., 4:] + acc[..., :4]
    return (r[..., 0] + r[..., 2]) + (r[..., 1] + r[..., 3])
