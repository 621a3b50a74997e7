"""The activation path of quantised matmuls: Q8_0/Q8_1 values without block packing equal quantize + dequantize."""

from __future__ import annotations

import numpy as np
import pytest
from ggml_rpc.reference.executor.types import Q8_0, Q8_1, dequantize, quantize, through_type


@pytest.mark.parametrize("vec_dot", [Q8_0, Q8_1])
@pytest.mark.parametrize("scale", [1e-6, 1e-2, 1.0, 300.0])
def test_through_q8_is_the_block_round_trip_bit_for_bit(vec_dot: int, scale: float) -> None:
    r = np.random.default_rng(int(scale * 1000) + vec_dot)
    x = (r.standard_normal((2, 3, 4, 128)) * scale).astype(np.float32)
    x[0, 0, 0, :32] = 0  # an all-zero block: scale 0, codes 0
    x[1, 2, 3, 40] = 63.5 / 127 * np.abs(x[1, 2, 3, 32:64]).max()  # a code exactly halfway: rounds to even
    x = x.swapaxes(1, 2)  # non-contiguous input
    want = dequantize(vec_dot, quantize(vec_dot, x))
    got = through_type(vec_dot, x)
    assert got.shape == x.shape and got.dtype == np.float32
    assert got.tobytes() == want.tobytes()
