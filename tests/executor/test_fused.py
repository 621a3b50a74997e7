"""Runs of float32 ADD/SUB/MUL/DIV nodes computed by one compiled call (:mod:`.fused`) give the very bits of the
separate numpy calls, in place, with a broadcast row, with zeros, infinities and NaN; operands that overlap the
result in any other way stay separate numpy calls (which copy them first)."""

from __future__ import annotations

import numpy as np
import pytest
from ggml_rpc.reference.executor import fused, prepare
from ggml_rpc.reference.executor.arena import Arena
from ggml_rpc.spec import GgmlOp, GgmlType

F32 = int(GgmlType.F32)
OPS = [GgmlOp.ADD, GgmlOp.SUB, GgmlOp.MUL, GgmlOp.DIV]


def _random_graph(seed: int) -> tuple[Arena, list, list]:
    r = np.random.default_rng(seed)
    arena = Arena(1 << 18)
    ne = (int(r.integers(1, 9)), int(r.integers(1, 4)), int(r.integers(1, 3)))
    inputs = [arena.tensor(F32, ne) for _ in range(3)]
    rows = [arena.tensor(F32, (ne[0],)) for _ in range(2)]
    for t in inputs + rows:
        n = int(np.prod(t.ne))
        v = (r.standard_normal(n) * 10.0 ** r.integers(-3, 4, n)).astype(np.float32)
        v[r.random(n) < 0.1] = 0.0
        v[r.random(n) < 0.03] = np.inf
        v[r.random(n) < 0.03] = np.nan
        arena.set(t, v.reshape(arena.get(t).shape))
    nodes, pool = [], list(inputs)
    for _ in range(int(r.integers(10, 40))):
        op = OPS[int(r.integers(0, 4))]
        a = pool[int(r.integers(0, len(pool)))]
        b = rows[int(r.integers(0, 2))] if r.random() < 0.3 else pool[int(r.integers(0, len(pool)))]
        if r.random() < 0.2:  # in place: the result is source 0's own memory
            out = arena.view_of(a, ne, a.nb, op=op)
            out.src[1] = b
        else:
            out = arena.tensor(F32, ne, op=op, src=(a, b))
        nodes.append(out)
        pool.append(out)
    return arena, nodes, inputs + rows


@pytest.mark.parametrize("seed", range(30))
def test_a_fused_run_gives_the_bits_of_separate_numpy_calls(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    results = []
    for min_run in (2, 10**9):
        monkeypatch.setattr(fused, "MIN_RUN", min_run)
        arena, nodes, _ = _random_graph(seed)
        plan = prepare(nodes)
        assert ("fused" in plan.kinds) == (min_run == 2)
        with np.errstate(all="ignore"):
            plan.run()
            plan.run()  # again: in-place nodes go on from the first run's results, as the separate calls do
        values = np.concatenate([arena.get(n).ravel() for n in nodes])
        # Which of two NaN operands comes through (the sign of a NaN) is the order the compiler gives the
        # instruction's operands, which neither numpy's loops nor ggml's fix: a NaN is compared as a NaN.
        values[np.isnan(values)] = np.nan
        results.append(values.tobytes())
    assert results[0] == results[1]


def test_a_result_overlapping_its_source_is_left_to_numpy() -> None:
    arena = Arena(1 << 12)
    base = arena.tensor(F32, (17,))
    arena.set(base, 0.0)
    one = arena.tensor(F32, (16,))
    arena.set(one, 1.0)
    nb = (4, 64, 64, 64)
    src = arena.view_of(base, (16,), nb, 0)
    nodes = []
    for _ in range(fused.MIN_RUN):
        # The result is the source shifted by one value: numpy reads the source before writing, a loop would not.
        node = arena.view_of(base, (16,), nb, 4, op=GgmlOp.ADD)
        node.src[0], node.src[1] = src, one
        nodes.append(node)
    plan = prepare(nodes)
    assert "fused" not in plan.kinds
    plan.run()
    want = np.zeros(17, dtype=np.float32)
    for _ in range(fused.MIN_RUN):
        want[1:] = want[:16] + 1  # the source read whole before the result is written
    assert arena.get(base).ravel().tolist() == want.tolist()
    assert want[-1] == fused.MIN_RUN  # a loop reading values it has just written would give 0, 1, 2, ..., 16
