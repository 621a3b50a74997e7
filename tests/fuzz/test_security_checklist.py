"""The security checklist (conformance/fuzz/checklist.py): every item has a fuzz strategy aimed at it or a test
showing the reference server handles it.

The tests below cover the items no other test of the kit covers at the server level.  A graph attack either makes
the server close the connection (the executor refuses it) or is computed without a byte changing outside the
node's own bytes (a canary next to it is read back); either way the server goes on serving.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

import numpy as np
import pytest
from ggml_rpc.conformance.client import ConnectionClosed, RpcClient
from ggml_rpc.conformance.fuzz.checklist import CHECKLIST
from ggml_rpc.conformance.fuzz.nearvalid import FIELD_FLAWS, FLAWS
from ggml_rpc.reference import running_server
from ggml_rpc.spec import Command, GgmlOp, GgmlType, make_tensor, request_parts

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 10.0
COMPUTE = 16


@pytest.fixture(scope="module")
def srv():
    with running_server("7.0.1") as s:
        yield s


def connect(srv) -> RpcClient:
    return RpcClient.connect(srv.host, srv.port, timeout=TIMEOUT)


def assert_served(srv) -> None:
    with connect(srv) as c:
        assert c.device_count() == 1


def buffer(c: RpcClient, size: int) -> tuple[int, int]:
    handle, got = c.alloc_buffer(0, size)
    assert handle and got == size
    return handle, c.buffer_get_base(handle)


def closed_or_alive(c: RpcClient) -> bool:
    """True if the connection still answers (then the caller checks data), False if the server closed it."""
    try:
        return c.device_count() == 1
    except (ConnectionClosed, OSError):
        return False


# ---- the checklist itself --------------------------------------------------------------------------------------


def test_checklist_is_complete_and_names_what_exists():
    assert [i.number for i in CHECKLIST] == list(range(1, 23))
    for item in CHECKLIST:
        assert item.strategy or item.tests, item.number
        for node in item.tests:
            path, name = node.split("::")
            text = (ROOT / path).read_text()
            assert re.search(rf"^def {name}\(", text, re.M), node
        if item.strategy and not item.strategy.startswith("stateful:"):
            flaw, _, field = item.strategy.partition(": ")
            assert flaw in FLAWS, item.strategy
            if field:
                assert FIELD_FLAWS[field.rsplit(".", 1)[-1]] == flaw, item.strategy


# ---- items without a server-level test elsewhere ---------------------------------------------------------------


def test_zero_dimension_spans_no_bytes(srv):
    with connect(srv) as c:
        h, base = buffer(c, 64)
        t = make_tensor(id=1, ne=(8, 0), buffer=h, data=base)
        assert c.get_tensor(t, 0, 0) == b""
        c.send_raw(request_parts(c.protocol, Command.GET_TENSOR, {"tensor": t, "offset": 0, "size": 4}))
        assert c.expect_closed(TIMEOUT)
    assert_served(srv)


def test_recompute_after_free_closes(srv):
    with connect(srv) as c:
        h, base = buffer(c, 128)
        a = make_tensor(id=1, ne=(8,), buffer=h, data=base)
        out = make_tensor(id=2, ne=(8,), buffer=h, data=base + 64, src=[1, 1], op=GgmlOp.ADD, flags=COMPUTE)
        c.set_tensor(a, 0, np.arange(8, dtype=np.float32).tobytes())
        c.graph_compute(0, [2], [a, out])
        assert np.frombuffer(c.get_tensor(out, 0, 32), np.float32).tolist() == [2.0 * i for i in range(8)]
        c.free_buffer(h)
        c.graph_recompute(0)
        assert c.expect_closed(TIMEOUT)
    assert_served(srv)


def test_quantized_row_not_a_multiple_of_the_block(srv):
    # #25288: the row ends inside a block; the reference refuses such a tensor wherever it appears (FRAME-048).
    with connect(srv) as c:
        h, base = buffer(c, 256)
        q = make_tensor(id=1, type=GgmlType.Q4_0, ne=(33,), buffer=h, data=base)
        c.send_raw(request_parts(c.protocol, Command.SET_TENSOR, {"tensor": q, "offset": 0, "cache_flag": 0},
                                 bytes(range(18))))
        assert c.expect_closed(TIMEOUT)
    with connect(srv) as c:
        h, base = buffer(c, 256)
        q = make_tensor(id=1, type=GgmlType.Q4_0, ne=(33,), buffer=h, data=base)
        out = make_tensor(id=2, ne=(33,), buffer=h, data=base + 128, src=[1], op=GgmlOp.CPY, flags=COMPUTE)
        c.graph_compute(0, [2], [q, out])
        assert c.expect_closed(TIMEOUT)
    assert_served(srv)


@pytest.mark.parametrize("op", [GgmlOp.CUSTOM, GgmlOp.MAP_CUSTOM1, GgmlOp.MAP_CUSTOM2, GgmlOp.MAP_CUSTOM3])
def test_native_callback_ops_never_run(srv, op):
    with connect(srv) as c:
        h, base = buffer(c, 64)
        a = make_tensor(id=1, ne=(8,), buffer=h, data=base)
        node = make_tensor(id=2, ne=(8,), buffer=h, data=base + 32, src=[1], op=op, flags=COMPUTE,
                           op_params=[0x41414141, 0x41414141, 0, 0])
        c.graph_compute(0, [2], [a, node])
        assert c.expect_closed(TIMEOUT)
    assert_served(srv)


def _canary_attack(srv, build, *, must_close: bool = False) -> None:
    """Run the graph ``build(h, base)`` makes in a 512-byte buffer whose last 256 bytes are a canary: the server
    closes (``must_close``: it has to) or the canary is intact."""
    canary = bytes([0xAB]) * 256
    with connect(srv) as c:
        h, base = buffer(c, 512)
        guard = make_tensor(id=99, type=GgmlType.I8, ne=(256,), buffer=h, data=base + 256)
        c.set_tensor(guard, 0, canary)
        nodes, tensors, inputs = build(h, base)
        for t, data in inputs:
            c.set_tensor(t, 0, data)
        c.graph_compute(0, nodes, tensors)
        if must_close:
            assert c.expect_closed(TIMEOUT)
        elif closed_or_alive(c):
            assert bytes(c.get_tensor(guard, 0, 256)) == canary
    assert_served(srv)


@pytest.mark.parametrize("op", [GgmlOp.ACC, GgmlOp.SET])
@pytest.mark.parametrize("params", [[-64, -64, -64, 0, 0], [-4, 4, 0, 60, 0], [0x7FFFFFF0, 0, 0, 0, 1]])
def test_acc_and_set_strides_stay_inside(srv, op, params):
    def build(h, base):
        a = make_tensor(id=1, ne=(16,), buffer=h, data=base)
        b = make_tensor(id=2, ne=(4,), buffer=h, data=base + 64)
        node = make_tensor(id=3, ne=(16,), buffer=h, data=base + 128, src=[1, 2], op=op, flags=COMPUTE,
                           op_params=params)
        ones = np.ones(16, np.float32).tobytes()
        return [3], [a, b, node], [(a, ones), (b, ones[:16])]

    _canary_attack(srv, build)


def test_ssm_scan_is_refused_or_bounded(srv):
    def build(h, base):
        srcs = [make_tensor(id=i + 1, ne=(4,), buffer=h, data=base + 16 * i) for i in range(7)]
        ids = make_tensor(id=8, type=GgmlType.I32, ne=(4,), buffer=h, data=base + 112)
        node = make_tensor(id=9, ne=(8,), buffer=h, data=base + 128, src=[*range(1, 9)], op=GgmlOp.SSM_SCAN,
                           flags=COMPUTE)
        return [9], [*srcs, ids, node], [(ids, struct.pack("<4i", 1000, -5, 1 << 30, 3))]

    _canary_attack(srv, build)


@pytest.mark.parametrize("rows", [[1000, 0], [-1, 0], [0, 1 << 30]])
def test_get_rows_out_of_range_rows_close(srv, rows):
    def build(h, base):
        table = make_tensor(id=1, ne=(4, 4), buffer=h, data=base)
        idx = make_tensor(id=2, type=GgmlType.I32, ne=(2,), buffer=h, data=base + 64)
        node = make_tensor(id=3, ne=(4, 2), buffer=h, data=base + 128, src=[1, 2], op=GgmlOp.GET_ROWS,
                           flags=COMPUTE)
        return [3], [table, idx, node], [(idx, struct.pack("<2i", *rows))]

    _canary_attack(srv, build, must_close=True)  # rows outside the table: refused before any write


def test_stride_of_a_unit_dimension_is_not_a_way_out(srv):
    def build(h, base):
        # ne[1] = 1: its stride adds nothing to nbytes, whatever it claims (#26912).
        src = make_tensor(id=1, ne=(4, 1), nb=(4, 0x40000000, 0x40000000, 0x40000000), buffer=h, data=base + 224)
        node = make_tensor(id=2, ne=(4, 1), buffer=h, data=base, src=[1], op=GgmlOp.DUP, flags=COMPUTE)
        return [2], [src, node], []

    _canary_attack(srv, build)


@pytest.mark.parametrize("command, where", [
    (Command.SET_TENSOR, "tensor"), (Command.GET_TENSOR, "tensor"), (Command.MEMSET_TENSOR, "tensor"),
    (Command.INIT_TENSOR, "tensor"), (Command.COPY_TENSOR, "src"), (Command.COPY_TENSOR, "dst"),
    (Command.GET_ALLOC_SIZE, "tensor"), (Command.GET_DEVICE_SUPPORTS_OP, "op"),
])
def test_data_outside_the_buffer_closes_every_tensor_command(srv, command, where):
    with connect(srv) as c:
        h, base = buffer(c, 64)
        good = make_tensor(id=1, ne=(4,), buffer=h, data=base)
        bad = make_tensor(id=2, ne=(4,), buffer=h, data=base + 60)  # 16 bytes from 4 before the end
        fields = {
            Command.SET_TENSOR: {"tensor": bad, "offset": 0, "cache_flag": 0},
            Command.GET_TENSOR: {"tensor": bad, "offset": 0, "size": 4},
            Command.MEMSET_TENSOR: {"tensor": bad, "offset": 0, "size": 4, "value": 1},
            Command.INIT_TENSOR: {"tensor": bad},
            Command.COPY_TENSOR: {"src": bad if where == "src" else good, "dst": bad if where == "dst" else good},
            Command.GET_ALLOC_SIZE: {"device": 0, "tensor": bad, "srcs": c._srcs(None)},
            Command.GET_DEVICE_SUPPORTS_OP: {"device": 0, "op": bad, "srcs": c._srcs(None)},
        }[command]
        data = b"\1\2\3\4" if command is Command.SET_TENSOR else None
        c.send_raw(request_parts(c.protocol, command, fields, data))
        assert c.expect_closed(TIMEOUT)
    assert_served(srv)


def test_deep_chain_over_the_wire(srv):
    n = 20_000
    with connect(srv) as c:
        from ggml_rpc.spec import TENSOR_DTYPE

        arr = np.zeros(n, dtype=TENSOR_DTYPE)
        arr["id"] = np.arange(1, n + 1)
        arr["src"][1:, 0] = np.arange(1, n)
        arr["ne"] = 1
        arr["nb"] = 4
        c.graph_compute(0, [n], arr)
        assert c.device_count() == 1
    assert_served(srv)
