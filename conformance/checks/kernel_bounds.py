"""Framing: kernel bounds through GRAPH_COMPUTE (class E of upstream's memory-safety bugs, SECURITY.md) and ops carrying
a function pointer (F).

Release builds drop the kernels' shape assertions, so nothing dies when an index tensor or op_params drive a kernel
out of bounds: each check surrounds its tensors with canaries (:mod:`.canaries`) and judges what comes back.
"""

from __future__ import annotations

from ggml_rpc.conformance.checks._support import (
    Buf,
    bad_on_fresh,
)
from ggml_rpc.conformance.checks._support import check as _check
from ggml_rpc.conformance.checks.canaries import (
    COMPUTE,
    acc_set_graph,
    each_graph,
    gated_delta_net_graph,
    get_rows_graph,
    set_rows_graph,
    src_ids,
    ssm_scan_graph,
)
from ggml_rpc.conformance.checks.framing import FR, graph_bytes
from ggml_rpc.conformance.harness import Context
from ggml_rpc.spec import NATIVE_CALLBACK_OPS, GgmlOp
from ggml_rpc.spec import Command as C

#: An address no process maps: a server that calls the function pointer of a CUSTOM op dies on it (#25289).
FAULTING_POINTER = 0x4141_4141_4141_4141


#: (row, planes) of the GET_ROWS / SET_ROWS checks: rows in range in a second plane the table does not have (the
#: canary after it); rows right after and before the table (its canaries) and far outside the buffer.
BAD_ROWS = ((1, 2), (8, 1), (-1, 1), (1 << 20, 1))
#: ACC/SET windows (nb1, nb2, offset, window shape): rows walking back into the canary before the result while
#: the planes walk forward by as much, so that the window's far corner lands inside (#25764: a check of the corner
#: alone passes); rows walking back with nothing to cancel them; all rows at one place, past the result's end.
BAD_WINDOWS = ((-64, 64, 0, (4, 2, 2)), (-16, 256, 0, (4, 4)), (0, 256, 60, (4, 4)))
#: The two ops of the window checks.
ACC_SET_OPS = (GgmlOp.ACC, GgmlOp.SET)
#: SSM_SCAN state ids: the canaries after and before s (2 states), and far outside the buffer.
BAD_STATE_IDS = (2, -1, 1 << 20)
#: GATED_DELTA_NET snapshot counts: 64 states where the result holds one, and a negative count.
BAD_SNAPSHOTS = (64, -1)


@_check("FRAME-055", "GET_ROWS with row indices outside its source is refused or reads nothing outside it "
        "(no canary byte in the output)", FR, section=C.GRAPH_COMPUTE)
def get_rows_out_of_range(ctx: Context) -> str:
    # #26825: the rows read past the table came back by GET_TENSOR.
    return "; ".join(each_graph(ctx, lambda g, r=r: get_rows_graph(g, *r)) for r in BAD_ROWS)


@_check("FRAME-056", "SET_ROWS with row indices outside its destination is refused or writes nothing outside it "
        "(canaries intact)", FR, section=C.GRAPH_COMPUTE)
def set_rows_out_of_range(ctx: Context) -> str:
    # #26912: the row index is a write position.
    return "; ".join(each_graph(ctx, lambda g, r=r: set_rows_graph(g, *r)) for r in BAD_ROWS)


@_check("FRAME-057", "ACC and SET whose op_params strides are negative or zero are refused or write nothing outside "
        "their result (canaries intact)", FR, section=C.GRAPH_COMPUTE)
def acc_set_strides(ctx: Context) -> str:
    # #25764: a negative nb1 keeps the window's first element inside the result but walks its later rows back out
    # of it; a zero stride with an offset near the end puts every row past it.
    return "; ".join(each_graph(ctx, lambda g, op=op, w=w: acc_set_graph(g, op, w))
                     for op in ACC_SET_OPS for w in BAD_WINDOWS)


@_check("FRAME-058", "SSM_SCAN whose ids tensor names states outside its state source is refused or reads nothing "
        "outside it (no canary byte in the output)", FR, section=C.GRAPH_COMPUTE)
def ssm_scan_ids(ctx: Context) -> str:
    # #25765: ids picks each sequence's initial state out of s.
    return "; ".join(each_graph(ctx, lambda g, i=i: ssm_scan_graph(g, i)) for i in BAD_STATE_IDS)


@_check("FRAME-059", "GATED_DELTA_NET whose op_params ask for more state snapshots than its result holds is refused "
        "or writes nothing outside its result (canaries intact)", FR, section=C.GRAPH_COMPUTE)
def gated_delta_net_params(ctx: Context) -> str:
    # #25704: op_params size the writes of the states.
    return "; ".join(each_graph(ctx, lambda g, k=k: gated_delta_net_graph(g, k)) for k in BAD_SNAPSHOTS)


# ---- F: ops whose op_params carry a function pointer -------------------------------------------------------------


@_check("FRAME-060", "GRAPH_COMPUTE of a CUSTOM or MAP_CUSTOM1/2/3 node (op_params carry a function pointer) closes "
        "the connection: the pointer is never called", FR, section=C.GRAPH_COMPUTE)
def custom_op_pointer(ctx: Context) -> None:
    # #25289: the client chooses the address the server calls.  It points where nothing is mapped, so a server
    # that calls it dies (a MUST failure) instead of running code.
    lo, hi = FAULTING_POINTER & 0xFFFF_FFFF, FAULTING_POINTER >> 32
    # ggml's custom op params: the function pointer, n_tasks (1), padding, the userdata pointer.
    params = [p - (1 << 32) if p >= 1 << 31 else p for p in (lo, hi, 1, 0, lo, hi)] + [0] * 10
    for op in (GgmlOp(o) for o in sorted(NATIVE_CALLBACK_OPS)):
        def build(buf: Buf, op: GgmlOp = op) -> bytes:
            srcs = [buf.f32(16 * i, (4,), id=0x2C01 + i) for i in range(3)]
            n_src = {GgmlOp.MAP_CUSTOM1: 1, GgmlOp.MAP_CUSTOM2: 2}.get(op, 3)
            out = buf.f32(64, (4,), id=0x2C10)
            out.update(op=int(op), flags=COMPUTE, op_params=params, src=src_ids(*(s["id"] for s in srcs[:n_src])))
            return graph_bytes(ctx.protocol, 0, [out["id"]], [*srcs, out])

        bad_on_fresh(ctx, build, f"GRAPH_COMPUTE of a {op.name} node whose function pointer is "
                     f"{FAULTING_POINTER:#x}")
