"""The one NMSE of the kit (replay, compute checks, executor tests): NaN/inf-aware, zero-safe."""

from __future__ import annotations

import math

import numpy as np
import pytest
from ggml_rpc.conformance.nmse import nmse


def test_equal_values_are_zero_and_a_scaled_error_is_its_ratio() -> None:
    want = np.array([1.0, -2.0, 3.0], np.float32)
    assert nmse(want, want) == 0.0
    assert nmse(want, want * np.float32(1.1)) == pytest.approx(0.01, rel=1e-6)


def test_nan_or_inf_must_sit_where_expected() -> None:
    want = np.array([1.0, np.nan, np.inf], np.float32)
    assert nmse(want, want.copy()) == 0.0
    assert math.isinf(nmse(want, np.array([1.0, 0.0, np.inf], np.float32)))
    assert math.isinf(nmse(want, np.array([1.0, np.nan, -np.inf], np.float32)))
    assert math.isinf(nmse(np.ones(3, np.float32), np.array([1.0, np.nan, 1.0], np.float32)))


def test_all_zero_expected_gives_the_plain_squared_error() -> None:
    assert nmse(np.zeros(4), np.zeros(4)) == 0.0
    assert nmse(np.zeros(2), np.array([3e-4, 4e-4])) == pytest.approx(2.5e-7)


def test_different_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        nmse(np.zeros(3), np.zeros(4))
