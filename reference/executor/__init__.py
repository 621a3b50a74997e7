"""A numpy graph executor: runs rebuilt GRAPH_COMPUTE graphs the way ggml's CPU backend does.

``execute(nodes)`` runs the nodes in order; ``prepare(nodes)`` returns a :class:`Plan` that runs them again and
again, with the per-node work that does not depend on data (views, kernel choice, shape checks) done once.  Each
tensor is a strided numpy view onto its server buffer (no copies), so results land in the node's own memory, where
views, in-place ops and later reads see them.  Nodes without the COMPUTE flag and empty nodes are skipped as ggml
skips them; VIEW, RESHAPE, PERMUTE, TRANSPOSE and NONE cost nothing.  Anything the executor cannot run raises
:class:`~ggml_rpc.reference.graph.ExecutorError` naming the op, the types and the shapes.  Ops that carry native
function pointers (MAP_CUSTOM1/2/3, CUSTOM) are refused outright.
"""

from __future__ import annotations

from pathlib import Path

from ggml_rpc.spec import NATIVE_CALLBACK_OPS, GgmlOp, GluOp, UnaryOp, op_name

from ..graph import ExecutorError, GraphTensor
from . import (
    attention,
    conv,
    creation,
    elementwise,
    kernel_cache,
    matmul,
    movement,
    norm,
    reduce,
    rope,
    rows,
    softmax,
    warmup,
)
from .builds import build_for
from .core import KERNELS, SUPPORT
from .grids import available
from .plan import FREE_OPS, Plan, execute, prepare
from .table import supported_ops

# numba reads a kernel's cached machine code at its first call, not at import: refreshed here, before any call.
kernel_cache.refresh(Path(__file__).parent)

__all__ = ["FREE_OPS", "ExecutorError", "Plan", "build_for", "execute", "prepare", "supported_ops",
           "supports_op"]


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
    # The IQ grid types are in the table, but read only with codebooks from an installed upstream build.
    if any(s is not None and not available(s.type) for s in node.src):
        return False
    return not row.dst_types or node.type in row.dst_types
