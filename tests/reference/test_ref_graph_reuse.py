"""What the server keeps of a computed graph: its prepared plan (GRAPH_RECOMPUTE only runs kernels) and its payload
(the same GRAPH_COMPUTE sent again reuses the graph).  Both must see new data, and both must go the moment a
rebuild could differ: a FREE_BUFFER of a buffer the graph uses, a handle the graph named unknown becoming a buffer.
"""

from __future__ import annotations

import numpy as np
import pytest
from ggml_rpc.reference import running_server
from ggml_rpc.reference.devices import BufferTable
from ggml_rpc.spec import GgmlOp, make_tensor
from refhelpers import TIMEOUT, assert_served, connect, tensor_in

ADD = {"op": int(GgmlOp.ADD), "flags": 16}


@pytest.fixture(scope="module")
def srv7():
    with running_server("7") as s:
        yield s


@pytest.fixture(scope="module")
def recording():
    """A v7 server whose executor records the node lists it is given (the same list object = the same graph)."""
    runs: list = []
    with running_server("7", executor=lambda nodes: runs.append(nodes)) as s:
        s.runs = runs
        yield s


def _chain(c, n: int = 20, width: int = 8):
    """x, one and x + 1 + 1 + ... (n ADDs) in one buffer: (tensors, node ids, x, result)."""
    size = 4 * width
    handle, _ = c.alloc_buffer(0, (n + 2) * size)
    base = c.buffer_get_base(handle)
    x = make_tensor(id=1, ne=(width,), buffer=handle, data=base)
    one = make_tensor(id=2, ne=(width,), buffer=handle, data=base + size)
    tensors, prev = [x, one], 1
    for i in range(n):
        tensors.append(make_tensor(id=3 + i, ne=(width,), buffer=handle, data=base + (2 + i) * size,
                                   src=[prev, 2], **ADD))
        prev = 3 + i
    c.set_tensor(one, 0, np.ones(width, np.float32).tobytes())
    return tensors, list(range(3, 3 + n)), x, tensors[-1], handle


def _read(c, t) -> list[float]:
    return np.frombuffer(bytes(c.get_tensor(t, 0, 32)), dtype=np.float32).tolist()


def test_recompute_sees_inputs_set_after_the_compute(srv7) -> None:
    with connect(srv7) as c:
        tensors, nodes, x, out, _h = _chain(c)
        c.set_tensor(x, 0, np.zeros(8, np.float32).tobytes())
        c.graph_compute(0, nodes, tensors)
        assert _read(c, out) == [20.0] * 8
        for value in (5.0, -100.0):
            c.set_tensor(x, 0, np.full(8, value, np.float32).tobytes())
            c.graph_recompute(0)
            assert _read(c, out) == [value + 20] * 8


def test_the_same_compute_sent_again_sees_new_inputs(srv7) -> None:
    with connect(srv7) as c:
        tensors, nodes, x, out, _h = _chain(c)
        for value in (0.0, 7.0, 7.0, -1.5):
            c.set_tensor(x, 0, np.full(8, value, np.float32).tobytes())
            c.graph_compute(0, nodes, tensors)
            assert _read(c, out) == [value + 20] * 8


def test_a_different_compute_replaces_the_stored_graph(srv7) -> None:
    with connect(srv7) as c:
        tensors, nodes, x, out, _h = _chain(c)
        c.set_tensor(x, 0, np.zeros(8, np.float32).tobytes())
        c.graph_compute(0, nodes, tensors)
        c.graph_compute(0, nodes[:5], tensors[:7])  # only the first five ADDs
        c.set_tensor(x, 0, np.full(8, 10.0, np.float32).tobytes())
        c.graph_recompute(0)
        assert _read(c, tensors[6]) == [15.0] * 8
        assert _read(c, out) == [20.0] * 8  # left from the first graph's run, not computed again


def test_the_same_payload_reuses_the_graph_and_another_rebuilds_it(recording) -> None:
    runs = recording.runs
    with connect(recording) as c:
        tensors, nodes, _x, _out, _h = _chain(c)
        c.graph_compute(0, nodes, tensors)
        c.graph_compute(0, nodes, tensors)
        assert c.device_count() == 1
        assert runs[-1] is runs[-2]
        renamed = [dict(t) for t in tensors]
        renamed[0]["name"] = b"x"  # one byte differs: a new graph
        c.graph_compute(0, nodes, renamed)
        assert c.device_count() == 1
        assert runs[-1] is not runs[-2] and [t.id for t in runs[-1]] == nodes


def test_a_payload_of_mostly_unreached_tensors_is_not_kept(recording) -> None:
    runs = recording.runs
    with connect(recording) as c:
        tensors, nodes, _x, _out, _h = _chain(c)
        spare = [make_tensor(id=1000 + i, ne=(8,)) for i in range(3 * len(tensors))]  # never reached
        for _ in range(2):
            c.graph_compute(0, nodes, tensors + spare)
        assert c.device_count() == 1
        assert runs[-1] is not runs[-2]  # rebuilt: nothing of the first payload was kept
        c.graph_compute(0, nodes, tensors + spare[: len(tensors) // 2])
        c.graph_compute(0, nodes, tensors + spare[: len(tensors) // 2])
        assert c.device_count() == 1
        assert runs[-1] is runs[-2]


def test_recompute_and_the_same_compute_after_free_buffer_close(srv7) -> None:
    for again in ("recompute", "compute"):
        with connect(srv7) as c:
            tensors, nodes, _x, _out, handle = _chain(c)
            c.graph_compute(0, nodes, tensors)
            c.graph_recompute(0)
            assert c.device_count() == 1
            c.free_buffer(handle)
            if again == "recompute":
                c.graph_recompute(0)  # no stored graph any more
            else:
                c.graph_compute(0, nodes, tensors)  # rebuilt: its tensors name a buffer that is gone
            assert c.expect_closed(TIMEOUT)
    assert_served(srv7)


def test_the_same_compute_is_rebuilt_once_a_handle_it_named_exists(recording, monkeypatch) -> None:
    ghost = 0x5150_5150_5150
    with connect(recording) as c:
        a, h, base = tensor_in(c, 64, ne=(8,), id=1)
        # Tensor 2 names a handle that is no buffer: built as a tensor without memory (data 0 is allowed).
        b = make_tensor(id=2, ne=(8,), buffer=ghost, data=0)
        out = make_tensor(id=3, ne=(8,), buffer=h, data=base + 32, src=[1, 2], **ADD)
        c.graph_compute(0, [3], [a, b, out])
        assert c.device_count() == 1
        monkeypatch.setattr(BufferTable, "_new_handle", lambda self: ghost)
        assert c.alloc_buffer(0, 64)[0] == ghost
        monkeypatch.undo()
        # The same bytes now describe data 0 inside a real buffer at a non-zero base: outside it, refused.
        c.graph_compute(0, [3], [a, b, out])
        assert c.expect_closed(TIMEOUT)
    assert_served(recording)


def test_a_graph_of_the_same_size_but_other_bytes_is_rebuilt(srv7) -> None:
    # The payload is received into a buffer the connection reuses: the stored graph's own copy must be compared
    # with the new bytes, never the receive buffer with itself.
    with connect(srv7) as c:
        tensors, nodes, x, out, _h = _chain(c)
        c.set_tensor(x, 0, np.zeros(8, np.float32).tobytes())
        subs = [dict(t, op=int(GgmlOp.SUB)) if t["op"] else t for t in tensors]
        for graph, want in ((tensors, 20.0), (subs, -20.0), (tensors, 20.0), (tensors, 20.0), (subs, -20.0)):
            c.graph_compute(0, nodes, graph)
            assert _read(c, out) == [want] * 8
