"""Protocol facts as functions: FNV-1a-64 and ggml_nbytes against independent references."""

from __future__ import annotations

import math

import numpy as np
import pytest
from ggml_rpc.spec import (
    HASH_THRESHOLD,
    TENSOR_DTYPE,
    TYPES,
    GgmlType,
    cache_file_name,
    contiguous_strides,
    fnv1a64,
    ggml_nbytes,
)
from ggml_rpc.spec.facts import ggml_nbytes_many
from hypothesis import given, settings
from hypothesis import strategies as st


def fnv1a64_reference(data: bytes) -> int:
    """FNV-1a 64 exactly as spec/PROTOCOL.md#hash states it: xor the byte, then multiply, modulo 2^64."""
    h = 0xCBF29CE484222325
    for byte in data:
        h ^= byte
        h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=2048))
def test_fnv1a64_matches_the_reference(data):
    want = fnv1a64_reference(data)
    assert fnv1a64(data) == want
    assert fnv1a64(bytearray(data)) == want
    assert fnv1a64(memoryview(data)) == want


def test_fnv1a64_edge_cases():
    assert fnv1a64(b"") == 0xCBF29CE484222325
    assert fnv1a64(b"a") == 0xAF63DC4C8601EC8C  # published FNV-1a test vector
    assert fnv1a64(b"foobar") == 0x85944171F73967E8  # published FNV-1a test vector
    data = bytes(range(256)) * 3
    strided = memoryview(data)[::3]  # not contiguous: hashed as its bytes
    assert fnv1a64(strided) == fnv1a64_reference(data[::3])
    assert fnv1a64(memoryview(data)[10:20]) == fnv1a64_reference(data[10:20])


def test_cache_file_name():
    assert cache_file_name(0x446E2D6404939D1E) == "446e2d6404939d1e"
    assert cache_file_name(0xAB) == "00000000000000ab"
    assert HASH_THRESHOLD == 10 * 1024 * 1024


def test_nbytes_zero_dimension():
    assert ggml_nbytes(0, [0, 4, 1, 1], [4, 0, 0, 0]) == 0
    assert ggml_nbytes(0, [4, 4, 0, 1], [4, 16, 64, 64]) == 0
    assert ggml_nbytes(2, [0, 1, 1, 1], [18, 0, 0, 0]) == 0


def test_nbytes_dimension_of_one_escapes_its_stride():
    """A dim with ne == 1 contributes nothing, whatever stride it claims (the #26912 escape)."""
    base = ggml_nbytes(0, [8, 1, 1, 1], [4, 32, 32, 32])
    assert base == 32
    assert ggml_nbytes(0, [8, 1, 1, 1], [4, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF]) == base
    assert ggml_nbytes(0, [8, 2, 1, 1], [4, 0xFFFFFFFF, 0, 0]) == 4 + 7 * 4 + 0xFFFFFFFF


def test_nbytes_plain_types():
    assert ggml_nbytes(0, [8, 2, 1, 1], [4, 32, 64, 64]) == 64  # F32: 4 + 7·4 + 1·32
    assert ggml_nbytes(1, [3, 1, 1, 1], [2, 6, 6, 6]) == 6  # F16
    assert ggml_nbytes(0, [4, 1, 1, 1], [8, 32, 32, 32]) == 4 + 3 * 8  # strided row


def test_nbytes_quantized_types():
    assert ggml_nbytes(2, [64, 2, 1, 1], [18, 36, 72, 72]) == 64 * 18 // 32 + 36  # Q4_0
    assert ggml_nbytes(12, [256, 3, 1, 1], [144, 144, 432, 432]) == 144 + 2 * 144  # Q4_K
    # ne[0] not a multiple of the block: integer division, as upstream computes it (#25288)
    assert ggml_nbytes(2, [33, 1, 1, 1], [18, 0, 0, 0]) == 33 * 18 // 32


def test_nbytes_removed_and_unknown_types():
    with pytest.raises(ValueError, match="removed"):
        ggml_nbytes(4, [1, 1, 1, 1], [0, 0, 0, 0])
    with pytest.raises(KeyError):
        ggml_nbytes(43, [1, 1, 1, 1], [4, 4, 4, 4])


LIVE_TYPES = [t for t in TYPES.values() if not t.removed]


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(LIVE_TYPES), st.lists(st.integers(1, 5), min_size=4, max_size=4), st.integers(1, 4))
def test_nbytes_of_contiguous_tensors_is_their_size(info, dims, blocks):
    ne = [blocks * info.blck, *dims[1:]]
    nb = contiguous_strides(info.id, ne)
    assert ggml_nbytes(info.id, ne, nb) == math.prod(ne) // info.blck * info.size


@pytest.mark.parametrize("type_id", [GgmlType.F32, GgmlType.F16, GgmlType.Q4_0, GgmlType.Q6_K, GgmlType.I8])
def test_the_vectorised_nbytes_is_the_scalar_rule(type_id) -> None:
    rng = np.random.default_rng(int(type_id))
    arr = np.zeros(50, dtype=TENSOR_DTYPE)
    arr["id"] = np.arange(1, 51)
    arr["type"] = type_id
    arr["ne"] = rng.integers(0, 1 << 32, (50, 4), dtype=np.uint64).astype(np.uint32)
    arr["ne"][:10] = rng.integers(0, 4, (10, 4))
    arr["nb"] = rng.integers(0, 1 << 32, (50, 4), dtype=np.uint64).astype(np.uint32)
    got, saturated = ggml_nbytes_many(arr["type"], arr["ne"], arr["nb"])
    want = [ggml_nbytes(int(type_id), r["ne"].tolist(), r["nb"].tolist()) for r in arr]
    assert got == want
    assert saturated.tolist() == [min(x, 2**64 - 1) for x in want]
