"""A numpy graph executor: runs rebuilt GRAPH_COMPUTE graphs the way ggml's CPU backend does.

``execute(nodes)`` runs the nodes in order.  Each tensor is a strided numpy view onto its server buffer (no
copies), so results land in the node's own memory, where views, in-place ops and later reads see them.  Nodes
without the COMPUTE flag and empty nodes are skipped as ggml skips them; VIEW, RESHAPE, PERMUTE, TRANSPOSE and
NONE cost nothing.  Anything the executor cannot run raises :class:`~ggml_rpc.reference.graph.ExecutorError`
naming the op, the types and the shapes.  Ops that carry native function pointers (MAP_CUSTOM1/2/3, CUSTOM) are
refused outright.
"""

from __future__ import annotations

from collections.abc import Sequence

from ggml_rpc.spec import NATIVE_CALLBACK_OPS, GgmlOp, GluOp, TensorFlag, UnaryOp, op_name

from ..graph import ExecutorError, GraphTensor
from . import attention, conv, elementwise, generate, layout, matmul, norm, reduce, rope, rows, softmax
from .core import KERNELS, SUPPORT
from .memory import Memory, node_error
from .table import render_ops_table, supported_ops

#: Ops that only describe memory (their data is already where the view points): nothing to compute.
FREE_OPS = frozenset(int(op) for op in (GgmlOp.NONE, GgmlOp.VIEW, GgmlOp.RESHAPE, GgmlOp.PERMUTE, GgmlOp.TRANSPOSE))
_COMPUTE = int(TensorFlag.COMPUTE)

__all__ = ["FREE_OPS", "ExecutorError", "execute", "render_ops_table", "supported_ops", "supports_op"]


def execute(nodes: Sequence[GraphTensor]) -> None:
    """Run ``nodes`` in order, writing each result into the node's own memory."""
    mem = Memory()
    kernels = KERNELS
    for node in nodes:
        op = node.op
        if op in FREE_OPS:
            continue
        if op in NATIVE_CALLBACK_OPS:
            raise node_error(node, "ops carrying native function pointers are never executed")
        if not node.flags & _COMPUTE:
            continue
        ne = node.ne
        if ne[0] == 0 or ne[1] == 0 or ne[2] == 0 or ne[3] == 0:
            continue
        fn = kernels.get(op)
        if fn is None:
            raise node_error(node, f"op {op_name(op)} is not supported by the reference executor")
        try:
            fn(node, mem)
        except ExecutorError as exc:
            if str(exc).startswith(op_name(op) + ":"):
                raise
            raise node_error(node, str(exc)) from None  # name the op, its types and shapes in every refusal
        except (ValueError, TypeError, IndexError, MemoryError, FloatingPointError) as exc:
            raise node_error(node, f"cannot compute: {exc}") from exc


def supports_op(node: GraphTensor) -> bool:
    """Whether the executor runs this op with these types (what GET_DEVICE_SUPPORTS_OP answers)."""
    op = node.op
    if op in FREE_OPS:
        return True
    if op in NATIVE_CALLBACK_OPS or op not in KERNELS:
        return False
    label = op_name(op)
    sub = int(node.op_params[0]) if len(node.op_params) else -1
    if op == GgmlOp.UNARY:
        label = f"UNARY/{UnaryOp(sub).name}" if sub in UnaryOp._value2member_map_ else ""
    elif op == GgmlOp.GLU:
        label = f"GLU/{GluOp(sub).name}" if sub in GluOp._value2member_map_ else ""
    row = next((s for s in SUPPORT if s.op == label), None)
    if row is None:
        return False
    src0 = node.src[0] if node.src else None
    if src0 is not None and row.src_types and src0.type not in row.src_types:
        return False
    return not row.dst_types or node.type in row.dst_types
