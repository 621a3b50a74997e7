"""Hostile kernel inputs: random shapes, strides, types, op_params and index values for every registered op.

Whatever a peer sends, the executor either computes or raises ExecutorError (never another exception), and the
only bytes that change are the bytes of the node being computed.
"""

from __future__ import annotations

import numpy as np
from ggml_rpc.reference.executor import execute
from ggml_rpc.reference.executor.core import KERNELS
from ggml_rpc.reference.executor.memory import extent
from ggml_rpc.reference.graph import ExecutorError, GraphTensor
from ggml_rpc.spec import TYPES, GgmlType, TensorFlag, op_name

TYPES_TRIED = [int(GgmlType[n]) for n in ("F32", "F16", "BF16", "I32", "I64", "Q8_0", "Q4_0", "Q4_K", "IQ4_NL")]
ARENA = 1 << 16


def random_tensor(rng: np.random.Generator, memory: memoryview, tid: int) -> GraphTensor:
    type_id = int(rng.choice(TYPES_TRIED))
    info = TYPES[type_id]
    ne = [int(rng.integers(1, 5)) for _ in range(4)]
    ne[0] = int(rng.integers(1, 3)) * info.blck if info.blck > 1 else int(rng.integers(1, 40))
    if rng.random() < 0.03:
        ne[int(rng.integers(0, 4))] = 0
    if rng.random() < 0.5:  # contiguous
        nb = [info.size, info.size * (ne[0] // info.blck)]
        nb += [nb[1] * max(ne[1], 1), nb[1] * max(ne[1], 1) * max(ne[2], 1)]
    else:  # anything a peer may send, including wild strides on size-1 dims
        nb = [info.size] + [int(rng.choice([0, info.size, 64, 1000, 1 << 30])) for _ in range(3)]
    params = rng.integers(-3, 9, size=16).astype(np.int32)
    if rng.random() < 0.3:
        params[:4] = np.array(rng.normal(size=4), dtype=np.float32).view(np.int32)
    t = GraphTensor(id=tid, type=type_id, ne=tuple(ne), nb=tuple(nb), op=0, op_params=params, flags=0,
                    buffer=memory, offset=int(rng.integers(0, ARENA // 2)) // 32 * 32, name=f"t{tid}")
    return t


def run_random_cases(op: int, n_cases: int) -> tuple[list[str], int]:
    """Failures (wrong exception, unnamed refusal, write outside the node) and how many cases computed."""
    rng = np.random.default_rng(op)
    failures = []
    computed = 0
    for case in range(n_cases):
        memory = rng.integers(0, 256, ARENA, dtype=np.uint8)
        view = memoryview(memory)
        srcs = [random_tensor(rng, view, 10 + i) for i in range(int(rng.integers(1, 5)))]
        if rng.random() < 0.3:  # often give every source the first one's layout, so element-wise rules hold
            for t in srcs[1:]:
                t.type, t.ne, t.nb = srcs[0].type, srcs[0].ne, srcs[0].nb
        node = random_tensor(rng, view, 1)
        if rng.random() < 0.5:  # often make the node look like its first source
            node.type, node.ne, node.nb = srcs[0].type, srcs[0].ne, srcs[0].nb
        node.op = op
        node.flags = int(TensorFlag.COMPUTE)
        node.src = [*srcs, *([None] * (10 - len(srcs)))]
        before = memory.copy()
        try:
            with np.errstate(all="ignore"):
                execute([node])
        except ExecutorError as exc:
            if not str(exc).startswith(f"{op_name(op)}:"):
                failures.append(f"case {case}: refusal does not name the op: {exc}")
        except Exception as exc:  # reported below with the case number
            failures.append(f"case {case}: {type(exc).__name__}: {exc}")
            continue
        else:
            computed += 1
        changed = np.flatnonzero(memory != before)
        if changed.size:
            try:
                lo, hi = node.offset, node.offset + extent(node)
            except ExecutorError:
                lo, hi = 0, 0
            outside = changed[(changed < lo) | (changed >= hi)]
            if outside.size:
                failures.append(f"case {case}: wrote {outside.size} bytes outside the node, e.g. at {outside[0]}")
    return failures, computed


def test_random_inputs_raise_cleanly_and_write_only_the_node():
    failures: list[str] = []
    computed: dict[str, int] = {}
    for op in sorted(KERNELS):
        bad, ok = run_random_cases(op, 40)
        failures += [f"{op_name(op)} {b}" for b in bad]
        computed[op_name(op)] = ok
    assert not failures, failures[:5]
    # The cases must reach the kernels, not only their checks: most ops compute some of them.
    assert sum(1 for n in computed.values() if n) >= 0.6 * len(computed), computed
