"""Float32 conversions of weights kept between runs of a graph must never outlive the weights' bytes.

The plan of a stored graph keeps the float32 values of a non-F32 MUL_MAT weight it converted; every way a client
can change those bytes (SET_TENSOR, a SET_TENSOR_HASH hit, MEMSET_TENSOR, BUFFER_CLEAR, COPY_TENSOR, a node of this
or of another graph writing there) must make the next run convert them again, and a node of the graph writing them
must make the next product of the same run convert them again.  Each test changes the weights, runs the graph (again)
and compares with the product of the bytes the server held when the product ran.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
from ggml_rpc.conformance.client import RpcClient
from ggml_rpc.reference import running_server
from ggml_rpc.spec import GgmlOp, GgmlType, TensorFlag, fnv1a64, make_tensor
from refhelpers import connect

F16 = int(GgmlType.F16)
K, M = 32, 8
W_BYTES = 2 * K * M


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    with running_server("7", devices=2, cache_dir=str(tmp_path_factory.mktemp("cache"))) as s:
        yield s


class Setup:
    """F16 weights W [K, M] in a buffer of their own, a second F16 matrix W2 in another (so writing W2 leaves W's
    buffer untouched), x and W @ x in a third."""

    def __init__(self, c: RpcClient) -> None:
        self.c = c
        wh, _ = c.alloc_buffer(0, W_BYTES)
        wbase = c.buffer_get_base(wh)
        w2h, _ = c.alloc_buffer(0, W_BYTES)
        ah, _ = c.alloc_buffer(0, 4096)
        abase = c.buffer_get_base(ah)
        self.wh = wh
        self.w = make_tensor(id=1, type=F16, ne=(K, M), buffer=wh, data=wbase)
        self.w2 = make_tensor(id=5, type=F16, ne=(K, M), buffer=w2h, data=c.buffer_get_base(w2h))
        self.x = make_tensor(id=2, ne=(K, 1), buffer=ah, data=abase)
        self.out = make_tensor(id=3, ne=(M, 1), buffer=ah, data=abase + 1024, op=int(GgmlOp.MUL_MAT), src=[1, 2],
                               flags=int(TensorFlag.COMPUTE))
        self.xs = np.linspace(-1, 1, K).astype(np.float16).astype(np.float32)  # exact in F16 (the vec-dot type)
        c.set_tensor(self.x, 0, self.xs.tobytes())

    def set_weights(self, values: np.ndarray) -> None:
        self.c.set_tensor(self.w, 0, values.astype(np.float16).tobytes())

    def compute(self, device: int = 0) -> None:
        self.c.graph_compute(device, [3], [self.w, self.x, self.out])

    def check(self) -> None:
        """The stored result is the product of the weight bytes the server holds now."""
        w = np.frombuffer(bytes(self.c.get_tensor(self.w, 0, W_BYTES)), np.float16).astype(np.float64)
        want = w.reshape(M, K) @ self.xs.astype(np.float64)
        got = np.frombuffer(bytes(self.c.get_tensor(self.out, 0, 4 * M)), np.float32)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _weights(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((M, K)).astype(np.float32)


def _set(s: Setup) -> None:
    s.set_weights(_weights(2))


def _memset(s: Setup) -> None:
    s.c.memset_tensor(s.w, 16, 64, 0x3C)


def _clear(s: Setup) -> None:
    s.c.buffer_clear(s.wh, 0x3B)


def _copy(s: Setup) -> None:
    s.c.set_tensor(s.w2, 0, _weights(3).astype(np.float16).tobytes())
    assert s.c.copy_tensor(s.w2, s.w)


def _hash_hit(s: Setup) -> None:
    data = _weights(4).astype(np.float16).tobytes()
    s.c.set_tensor(s.w2, 0, data, cache_flag=1)  # v7: a flagged SET_TENSOR saves the entry
    assert s.c.set_tensor_hash(s.w, 0, fnv1a64(data))


def _other_graph(s: Setup) -> None:
    # A graph on device 1 copies w2 over w: it runs there and is stored for device 1; device 0's plan stays.
    s.c.set_tensor(s.w2, 0, _weights(5).astype(np.float16).tobytes())
    cpy = make_tensor(id=6, type=F16, ne=(K, M), nb=tuple(s.w["nb"]), buffer=s.w["buffer"], data=s.w["data"],
                      op=int(GgmlOp.CPY), src=[5, 1], view_src=1, flags=int(TensorFlag.COMPUTE))
    s.c.graph_compute(1, [6], [s.w2, s.w, cpy])


WRITES: dict[str, Callable[[Setup], None]] = {
    "SET_TENSOR": _set, "MEMSET_TENSOR": _memset, "BUFFER_CLEAR": _clear, "COPY_TENSOR": _copy,
    "SET_TENSOR_HASH hit": _hash_hit, "a graph on another device": _other_graph,
}


@pytest.mark.parametrize("how", list(WRITES))
def test_recompute_after_the_weights_change(srv: object, how: str) -> None:
    with connect(srv) as c:
        s = Setup(c)
        s.set_weights(_weights(1))
        s.compute()
        s.check()
        c.graph_recompute(0)  # the conversion is now kept
        s.check()
        WRITES[how](s)
        c.graph_recompute(0)
        s.check()


def test_the_same_graph_sent_again_after_a_write(srv: object) -> None:
    with connect(srv) as c:
        s = Setup(c)
        s.set_weights(_weights(1))
        s.compute()
        s.compute()
        _copy(s)
        s.compute()  # the same payload: the stored graph and its plan are reused
        s.check()


def test_a_node_of_the_graph_itself_writing_the_weights(srv: object) -> None:
    # w = w2 (CPY), then out = w @ x, in one graph: the conversion of w may not be kept across runs.
    with connect(srv) as c:
        s = Setup(c)
        cpy = make_tensor(id=6, type=F16, ne=(K, M), nb=tuple(s.w["nb"]), buffer=s.w["buffer"], data=s.w["data"],
                          op=int(GgmlOp.CPY), src=[5, 1], view_src=1, flags=int(TensorFlag.COMPUTE))
        out = dict(s.out, src=[6, 2] + [0] * 8)
        for seed in (7, 8):
            c.set_tensor(s.w2, 0, _weights(seed).astype(np.float16).tobytes())
            if seed == 7:
                c.graph_compute(0, [6, 3], [s.w2, s.w, cpy, s.x, out])
            else:
                c.graph_recompute(0)
            s.check()


def test_a_weight_written_between_two_products_of_one_run(srv: object) -> None:
    # out1 = w @ x, then w = w2 (CPY), then out2 = w @ x, all in one run: the second product must see the new
    # weights.  The buffer's write epoch only moves after a run, so within the run only the rule "a buffer the
    # graph's own nodes write is never kept" stops the second MUL_MAT from taking the conversion the first one made.
    with connect(srv) as c:
        s = Setup(c)
        cpy = make_tensor(id=6, type=F16, ne=(K, M), nb=tuple(s.w["nb"]), buffer=s.w["buffer"], data=s.w["data"],
                          op=int(GgmlOp.CPY), src=[5, 1], view_src=1, flags=int(TensorFlag.COMPUTE))
        out2 = dict(s.out, id=7, data=s.out["data"] + 1024, src=[6, 2] + [0] * 8)
        for seed in (11, 12):
            old, new = _weights(seed), _weights(seed + 100)
            s.set_weights(old)
            c.set_tensor(s.w2, 0, new.astype(np.float16).tobytes())
            if seed == 11:
                c.graph_compute(0, [3, 6, 7], [s.w, s.x, s.out, s.w2, cpy, out2])
            else:
                c.graph_recompute(0)
            for weights, tensor in ((old, s.out), (new, out2)):
                want = weights.astype(np.float16).astype(np.float64) @ s.xs.astype(np.float64)
                got = np.frombuffer(bytes(c.get_tensor(tensor, 0, 4 * M)), np.float32)
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
            assert bytes(c.get_tensor(s.w, 0, W_BYTES)) == new.astype(np.float16).tobytes()  # the CPY ran
