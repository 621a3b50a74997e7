"""Prepared plans (``prepare(nodes).run()``): run again and again, they see new data, re-check everything that
depends on data, fail at the same node with the same message as a single run, and keep nothing from one run to
the next.
"""

from __future__ import annotations

import numpy as np
import pytest
from ggml_rpc.reference.executor import execute, prepare
from ggml_rpc.reference.executor.arena import Arena, params
from ggml_rpc.reference.executor.core import KERNELS, PREPARED
from ggml_rpc.reference.executor.memory import Memory, buffer_key
from ggml_rpc.reference.graph import ExecutorError
from ggml_rpc.spec import GgmlOp, GgmlType, UnaryOp

F32, F16, I32 = int(GgmlType.F32), int(GgmlType.F16), int(GgmlType.I32)


@pytest.fixture
def arena() -> Arena:
    return Arena(1 << 16)


def test_a_plan_run_again_sees_new_inputs(arena):
    x = arena.tensor(F32, (4, 2))
    c = arena.tensor(F32, (4, 2))
    s = arena.tensor(F32, (4, 2), op=GgmlOp.ADD, src=(x, c))  # prepared: one ufunc call
    out = arena.tensor(F32, (4, 2), op=GgmlOp.SCALE, src=(s,), params=params(2.0))  # a kernel
    plan = prepare([s, out])
    arena.set(c, 1.0)
    for value in (0.0, 5.0, -3.0):
        arena.set(x, value)  # what a SET_TENSOR between two GRAPH_RECOMPUTEs does
        plan.run()
        assert arena.get(out).ravel().tolist() == [2 * (value + 1)] * 8


def test_a_chain_of_prepared_adds_runs_in_order(arena):
    x = arena.tensor(F32, (16,))
    one = arena.tensor(F32, (16,))
    arena.set(x, 0.0)
    arena.set(one, 1.0)
    nodes, prev = [], x
    for _ in range(50):
        prev = arena.tensor(F32, (16,), op=GgmlOp.ADD, src=(prev, one))
        nodes.append(prev)
    plan = prepare(nodes)
    assert plan.kinds == ["fused"]  # no kernel call: one compiled run of the 50 ADDs
    plan.run()
    assert arena.get(prev).ravel().tolist() == [50.0] * 16
    arena.set(x, 100.0)
    plan.run()
    assert arena.get(prev).ravel().tolist() == [150.0] * 16


BINARY = [GgmlOp.ADD, GgmlOp.SUB, GgmlOp.MUL, GgmlOp.DIV]


@pytest.mark.parametrize("op", BINARY)
@pytest.mark.parametrize("b_ne", [(6, 3, 2), (6, 1, 2), (1, 3, 1), (1, 1, 1), (3, 3, 2), (6, 3, 1)])
def test_prepared_binary_ops_agree_with_their_kernels(arena, op, b_ne):
    rng = np.random.default_rng(int(op))
    a = arena.tensor(F32, (6, 3, 2))
    b = arena.tensor(F32, b_ne)
    arena.set(a, rng.uniform(1, 2, (1, 2, 3, 6)).astype(np.float32))
    arena.set(b, rng.uniform(1, 2, (1, *reversed(b_ne))).astype(np.float32))
    out = arena.tensor(F32, (6, 3, 2), op=op, src=(a, b))
    KERNELS[int(op)](out, Memory())
    want = arena.get(out)
    arena.set(out, 0.0)
    prepare([out]).run()
    np.testing.assert_array_equal(arena.get(out), want)
    prepared = PREPARED[int(op)](out, Memory())
    # (3, 3, 2) repeats source 1 twice along dim 0: a copy, so the kernel keeps that case.
    assert (prepared is None) == (b_ne == (3, 3, 2))


@pytest.mark.parametrize("op", BINARY)
def test_prepared_binary_in_place_and_mixed_types_agree_with_their_kernels(arena, op):
    a = arena.tensor(F32, (8,))
    arena.set(a, np.arange(1, 9, dtype=np.float32))
    inplace = arena.view_of(a, (8,), a.nb, op=op)
    inplace.src[:2] = [a, a]
    inplace.flags = 16
    prepare([inplace]).run()
    x = np.arange(1, 9, dtype=np.float32)
    want = {GgmlOp.ADD: x + x, GgmlOp.SUB: x - x, GgmlOp.MUL: x * x, GgmlOp.DIV: x / x}[op]
    np.testing.assert_array_equal(arena.get(a).ravel(), want)
    h = arena.tensor(F16, (8,))
    arena.set(h, 2.0)
    mixed = arena.tensor(F32, (8,), op=op, src=(a, h))  # not all F32: the kernel converts
    assert PREPARED[int(op)](mixed, Memory()) is None
    prepare([mixed]).run()
    two = np.float32(2)
    expect = {GgmlOp.ADD: want + two, GgmlOp.SUB: want - two, GgmlOp.MUL: want * two, GgmlOp.DIV: want / two}[op]
    np.testing.assert_array_equal(arena.get(mixed).ravel(), expect)


@pytest.mark.parametrize("sub", [UnaryOp.NEG, UnaryOp.ABS, UnaryOp.TANH, UnaryOp.EXP, UnaryOp.GELU, UnaryOp.SILU])
def test_prepared_unary_agrees_with_its_kernel(arena, sub):
    a = arena.tensor(F32, (5, 3))
    arena.set(a, np.linspace(-3, 3, 15, dtype=np.float32).reshape(1, 1, 3, 5))
    out = arena.tensor(F32, (5, 3), op=GgmlOp.UNARY, src=(a,), params=params(int(sub)))
    KERNELS[int(GgmlOp.UNARY)](out, Memory())
    want = arena.get(out)
    arena.set(out, 0.0)
    prepare([out]).run()
    np.testing.assert_array_equal(arena.get(out), want)
    assert (PREPARED[int(GgmlOp.UNARY)](out, Memory()) is None) == (sub in (UnaryOp.GELU, UnaryOp.SILU))


def _rms_norm_loop(x: np.ndarray, eps: float) -> np.ndarray:
    # ggml_compute_forward_rms_norm_f32 per row: sum += (ggml_float)(x * x) in order, mean = (float)(sum / n),
    # scale = 1.0f / sqrtf(mean + eps), y = x * scale.
    out = np.empty_like(x)
    for i in np.ndindex(x.shape[:-1]):
        total = 0.0
        for v in x[i]:
            total += float(np.float32(v * v))
        mean = np.float32(total / x.shape[-1])
        out[i] = x[i] * (np.float32(1) / np.sqrt(np.float32(mean + np.float32(eps))))
    return out


@pytest.mark.parametrize("shape", [(256,), (7, 3), (33, 2, 2)])
@pytest.mark.parametrize("in_place", [False, True])
def test_prepared_rms_norm_is_ggmls_loop_bit_for_bit(arena, shape, in_place):
    rng = np.random.default_rng(len(shape))
    a = arena.tensor(F32, shape)
    values = (rng.standard_normal(int(np.prod(shape))) * rng.choice([1e-3, 1.0, 1e3])).astype(np.float32)
    arena.set(a, values.reshape(arena.get(a).shape))
    if in_place:  # the result written over its source (ggml_rms_norm_inplace)
        node = arena.view_of(a, shape, a.nb, op=int(GgmlOp.RMS_NORM))
        node.op_params[0] = params(1e-6)[0]
    else:
        node = arena.tensor(F32, shape, op=GgmlOp.RMS_NORM, src=(a,), params=params(1e-6))
    want = _rms_norm_loop(values.reshape(arena.get(a).shape), 1e-6)
    plan = prepare([node])
    assert plan.kinds == ["prepared"]
    plan.run()
    assert arena.get(node).tobytes() == want.tobytes()
    arena.set(a, values.reshape(arena.get(a).shape))
    KERNELS[int(GgmlOp.RMS_NORM)](node, Memory())  # the kernel (any layout) computes the same
    assert arena.get(node).tobytes() == want.tobytes()


def test_a_prepared_rope_reads_new_positions_on_every_run(arena):
    a = arena.tensor(F32, (8, 2, 3))
    arena.set(a, np.linspace(-2, 2, 48, dtype=np.float32).reshape(1, 3, 2, 8))
    pos = arena.tensor(I32, (3,))
    node = arena.tensor(F32, (8, 2, 3), op=GgmlOp.ROPE, src=(a, pos),
                        params=params(0, 8, 2, 0, 64, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0))
    plan = prepare([node])
    assert plan.kinds == ["prepared"]
    for start in (0, 7, 1000):
        arena.set_raw(pos, np.arange(start, start + 3, dtype=np.int32))
        plan.run()
        got = arena.get(node).copy()
        KERNELS[int(GgmlOp.ROPE)](node, Memory())
        assert arena.get(node).tobytes() == got.tobytes()


@pytest.mark.parametrize("extras", [False, True])
def test_a_prepared_decoding_attention_is_its_kernel_run_after_run(extras):
    arena = Arena(1 << 18)
    rng = np.random.default_rng(3)
    q = arena.tensor(F32, (64, 1, 4))
    k = arena.tensor(F16, (64, 32, 2))
    v = arena.tensor(F16, (64, 32, 2))
    srcs = [q, k, v]
    if extras:  # an F16 mask hiding some positions, and sinks
        mask = arena.tensor(F16, (32, 1))
        sinks = arena.tensor(F32, (4,))
        srcs += [mask, sinks]
    node = arena.tensor(F32, (64, 4, 1), op=GgmlOp.FLASH_ATTN_EXT, src=tuple(srcs), params=params(0.125, 0.0, 0.0))
    plan = prepare([node])
    assert plan.kinds == ["prepared"]
    for _ in range(3):  # new queries, cache, mask and sinks each run, as a decoding step brings
        for t in (q, k, v):
            arena.set(t, rng.standard_normal(arena.get(t).shape).astype(np.float32))
        if extras:
            arena.set(mask, np.where(rng.random((1, 1, 1, 32)) < 0.3, -np.inf, 0.0).astype(np.float32))
            arena.set(sinks, rng.standard_normal((1, 1, 1, 4)).astype(np.float32))
        plan.run()
        got = arena.get(node).copy()
        KERNELS[int(GgmlOp.FLASH_ATTN_EXT)](node, Memory())
        assert arena.get(node).tobytes() == got.tobytes()


@pytest.mark.parametrize("wtype", [GgmlType.Q8_0, GgmlType.Q4_1, GgmlType.IQ4_NL, GgmlType.MXFP4])
def test_a_prepared_one_token_product_is_its_kernel_run_after_run(wtype):
    arena, weights = Arena(1 << 16), Arena(1 << 16)  # weights in a buffer no node writes: their packed form is kept
    rng = np.random.default_rng(int(wtype))
    w = weights.tensor(int(wtype), (96, 12))
    x = arena.tensor(F32, (96, 1))
    node = arena.tensor(F32, (12, 1), op=GgmlOp.MUL_MAT, src=(w, x))
    plan = prepare([node])
    assert plan.kinds == ["prepared"]
    for run in range(3):  # new activations each run, new weights at the last (the packed form is redone)
        if run in (0, 2):
            weights.set(w, rng.standard_normal((1, 1, 12, 96)).astype(np.float32))
        arena.set(x, (rng.standard_normal((1, 1, 1, 96)) * 3).astype(np.float32))
        plan.run(epochs={buffer_key(w.buffer): int(run == 2)})  # the weights' write epoch: kept, then new
        got = arena.get(node).copy()
        KERNELS[int(GgmlOp.MUL_MAT)](node, Memory())
        assert arena.get(node).tobytes() == got.tobytes()


def test_data_dependent_checks_run_on_every_run(arena):
    src = arena.tensor(F32, (4, 5))
    arena.set(src, np.arange(20, dtype=np.float32).reshape(1, 1, 5, 4))
    idx = arena.tensor(I32, (2,))
    arena.set_raw(idx, np.array([1, 4], np.int32))
    out = arena.tensor(F32, (4, 2), op=GgmlOp.GET_ROWS, src=(src, idx))
    plan = prepare([out])
    plan.run()
    assert arena.get(out)[0, 0, :, 0].tolist() == [4.0, 16.0]
    arena.set_raw(idx, np.array([1, 5], np.int32))  # now out of range: refused before any write
    arena.set(out, 7.0)
    with pytest.raises(ExecutorError, match=r"GET_ROWS: row index value 5 is outside \[0, 5\)"):
        plan.run()
    assert np.all(arena.get(out) == 7.0)


def _failing_graph(arena, kind):
    a = arena.tensor(F32, (4,))
    arena.set(a, 1.0)
    first = arena.tensor(F32, (4,), op=GgmlOp.ADD, src=(a, a))
    if kind == "unsupported":
        bad = arena.tensor(F32, (4,), op=GgmlOp.SSM_SCAN, src=(a,), name="scan")
    elif kind == "callback":
        bad = arena.tensor(F32, (4,), op=GgmlOp.MAP_CUSTOM1, params=params(0x41414141))
        bad.flags = 0
    elif kind == "outside":
        bad = arena.tensor(F32, (4,), op=GgmlOp.ADD, src=(a, a), name="far")
        bad.offset = arena.memory.size - 8  # 16 bytes from 8 before the end
    else:  # a shape rule the kernel checks
        b = arena.tensor(F32, (3,))
        bad = arena.tensor(F32, (4,), op=GgmlOp.ADD, src=(a, b))
    last = arena.tensor(F32, (4,), op=GgmlOp.ADD, src=(first, first))
    return [first, bad, last], first, last


@pytest.mark.parametrize("kind", ["unsupported", "callback", "outside", "shape"])
def test_a_plan_fails_where_a_single_run_fails_after_the_same_writes(kind):
    messages = []
    for runner in (execute, lambda nodes: prepare(nodes).run()):
        arena = Arena(1 << 12)
        nodes, first, last = _failing_graph(arena, kind)
        plan_or_none = prepare(nodes)  # preparing never refuses: the refusal waits for the node's turn
        assert len(plan_or_none.steps) == 3
        with pytest.raises(ExecutorError) as info:
            runner(nodes)
        messages.append(str(info.value))
        assert arena.get(first).ravel().tolist() == [2.0] * 4  # the node before ran
        assert arena.get(last).ravel().tolist() == [0.0] * 4  # the node after did not
    assert messages[0] == messages[1]


def test_views_a_kernel_makes_during_a_run_do_not_pile_up(arena):
    experts = arena.tensor(F32, (8, 4, 3))
    arena.set(experts, 0.5)
    b = arena.tensor(F32, (8, 1, 2))
    arena.set(b, 1.0)
    ids = arena.tensor(I32, (2, 2))
    arena.set_raw(ids, np.array([[[[2, 0], [1, 1]]]], np.int32))
    out = arena.tensor(F32, (4, 2, 2), op=GgmlOp.MUL_MAT_ID, src=(experts, b, ids))
    plan = prepare([out])
    kept = len(plan._memory._views)
    for _ in range(5):
        plan.run()  # each run views the experts it uses through tensors of its own
    assert len(plan._memory._views) == kept
    assert np.allclose(arena.get(out), 4.0)
