"""GELU (tanh form) and quick GELU as ggml's CPU backend computes them for float32: through its F16 tables.

ggml fills a 65,536-entry table per function when the backend starts: for every F16 value f, the float32 formula of
f rounded to F16 (GELU: ``0.5 x (1 + tanhf(sqrt(2/pi) x (1 + 0.044715 x x)))``, its compiler fusing the innermost
product into the ``1 +``: of the 65,536 entries only -1.9990234's depends on that, and upstream 7.0.0's GELU of it is
the fused form's; quick GELU: ``x (1 / (1 + expf(-1.702 x)))``), with the C library's tanhf and expf.  A float32
input is rounded to F16 and looked up; GELU returns 0 at -10 and below and x itself at 10 and above.  A BF16 tensor
takes the formula itself, value by value (here: looked up in the formula's values for every BF16 input).  The tables
here are made the same way, once per process, on first use.
"""

from __future__ import annotations

from functools import cache

import numpy as np

from .formats import HALVES, bf16_to_f32
from .libm import expf, tanhf

F = np.float32
_SQRT_2_OVER_PI = F(0.79788456080286535587989211986876)
_GELU_COEF_A = F(0.044715)
_GELU_QUICK_COEF = F(-1.702)


def _brains() -> np.ndarray:
    return bf16_to_f32(np.arange(1 << 16, dtype=np.uint16))


def _gelu_formula(x: np.ndarray) -> np.ndarray:
    """ggml_gelu_f32 of every value of x (float32), the innermost product fused into its ``1 +``."""
    with np.errstate(all="ignore"):
        inner = (np.float64(_GELU_COEF_A * x) * x + np.float64(1)).astype(F)  # fused: rounded once
        arg = ((_SQRT_2_OVER_PI * x) * inner).astype(F)
        return ((F(0.5) * x) * (F(1) + tanhf(arg))).astype(F)


def _gelu_quick_formula(x: np.ndarray) -> np.ndarray:
    """ggml_gelu_quick_f32 of every value of x (float32)."""
    with np.errstate(all="ignore"):
        return (x * (F(1) / (F(1) + expf((_GELU_QUICK_COEF * x).astype(F))))).astype(F)


@cache
def gelu_table() -> np.ndarray:
    """ggml_table_gelu_f16 as float32: GELU of every F16 value, rounded to F16."""
    with np.errstate(over="ignore"):
        return _gelu_formula(HALVES).astype(np.float16).astype(F)


@cache
def gelu_quick_table() -> np.ndarray:
    """ggml_table_gelu_quick_f16 as float32: quick GELU of every F16 value, rounded to F16."""
    with np.errstate(over="ignore"):
        return _gelu_quick_formula(HALVES).astype(np.float16).astype(F)


@cache
def _brain_tables() -> tuple[np.ndarray, np.ndarray]:
    # Both formulas over every BF16 value, not rounded: ggml computes BF16 tensors value by value in float32.
    b = _brains()
    return _gelu_formula(b), _gelu_quick_formula(b)


def gelu_brain(x: np.ndarray) -> np.ndarray:
    """ggml_gelu_f32 of BF16 values (float32 holding them), as ggml computes a BF16 tensor: no table, no clamp."""
    return _brain_tables()[0][np.asarray(x, dtype=F).view(np.uint32) >> np.uint32(16)]


def gelu_quick_brain(x: np.ndarray) -> np.ndarray:
    """ggml_gelu_quick_f32 of BF16 values (float32 holding them)."""
    return _brain_tables()[1][np.asarray(x, dtype=F).view(np.uint32) >> np.uint32(16)]


def _index(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.asarray(x, dtype=F).astype(np.float16).view(np.uint16)


def gelu(x: np.ndarray) -> np.ndarray:
    """ggml_vec_gelu_f32: the table inside (-10, 10), 0 at or below -10, x at or above 10."""
    x = np.asarray(x, dtype=F)
    y = gelu_table()[_index(x)]
    return np.where(x <= -10, F(0), np.where(x >= 10, x, y)).astype(F)


def gelu_half(x: np.ndarray) -> np.ndarray:
    """ggml_vec_gelu_f16: F16 values (float32 holding them) straight from the table, no clamp."""
    return gelu_table()[_index(x)]


def gelu_quick(x: np.ndarray) -> np.ndarray:
    """ggml_vec_gelu_quick_f32: the table for every value."""
    return gelu_quick_table()[_index(x)]
