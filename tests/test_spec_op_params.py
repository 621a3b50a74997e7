"""The op_params table of PROTOCOL.md (``spec/op_params.py``) against what the kit itself reads and sends.

The op list is derived, not written twice: the reference executor's source is read (its kernels and prepared steps,
through the module functions and tables they use) for every op_params slot it takes, as an i32 or as a float; each
must be a documented parameter of that op, of the same type.  The ops the conformance checks send with op_params
must be documented too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from ggml_rpc.spec.enums import GgmlOp
from ggml_rpc.spec.op_params import F32, I32, OP_PARAM_SLOTS, OP_PARAMS, READ_NOT_LISTED, WRITTEN_NOT_READ
from ggml_rpc.spec.render.markdown import render_markdown

ROOT = Path(__file__).resolve().parent.parent
EXECUTOR = ROOT / "reference" / "executor"
CHECKS = ROOT / "conformance" / "checks"
_READERS = {"params_i32": I32, "params_f32": F32}


def _op_of(node: ast.expr) -> int | None:
    """``GgmlOp.X`` -> X's id (None for anything else, such as a loop variable)."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "GgmlOp":
        return int(GgmlOp[node.attr])
    return None


def _slots(sub: ast.Subscript) -> set[int] | None:
    """The slots a subscript of a params array reads; None when it is not a constant index or slice."""
    index = sub.slice
    if isinstance(index, ast.Constant) and isinstance(index.value, int):
        return {index.value}
    if isinstance(index, ast.Slice) and index.step is None:
        lo = index.lower.value if isinstance(index.lower, ast.Constant) else 0 if index.lower is None else None
        hi = index.upper.value if isinstance(index.upper, ast.Constant) else OP_PARAM_SLOTS if index.upper is None \
            else None
        if lo is not None and hi is not None:
            return set(range(lo, hi))
    return None


def _reads(fn: ast.AST) -> tuple[set[tuple[int, str]], list[str]]:
    """(slot, type) pairs one function body reads, and the uses it could not resolve."""
    found: set[tuple[int, str]] = set()
    unresolved: list[str] = []
    arrays: dict[str, str] = {}  # local name -> type, for ``p = params_f32(node)``
    parents = {child: parent for parent in ast.walk(fn) for child in ast.iter_child_nodes(parent)}
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and \
                isinstance(node.value.func, ast.Name) and node.value.func.id in _READERS and \
                len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            arrays[node.targets[0].id] = _READERS[node.value.func.id]
    for node in ast.walk(fn):
        kind = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _READERS:
            kind = _READERS[node.func.id]
        elif isinstance(node, ast.Name) and node.id in arrays and isinstance(node.ctx, ast.Load):
            kind = arrays[node.id]
        if kind is None:
            continue
        parent = parents.get(node)
        if isinstance(parent, ast.Assign):
            continue  # ``p = params_f32(node)``: its subscripts are the reads
        if isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name) and parent.func.id == "len":
            continue
        slots = _slots(parent) if isinstance(parent, ast.Subscript) and parent.value is node else None
        if slots is None:
            unresolved.append(ast.unparse(parent if parent is not None else node))
            continue
        found |= {(s, kind) for s in slots}
    return found, unresolved


def executor_reads() -> tuple[dict[int, set[tuple[int, str]]], list[str]]:
    """Per op: the op_params slots (and their type) the executor's kernels and prepared steps read."""
    per_op: dict[int, set[tuple[int, str]]] = {}
    unresolved: list[str] = []
    for path in sorted(EXECUTOR.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        defs: dict[str, ast.AST] = {}
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                defs[node.name] = node
            elif isinstance(node, ast.Assign | ast.AnnAssign):  # tables of functions (_UNARY, _GLU...)
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Name) and node.value is not None:
                        defs[t.id] = node.value
        memo: dict[str, tuple[set[tuple[int, str]], list[str]]] = {}

        def closure(roots: set[str], defs=defs, memo=memo, path=path) -> tuple[set[tuple[int, str]], list[str]]:
            seen, todo, got, bad = set(), list(roots), set(), []
            while todo:
                name = todo.pop()
                if name in seen or name not in defs:
                    continue
                seen.add(name)
                if name not in memo:
                    memo[name] = _reads(defs[name])
                got |= memo[name][0]
                bad += [f"{path.name}:{name}: {u}" for u in memo[name][1]]
                todo += [n.id for n in ast.walk(defs[name]) if isinstance(n, ast.Name)]
            return got, bad

        registrations: list[tuple[int, ast.AST]] = []
        for node in ast.walk(tree):
            # @kernel(GgmlOp.X, ...) / @prepared(GgmlOp.X) on a function
            if isinstance(node, ast.FunctionDef):
                for d in node.decorator_list:
                    if isinstance(d, ast.Call) and getattr(d.func, "id", "") in ("kernel", "prepared") and d.args:
                        op = _op_of(d.args[0])
                        if op is not None:
                            registrations.append((op, node))
            # kernel(GgmlOp.X, ...)(fn or lambda) as a statement
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Call) and \
                    getattr(node.func.func, "id", "") in ("kernel", "prepared") and node.func.args:
                op = _op_of(node.func.args[0])
                if op is not None:
                    registrations.extend((op, arg) for arg in node.args)
        for op, fn in registrations:
            own, bad = _reads(fn)
            names = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)}
            got, bad2 = closure(names)
            per_op.setdefault(op, set()).update(own | got)
            unresolved += bad + bad2
    return {op: reads for op, reads in per_op.items() if reads}, unresolved


def test_the_executor_reads_only_documented_params():
    reads, unresolved = executor_reads()
    assert not unresolved, f"op_params uses the table test cannot read: {unresolved}"
    # The derivation finds the ops it must (a broken scan would find none and pass).
    assert {GgmlOp.ROPE, GgmlOp.SOFT_MAX, GgmlOp.RMS_NORM, GgmlOp.GLU, GgmlOp.UNARY, GgmlOp.ACC} <= set(reads)
    for op, pairs in sorted(reads.items()):
        name = GgmlOp(op).name
        assert op in OP_PARAMS, f"the executor reads op_params of {name}, which PROTOCOL.md does not describe"
        documented = {(s, p.kind) for p in OP_PARAMS[op] for s in p.slots}
        assert pairs <= documented, f"{name}: the executor reads {sorted(pairs - documented)}, not documented"


def test_the_table_has_no_op_the_executor_ignores_without_reason():
    reads, _ = executor_reads()
    # MUL_MAT's hint is read by upstream's CPU backend, not by the executor (see OP_PARAMS).
    assert set(OP_PARAMS) - set(reads) == {GgmlOp.MUL_MAT}
    assert not set(OP_PARAMS) & set(READ_NOT_LISTED) and not set(OP_PARAMS) & set(WRITTEN_NOT_READ)


def _checks_ops_with_params() -> set[int]:
    """Ops the conformance checks build with op_params (``g.op(GgmlOp.X, ..., params=...)`` or a tensor built with
    ``op=int(GgmlOp.X)`` and ``op_params=``)."""
    ops: set[int] = set()
    for path in sorted(CHECKS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            kw = {k.arg: k.value for k in node.keywords if k.arg}
            if "params" in kw and node.args and _op_of(node.args[0]) is not None:
                ops.add(_op_of(node.args[0]))
            if "op_params" in kw and "op" in kw:
                op = kw["op"]
                inner = op.args[0] if isinstance(op, ast.Call) and op.args else op
                if _op_of(inner) is not None:
                    ops.add(_op_of(inner))
    return ops


def test_the_checks_send_only_documented_params():
    ops = _checks_ops_with_params()
    assert {GgmlOp.ROPE, GgmlOp.SCALE, GgmlOp.GLU} <= ops
    assert ops <= set(OP_PARAMS), sorted(GgmlOp(o).name for o in ops - set(OP_PARAMS))


@pytest.fixture(scope="module")
def doc() -> str:
    return render_markdown()


def test_op_params_rendered_with_offsets(doc):
    rope = doc[doc.index('<a id="op-params-rope"></a>'):doc.index('<a id="op-params-rope_back"></a>')]
    assert "| 5 | 20–23 | 76 | f32 | `freq_base` |" in rope
    assert "| 11–14 | 44–59 | 100 | i32[4] | `sections` |" in rope
    assert "| 15 | 60–63 | 116 | i32 | `n_offs` |" in rope
    assert "[op_params](#op-params-rope)" in doc[doc.index('<a id="enum-ops"></a>'):]
    glu = doc[doc.index('<a id="op-params-glu"></a>'):]
    assert "the GLU sub-op ([GLU ops](#enum-glu))" in glu
    assert "6.0.0's has only the weighted sum" in doc[doc.index('<a id="op-params-dsv4_hc_pre"></a>'):]
    assert "([op_params](#op-params); zeros for an op not listed there)" in doc
