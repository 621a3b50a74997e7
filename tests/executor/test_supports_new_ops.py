"""A 7.0.1 reference server answers GET_DEVICE_SUPPORTS_OP for the recurrent, hyper-connection and 2-D
convolution ops from the executor's table: yes for the types they compute, no for others and for refused ops."""

from __future__ import annotations

import pytest
from ggml_rpc.conformance.client import RpcClient
from ggml_rpc.reference import running_server
from ggml_rpc.spec import GgmlOp, GgmlType, make_tensor

NEW_OPS = [GgmlOp.SSM_SCAN, GgmlOp.RWKV_WKV6, GgmlOp.RWKV_WKV7, GgmlOp.GATED_LINEAR_ATTN, GgmlOp.GATED_DELTA_NET,
           GgmlOp.DSV4_HC_COMB, GgmlOp.DSV4_HC_PRE, GgmlOp.DSV4_HC_POST, GgmlOp.CONV_TRANSPOSE_2D, GgmlOp.CONV_2D_DW]


@pytest.fixture(scope="module")
def srv701():
    with running_server("7.0.1") as s:
        yield s


def test_new_ops_are_announced_for_f32_and_refused_ops_are_not(srv701):
    with RpcClient.connect(srv701.host, srv701.port, timeout=10.0) as c:
        a = make_tensor(id=1, ne=(8,))
        for i, op in enumerate(NEW_OPS):
            node = make_tensor(id=10 + i, ne=(8,), op=op, src=[1])
            assert c.supports_op(0, node, [a]) is True, op.name
        i8 = make_tensor(id=2, type=GgmlType.I8, ne=(8,))
        assert c.supports_op(0, make_tensor(id=30, ne=(8,), op=GgmlOp.SSM_SCAN, src=[2]), [i8]) is False
        assert c.supports_op(0, make_tensor(id=31, ne=(8,), op=GgmlOp.WIN_PART, src=[1]), [a]) is False
