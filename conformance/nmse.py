"""The one measure of how far computed values are from expected ones, as llama.cpp's backend tests use it.

``nmse(expected, got) = sum((got - expected)^2) / sum(expected^2)``.  Non-finite values must match exactly
(NaN where NaN is expected, the same infinity where one is expected), else the distance is infinite: a result of
NaN is never "close".  When every expected value is zero the plain sum of squared errors is returned, so exact
zeros compare as 0 and a tiny rounding residue stays tiny.
"""

from __future__ import annotations

import numpy as np


def nmse(expected: np.ndarray, got: np.ndarray) -> float:
    """Normalised mean squared error of ``got`` against ``expected`` (same number of elements, any float dtype)."""
    e = np.asarray(expected, dtype=np.float64).ravel()
    g = np.asarray(got, dtype=np.float64).ravel()
    if e.shape != g.shape:
        raise ValueError(f"nmse of {e.size} expected and {g.size} computed values")
    fe, fg = np.isfinite(e), np.isfinite(g)
    if not np.array_equal(fe, fg):
        return float("inf")
    if not fe.all():
        e_bad, g_bad = e[~fe], g[~fe]
        if not np.all((e_bad == g_bad) | (np.isnan(e_bad) & np.isnan(g_bad))):
            return float("inf")
        e, g = e[fe], g[fe]
    diff = g - e
    num = float(np.dot(diff, diff))
    den = float(np.dot(e, e))
    return num / den if den else num
