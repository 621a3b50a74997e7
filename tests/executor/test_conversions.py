"""Weight conversions kept across runs and plans: reused only while the weight's buffer is unwritten, dropped with
the buffer, bounded by their budget."""

from __future__ import annotations

import gc

import numpy as np
from ggml_rpc.reference.executor.arena import Arena
from ggml_rpc.reference.executor.memory import CONVERSIONS, Conversions
from ggml_rpc.reference.executor.plan import prepare
from ggml_rpc.reference.executor.types import Q8_0, through_type
from ggml_rpc.spec import GgmlOp

F32 = 0


def _matmul(weights: Arena, compute: Arena, w_values: np.ndarray):
    w = weights.tensor(Q8_0, (64, 8), name="w")
    weights.set(w, w_values)
    x = compute.tensor(F32, (64, 1), name="x")
    compute.set(x, np.linspace(-1, 1, 64, dtype=np.float32))
    out = compute.tensor(F32, (8, 1), op=GgmlOp.MUL_MAT, src=(w, x), name="out")
    return w, x, out


def _expected(weights: Arena, compute: Arena, w, x) -> np.ndarray:
    xs = through_type(Q8_0, compute.get(x).reshape(1, 64))
    return (weights.get(w).reshape(8, 64) @ xs.T).reshape(-1)


def test_a_new_plan_reuses_a_conversion_until_the_buffer_is_written() -> None:
    r = np.random.default_rng(3)
    weights, compute = Arena(1 << 14), Arena(1 << 14)
    w, x, out = _matmul(weights, compute, r.standard_normal((8, 64)).astype(np.float32))
    epochs = {id(weights.memory): 0, id(compute.memory): 0}
    prepare([out]).run(epochs)
    first = compute.get(out).reshape(-1)
    np.testing.assert_allclose(first, _expected(weights, compute, w, x), rtol=1e-6)
    held = [k for k in CONVERSIONS._entries if k[0] == id(weights.memory)]
    assert len(held) == 1

    # New bytes under an unchanged epoch: the server promises that cannot happen, so a second plan of the same
    # graph serving the first conversion shows the copy is shared between plans.
    weights.set(w, r.standard_normal((8, 64)).astype(np.float32))
    prepare([out]).run(epochs)
    assert compute.get(out).reshape(-1).tobytes() == first.tobytes()

    # A write bumps the epoch: the next run converts the new bytes.
    epochs[id(weights.memory)] = 1
    prepare([out]).run(epochs)
    np.testing.assert_allclose(compute.get(out).reshape(-1), _expected(weights, compute, w, x), rtol=1e-6)
    assert compute.get(out).reshape(-1).tobytes() != first.tobytes()

    # Freeing the buffer (its last reference) drops its conversions.
    owner = id(weights.memory)
    del weights, w, x, out, epochs
    gc.collect()
    assert not [k for k in CONVERSIONS._entries if k[0] == owner]


def test_without_epochs_nothing_is_kept() -> None:
    weights, compute = Arena(1 << 14), Arena(1 << 14)
    _w, _x, out = _matmul(weights, compute, np.ones((8, 64), dtype=np.float32))
    prepare([out]).run()
    assert not [k for k in CONVERSIONS._entries if k[0] == id(weights.memory)]


def test_the_least_recently_used_copy_goes_first_and_the_budget_holds() -> None:
    cache = Conversions(budget=3 * 400)
    owners = [np.zeros(4) for _ in range(4)]
    keys = [(id(o), 8, 0, (1,), (1,)) for o in owners]
    for o, k in zip(owners[:3], keys[:3], strict=True):
        cache.put(o, k, 0, np.zeros(100, dtype=np.float32))
    assert cache.get(keys[0], 0) is not None  # touched: now the most recent
    assert cache.get(keys[0], 1) is None  # another epoch is another content
    cache.put(owners[3], keys[3], 0, np.zeros(100, dtype=np.float32))
    assert cache.get(keys[1], 0) is None and cache.get(keys[0], 0) is not None
    assert cache.nbytes <= cache.budget and len(cache) == 3
    cache.put(owners[0], keys[0], 0, np.zeros(10_000, dtype=np.float32))  # larger than the budget: not kept
    assert cache.nbytes <= cache.budget
    kept = cache.get(keys[2], 0)
    assert kept is not None and not kept.flags.writeable


def test_a_weight_the_graph_itself_rewrites_is_never_served_from_a_kept_conversion() -> None:
    # MUL_MAT(w) -> CPY into w -> MUL_MAT(w), in one graph: the second product must see the copied values.  The
    # buffer's epoch only changes between commands, so within the run only the plan's own list of the buffers its
    # nodes write (Memory.written) keeps the first conversion from being served again.
    r = np.random.default_rng(11)
    weights, compute = Arena(1 << 15), Arena(1 << 15)
    w, x, out1 = _matmul(weights, compute, r.standard_normal((8, 64)).astype(np.float32))
    fresh = compute.tensor(F32, (64, 8), name="fresh")
    compute.set(fresh, r.standard_normal((8, 64)).astype(np.float32))
    cpy = weights.view_of(w, w.ne, w.nb, op=int(GgmlOp.CPY), name="w (copied)")
    cpy.src[0], cpy.src[1] = fresh, w
    out2 = compute.tensor(F32, (8, 1), op=GgmlOp.MUL_MAT, src=(cpy, x), name="out2")
    epochs = {id(weights.memory): 0, id(compute.memory): 0}
    prepare([out1, cpy, out2]).run(epochs)
    second = compute.get(out2).reshape(-1)
    assert second.tobytes() != compute.get(out1).reshape(-1).tobytes()
    np.testing.assert_allclose(second, _expected(weights, compute, w, x), rtol=1e-6)
    # what the first product saw: the weights before the copy
    assert not np.allclose(compute.get(out1).reshape(-1), second)


def test_weights_the_cache_has_no_room_for_are_computed_from_their_blocks(monkeypatch) -> None:
    # Packing a weight that would push others out of the cache (a 7B model's layers, each graph) is not done: the
    # product reads the blocks as stored, with the same bits as from the kept packed form.
    from ggml_rpc.reference.executor import memory

    r = np.random.default_rng(5)
    weights, compute = Arena(1 << 14), Arena(1 << 14)
    _w, _x, out = _matmul(weights, compute, r.standard_normal((8, 64)).astype(np.float32))
    epochs = {id(weights.memory): 0, id(compute.memory): 0}
    prepare([out]).run(epochs)
    packed_result = compute.get(out).reshape(-1).tobytes()
    assert [k for k in CONVERSIONS._entries if k[0] == id(weights.memory)]

    from ggml_rpc.reference.executor import matmul

    small = Conversions(budget=8 * 64 // 32 * 40 - 1)  # one byte short of w's packed form
    monkeypatch.setattr(memory, "CONVERSIONS", small)
    packed = []
    monkeypatch.setattr(matmul, "pack_weights", lambda *a: packed.append(a))  # a packing here would be the bug
    compute.set(out, np.zeros((1, 8), dtype=np.float32))
    prepare([out]).run(epochs)
    assert not packed
    assert compute.get(out).reshape(-1).tobytes() == packed_result
    assert len(small) == 0 and small.room == small.budget


def test_a_rewritten_weight_takes_the_room_of_its_own_stale_packing() -> None:
    # The cache full of w's packing for epoch 0: after a write (epoch 1) that entry is no use to anyone, and its
    # bytes count as room for w's new packing instead of sending w to the raw-block path for good.
    from ggml_rpc.reference.executor import memory

    r = np.random.default_rng(6)
    weights, compute = Arena(1 << 14), Arena(1 << 14)
    w, _x, out = _matmul(weights, compute, r.standard_normal((8, 64)).astype(np.float32))
    cache = Conversions(budget=8 * 64 // 32 * 40)  # exactly one packing
    saved, memory.CONVERSIONS = memory.CONVERSIONS, cache
    try:
        epochs = {id(weights.memory): 0, id(compute.memory): 0}
        prepare([out]).run(epochs)
        assert len(cache) == 1 and cache.room == 0
        weights.set(w, r.standard_normal((8, 64)).astype(np.float32))
        epochs[id(weights.memory)] = 1
        prepare([out]).run(epochs)
        (key,) = cache._entries
        assert cache.get(key, 1) is not None  # packed again, for the new epoch
    finally:
        memory.CONVERSIONS = saved
