"""Protocol 8.0.0 in the reference server: 2-D transfers, graphs kept per uid, the two-server communicator."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from ggml_rpc.reference import running_server
from ggml_rpc.reference.comm import bf16_bits, bf16_to_f32
from ggml_rpc.spec import V8, Command, GgmlOp, TensorFlag
from ggml_rpc.spec.facts import COMM_BF16_FROM_ELEMENTS as BF16_FROM_ELEMENTS
from refhelpers import TIMEOUT, assert_closes, assert_served, connect, tensor_in


@pytest.fixture(scope="module")
def srv8():
    with running_server("8") as s:
        yield s


def _f32(c, n: int) -> dict:
    return tensor_in(c, 4 * n, ne=(n,))[0]


def test_rows_land_stride_apart_and_read_back_packed(srv8) -> None:
    with connect(srv8) as c:
        t = tensor_in(c, 1024)[0]
        c.set_tensor(t, 0, bytes(1024))
        rows = bytes(range(32))  # 4 rows of 8 bytes
        c.set_tensor_2d(t, 4, 8, 64, rows)
        whole = bytes(c.get_tensor(t, 0, 1024))
        for i in range(4):
            assert whole[4 + 64 * i : 12 + 64 * i] == rows[8 * i : 8 * i + 8]
        assert whole.count(0) == 1024 - 31  # nothing else written (row 0 starts with a zero byte)
        assert c.get_tensor_2d(t, 4, 8, 4, 64) == rows
        assert c.get_tensor_2d(t, 4, 32, 1, 0) == whole[4:36]


def test_overlapping_rows_are_written_in_order(srv8) -> None:
    with connect(srv8) as c:
        t = tensor_in(c, 64)[0]
        c.set_tensor(t, 0, bytes(64))
        c.set_tensor_2d(t, 0, 8, 4, b"A" * 8 + b"B" * 8)  # stride 4 < size 8: row 1 overwrites half of row 0
        assert bytes(c.get_tensor(t, 0, 12)) == b"AAAA" + b"B" * 8


def test_rows_with_stride_zero_land_on_one_place_the_last_one_kept(srv8) -> None:
    with connect(srv8) as c:
        t = tensor_in(c, 64)[0]
        c.set_tensor(t, 0, bytes(64))
        c.set_tensor_2d(t, 8, 4, 0, b"AAAABBBBCCCC")
        assert bytes(c.get_tensor(t, 0, 16)) == bytes(8) + b"CCCC" + bytes(4)
        assert c.get_tensor_2d(t, 8, 4, 3, 0) == b"CCCC" * 3


@pytest.mark.parametrize(("size", "n_copies", "stride", "why"), [
    (0, 4, 8, "size 0"), (8, 0, 8, "no rows"), (8, 4, 1 << 62, "span overflows 64 bits"),
    (8, 200, 8, "rows past the tensor"),
])
def test_bad_row_regions_close(srv8, size, n_copies, stride, why) -> None:
    with connect(srv8) as c:
        t = tensor_in(c, 1024)[0]
        fields = {"tensor": t, "offset": 0, "size": size, "n_copies": n_copies, "stride": stride}
        assert_closes(c, Command.GET_TENSOR_2D, fields)
    with connect(srv8) as c:
        t = tensor_in(c, 1024)[0]
        fields = {"tensor": t, "offset": 0, "size": size, "n_copies": n_copies, "stride": stride}
        assert_closes(c, Command.SET_TENSOR_2D, fields, bytes(size * n_copies))
    assert_served(srv8)


def test_set_rows_with_the_wrong_data_length_closes(srv8) -> None:
    with connect(srv8) as c:
        t = tensor_in(c, 1024)[0]
        fields = {"tensor": t, "offset": 0, "size": 8, "n_copies": 4, "stride": 8}
        assert_closes(c, Command.SET_TENSOR_2D, fields, bytes(31))
    assert_served(srv8)


def _add_graph(c, n: int = 16):
    a, b, out = (_f32(c, n) for _ in range(3))
    a["id"], b["id"] = 11, 12
    node = dict(out, id=13, op=GgmlOp.ADD, src=[11, 12] + [0] * 8, flags=TensorFlag.COMPUTE)
    return a, b, node


def test_graphs_are_kept_per_uid(srv8) -> None:
    with connect(srv8) as c:
        a, b, node = _add_graph(c)
        c.set_tensor(a, 0, np.full(16, 1, np.float32).tobytes())
        c.set_tensor(b, 0, np.full(16, 2, np.float32).tobytes())
        c.graph_compute(0, [13], [a, b, node], uid=7)
        twice = dict(a, op=GgmlOp.ADD, src=[13, 13] + [0] * 8, id=14, flags=TensorFlag.COMPUTE)
        c.graph_compute(0, [14], [a, b, node, twice], uid=8)  # a = out + out
        c.set_tensor(b, 0, np.full(16, 5, np.float32).tobytes())
        c.graph_recompute(0, uid=7)  # out = a + b with the a that uid 8 wrote
        out = np.frombuffer(bytes(c.get_tensor(node, 0, 64)), np.float32)
        assert out.tolist() == [11.0] * 16
        assert_closes(c, Command.GRAPH_RECOMPUTE, {"device": 0, "uid": 9})
    assert_served(srv8)


def test_uid_zero_is_not_kept_and_free_buffer_forgets_every_graph(srv8) -> None:
    with connect(srv8) as c:
        a, b, node = _add_graph(c)
        c.graph_compute(0, [13], [a, b, node], uid=0)
        assert_closes(c, Command.GRAPH_RECOMPUTE, {"device": 0, "uid": 0})
    with connect(srv8) as c:
        a, b, node = _add_graph(c)
        c.graph_compute(0, [13], [a, b, node], uid=3)
        c.graph_recompute(0, uid=3)
        spare, _ = c.alloc_buffer(0, 64)
        c.free_buffer(spare)  # a buffer the graph does not use
        assert_closes(c, Command.GRAPH_RECOMPUTE, {"device": 0, "uid": 3})
    assert_served(srv8)


def test_the_graph_cache_empties_at_its_limit(srv8) -> None:
    with connect(srv8) as c:
        a, b, node = _add_graph(c)
        for uid in range(1, V8.graph_cache_max + 1):
            c.graph_compute(0, [13], [a, b, node], uid=uid)
        c.graph_recompute(0, uid=1)  # 1024 graphs kept
        c.graph_compute(0, [13], [a, b, node], uid=5000)  # the 1025th: the device's graphs are dropped first
        c.graph_recompute(0, uid=5000)
        assert_closes(c, Command.GRAPH_RECOMPUTE, {"device": 0, "uid": 1})


def test_bf16_rounding_is_to_nearest_even() -> None:
    x = np.array([1.0, 1.00390625, 1.01171875, -2.5, np.inf], np.float32)  # halfway cases round to even
    assert bf16_to_f32(bf16_bits(x)).tolist() == [1.0, 1.0, 1.015625, -2.5, np.inf]
    assert np.isnan(bf16_to_f32(bf16_bits(np.array([np.nan], np.float32))))[0]


@pytest.mark.parametrize("n", [64, BF16_FROM_ELEMENTS])
def test_two_reference_servers_sum_a_tensor_over_their_link(n) -> None:
    with running_server("8") as s0, running_server("8") as s1:
        rng = np.random.default_rng(n)
        mine = [rng.standard_normal(n).astype(np.float32) for _ in range(2)]
        port = s0.port + 1000
        clients = [connect(s) for s in (s0, s1)]
        tensors = []
        for c, values in zip(clients, mine, strict=True):
            t = _f32(c, n)
            c.set_tensor(t, 0, values.tobytes())
            tensors.append(t)
        ok: list[bool] = [False, False]

        def init(rank: int) -> None:
            ok[rank] = clients[rank].comm_init(0, rank, 2, port, "127.0.0.1")

        threads = [threading.Thread(target=init, args=(r,)) for r in (0, 1)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(TIMEOUT)
        assert ok == [True, True]
        for c, t in zip(clients, tensors, strict=True):
            c.comm_allreduce(0, t)  # no reply: both servers sum once they have each other's copy
        sums = [np.frombuffer(bytes(c.get_tensor(t, 0, 4 * n)), np.float32) for c, t in zip(clients, tensors,
                                                                                          strict=True)]
        if n < BF16_FROM_ELEMENTS:
            assert sums[0].tolist() == sums[1].tolist() == (mine[0] + mine[1]).tolist()
        else:  # each adds the other's copy rounded to BF16
            for rank in (0, 1):
                other = bf16_to_f32(bf16_bits(mine[1 - rank]))
                assert sums[rank].tolist() == (mine[rank] + other).tolist()
        for c in clients:
            c.comm_free(0)
            c.close()


def test_comm_init_refuses_other_world_sizes_and_foreign_hosts(srv8) -> None:
    with connect(srv8) as c:
        assert c.comm_init(0, 0, 3, 40000) is False
        assert c.comm_init(0, 1, 2, 40000, "192.0.2.1") is False  # documentation range: never contacted
        t = tensor_in(c, 64)[0]
        assert_closes(c, Command.COMM_ALLREDUCE, {"device": 0, "tensor": t})  # no communicator
    assert_served(srv8)


def test_a_missing_peer_makes_comm_init_answer_zero() -> None:
    from dataclasses import replace

    from ggml_rpc.reference.server import Server, make_config

    server = Server(replace(make_config("8"), comm_timeout=0.3), "127.0.0.1", 0)
    runner = threading.Thread(target=server.serve_forever, daemon=True)
    runner.start()
    try:
        from ggml_rpc.conformance.client import RpcClient

        with RpcClient.connect("127.0.0.1", server.port) as c:
            assert c.comm_init(0, 0, 2, server.port + 1000) is False
            assert c.device_count() == 1  # the connection goes on
    finally:
        server.stop()
        runner.join(5)
