"""ggml's AVX2 vector math for SILU and SWIGLU (``ggml_v_expf``, ``ggml_v_silu``), so that they agree with upstream's
bit for bit.

Upstream runs a row's elements eight at a time through these polynomial approximations and the last ``n % 8`` through
the C library's ``expf`` (not correctly rounded either: see :mod:`.libm`).  Their results differ from numpy's exp by
an ulp now and then, which is enough to change one of the next matmul's 8-bit activation codes.  The steps are
compiled in :mod:`.vsilu`.
"""

from __future__ import annotations

import numpy as np

F = np.float32


def silu_rows(x: np.ndarray) -> np.ndarray:
    """SILU of every row (last axis) as ggml_vec_silu_f32 computes it: eight at a time through ggml's vector exp,
    the row's last ``n % 8`` with the C library's expf."""
    from .vsilu import silu_rows as compiled

    x = np.asarray(x, dtype=F)
    rows = np.ascontiguousarray(x).reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)
    out = np.empty(rows.shape, dtype=F)
    if out.size:
        compiled(rows, out)
    return out.reshape(x.shape)


def silu_libm(x: np.ndarray) -> np.ndarray:
    """``x / (1 + expf(-x))`` per element with the C library's expf, float32: ggml's scalar SILU, which its unary
    op runs for F16 and BF16 tensors (each value converted to float32 and back)."""
    from .libm import expf

    x = np.asarray(x, dtype=F)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        return (x / (F(1) + expf(-x))).astype(F)
