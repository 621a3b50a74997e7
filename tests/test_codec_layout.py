"""The fast layouts derived from the construct declarations agree with construct itself."""

from __future__ import annotations

import numpy as np
import pytest
from codec_helpers import plain
from ggml_rpc.spec import PROTOCOLS, RPC_TENSOR_SIZE, TENSOR_DTYPE, TENSOR_LAYOUT, Payload, RpcTensor, Shape
from ggml_rpc.spec.codec import tensors_array
from ggml_rpc.spec.layout import flat_layout, record_to_dict
from ggml_rpc.spec.strategies import tensors
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_tensor_dtype_matches_the_declaration():
    assert TENSOR_DTYPE.itemsize == RPC_TENSOR_SIZE == RpcTensor.sizeof() == 296
    offsets = {name: TENSOR_DTYPE.fields[name][1] for name in TENSOR_DTYPE.names}
    assert list(offsets) == [sub.name for sub in RpcTensor.subcons]
    assert offsets["buffer"] == 12 and offsets["name"] == 228 and offsets["use_count"] == 292
    assert TENSOR_LAYOUT.size == 296


@SETTINGS
@given(st.lists(tensors(), min_size=1, max_size=5))
def test_random_tensors_agree_across_construct_struct_and_numpy(items):
    built = b"".join(RpcTensor.build(t) for t in items)
    # struct layout builds the same bytes and parses them back alike
    assert b"".join(TENSOR_LAYOUT.pack(t) for t in items) == built
    for i, t in enumerate(items):
        assert TENSOR_LAYOUT.unpack(built, i * RPC_TENSOR_SIZE) == t
    # numpy: the same bytes viewed as a structured array give the same values
    arr = np.frombuffer(built, dtype=TENSOR_DTYPE)
    assert [record_to_dict(r) for r in arr] == items
    assert tensors_array(items).tobytes() == built
    assert int(arr["buffer"][0]) == items[0]["buffer"] and list(arr["op_params"][0]) == items[0]["op_params"]


@SETTINGS
@given(st.binary(min_size=296, max_size=296))
def test_any_296_bytes_parse_alike(raw):
    want = plain(RpcTensor.parse(raw))
    assert TENSOR_LAYOUT.unpack(raw) == want
    assert record_to_dict(np.frombuffer(raw, dtype=TENSOR_DTYPE)[0]) == want


HEADERS = list(
    {
        id(x): x
        for p in PROTOCOLS
        for s in p.commands.values()
        for x in (s.request, s.reply)
        if isinstance(x, Payload) and x.shape in (Shape.FIXED, Shape.HEADER_DATA)
    }.values()
)


@pytest.mark.parametrize("payload", HEADERS, ids=lambda pl: pl.doc[:30])
def test_every_fixed_header_has_a_flat_layout_of_the_declared_size(payload):
    assert flat_layout(payload.schema).size == payload.schema.sizeof()
