"""MUL_MAT of F32, F16 and BF16 weights in the arithmetic of upstream's AVX2 build.

One token (or a product llamafile's tinyBLAS does not take) goes through ``ggml_vec_dot_f32``/``_f16``: per 32
elements, four accumulators of eight float32 lanes updated by fused multiply-adds; then accumulators 0+2 and 1+3,
their sum, its lanes i + i+4, then pairwise; the elements past the last whole 32 added one product at a time (F32:
a float32 product into a float32 sum; F16: each float32 product added to a float64 sum).  A batch (two rows or
more, weights of a multiple of 4 rows) goes through tinyBLAS: one accumulator of eight lanes per output, updated by
a fused multiply-add every 8 elements (the last partial 8 padded with zeros), then its own lane sum (the halves
added, then lanes 0 + 2 and 1 + 3).  An F16 product first rounds the activations to F16, as ggml converts them.

Each fused multiply-add is computed in float64 (a float32 or F16 product is exact there) and rounded once.
"""

from __future__ import annotations

import numpy as np

from .formats import bf16_to_f32, f32_to_bf16
from .simd_sums import KIND_BF16, KIND_F16, KIND_F32

F = np.float32
_KINDS = {"f32": KIND_F32, "f16": KIND_F16, "bf16": KIND_BF16}


def vec_dot(w: np.ndarray, x: np.ndarray, kind: str, out: np.ndarray | None = None) -> np.ndarray:
    """``x @ w^T`` as ``ggml_vec_dot_f32``, ``_f16`` or ``_bf16`` (``kind``) computes each dot: w ``(m, k)``, x
    ``(n, k)``, both float32 holding the operands' values.  The three share the four-accumulator loop (BF16's is a
    multiply and an add, which the compiler fuses); F32 and F16 fold the lanes with horizontal adds, BF16 as
    hsum_float_8; the elements past the last whole 32 are added one product at a time (F32: into a float32 sum;
    F16/BF16: each float32 product into a double).  Returns float32 ``(n, m)``: ``out`` when given (C-contiguous
    float32 of that shape)."""
    out = np.empty((x.shape[0], w.shape[0]), dtype=F) if out is None else out
    _kernels().float_vec_dot(_rows(w), _rows(x), _KINDS[kind], out)
    return out


def direct(w: np.ndarray, x: np.ndarray) -> bool:
    """Whether :func:`f32_vec_dot` takes ``w`` and ``x`` as they are (float32 rows of contiguous elements)."""
    return all(a.dtype == F and a.ndim == 2 and a.strides[-1] == 4 for a in (w, x))


def f32_vec_dot(w: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """:func:`vec_dot` of F32 weights into ``out``, for operands :func:`direct` accepts: no checks, no copies."""
    _kernels().float_vec_dot(w, x, KIND_F32, out)


def tinyblas(w: np.ndarray, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``x @ w^T`` as llamafile's tinyBLAS computes each output (one 8-lane accumulator, a fused multiply-add per 8
    elements, the tail padded with zeros).  Returns float32 ``(n, m)``: ``out`` when given."""
    out = np.empty((x.shape[0], w.shape[0]), dtype=F) if out is None else out
    _kernels().tinyblas(_rows(w), _rows(x), out)
    return out


def _kernels():  # type: ignore[no-untyped-def]
    # The compiled loops, imported (with numba) on first use.
    from . import float_kernels

    return float_kernels


def _rows(a: np.ndarray) -> np.ndarray:
    # Rows of float32 with contiguous elements: one compiled specialisation, and each row read in order.
    return a if a.dtype == F and a.strides[-1] == 4 else np.ascontiguousarray(a, dtype=F)


def products(w: np.ndarray, x: np.ndarray, *, half: bool, batch: bool, brain: bool = False,
             out: np.ndarray | None = None) -> np.ndarray:
    """The product upstream runs for these shapes: tinyBLAS for a batch of weights with a multiple of 4 rows, the
    vector dot otherwise.  ``half``: F16 weights, ``brain``: BF16 weights (the activations are rounded to the
    weights' type first, as ggml converts them).  ``out``: where to write it (C-contiguous float32 ``(n, m)``), so
    that a graph's product lands in its node's memory without a copy."""
    if half:
        x = x.astype(np.float16).astype(F)
    if brain:
        x = bf16_to_f32(f32_to_bf16(np.ascontiguousarray(x, dtype=F)))
    if batch and w.shape[0] % 4 == 0:
        return tinyblas(w, x, out)
    return vec_dot(w, x, "bf16" if brain else "f16" if half else "f32", out)
