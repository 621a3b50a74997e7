"""Hunt strategies for upstream's memory-safety bug classes (SECURITY.md; checks FRAME-048..060 judge the same inputs):
partial quantisation blocks (C), empty and wrapping sizes and views past their source (B), null and freed buffers in
graphs (A), cyclic graphs (D), kernel bounds driven by op_params and index tensors (E) and CUSTOM ops' function
pointers (F). Each is a step of a seeded example (:mod:`.hunt_strategies` picks them by weight); every message goes
through the example, model and target alike.
"""

from __future__ import annotations

import random
import struct
from typing import TYPE_CHECKING

from ggml_rpc.spec import NATIVE_CALLBACK_OPS, Command, GgmlOp, GgmlType, TensorFlag
from ggml_rpc.spec.tensor import src_ids

from .draws import RandomDraw
from .message import FuzzMessage
from .valid_requests import BufferRef

if TYPE_CHECKING:
    from .example import Example
    from .hunt import Hunt


def fresh_buffer(ex: Example, d: RandomDraw, size: int) -> BufferRef | None:
    """A new buffer of ``size`` bytes on the example's open connection (None when the model refuses it)."""
    return ex.alloc(ex.active(), size, 0)


# ---- upstream's memory-safety bug classes (checks FRAME-048..060 judge the same inputs) ---------------------------

#: Quantised types whose block holds more than one element (the IQ grid types need codebooks the model may lack).
BLOCK_TYPES = tuple(int(t) for t in (GgmlType.Q4_0, GgmlType.Q4_1, GgmlType.Q5_0, GgmlType.Q8_0, GgmlType.Q2_K,
                                     GgmlType.Q4_K, GgmlType.Q6_K))
#: Addresses a server calling a CUSTOM op's function pointer jumps to: unmapped, so it dies instead of running code.
FAULTING_POINTERS = (0x4141_4141_4141_4141, 0xDEAD_0000_0000_0000, 0x10)
#: The ops whose op_params carry a function pointer (#25289), from spec's table.
CALLBACK_OPS = tuple(GgmlOp(op) for op in sorted(NATIVE_CALLBACK_OPS))
COMPUTE = int(TensorFlag.COMPUTE)
F32, I32, I64, I8 = int(GgmlType.F32), int(GgmlType.I32), int(GgmlType.I64), int(GgmlType.I8)


def _i32(v: int) -> int:
    """A value as the signed 32-bit op_param it is stored as."""
    v &= 0xFFFF_FFFF
    return v - (1 << 32) if v >= 1 << 31 else v


class _Layout:
    """Tensors laid out in one fresh buffer, 64 bytes apart (so that a kernel's stray bytes land in the gaps), the
    buffer first filled with one byte value (BUFFER_CLEAR) so that model and target start from the same bytes.
    The tensors are not added to the example's scope: the generic generators must not reuse them as valid."""

    def __init__(self, ex: Example, buf: BufferRef) -> None:
        self.ex, self.buf, self.at = ex, buf, 64

    @classmethod
    def open(cls, ex: Example, d: RandomDraw, rng: random.Random, size: int = 8192) -> _Layout | None:
        buf = fresh_buffer(ex, d, size)
        if buf is None:
            return None
        ex.send(ex.active(), FuzzMessage(Command.BUFFER_CLEAR, {"remote_ptr": buf.handle,
                                                                 "value": rng.choice((0x00, 0x3C, 0x41))}))
        return cls(ex, buf)

    def place(self, type_id: int, ne: tuple[int, ...], **fields: object) -> dict:
        from ggml_rpc.spec import make_tensor, tensor_nbytes

        off = -(-self.at // 32) * 32
        t = make_tensor(id=self.ex.scope.new_id(), type=type_id, ne=ne, buffer=self.buf.handle,
                        data=self.buf.base + off, **fields)  # type: ignore[arg-type]
        # A tensor whose size is bogus on purpose (past 2^64) must not push the next one out of the buffer.
        self.at = off + min(tensor_nbytes(t), self.buf.size) + 64
        return t

    def fill(self, t: dict, data: bytes) -> None:
        """SET_TENSOR of ``data`` into ``t`` (a valid message: the index tensors' values)."""
        fields = {"tensor": t, "offset": 0}
        if self.ex.protocol.cache_rule.flag_field:
            fields[self.ex.protocol.cache_rule.flag_field] = 0
        self.ex.send(self.ex.active(), FuzzMessage(Command.SET_TENSOR, fields, data))

    def graph(self, nodes: list[int], tensors: list[dict], broken: str, tag: str) -> None:
        self.ex.send(self.ex.active(), FuzzMessage(Command.GRAPH_COMPUTE, {"device": 0, "nodes": nodes,
                                                                             "tensors": tensors},
                                                   broken=broken, tags=(tag,)))


def block_misaligned(h: Hunt, ex: Example, d: RandomDraw, rng: random.Random) -> None:
    """A quantised tensor whose ne[0] ends inside a block (#25288), in one of the commands that take a tensor."""
    from ggml_rpc.spec import TYPES, null_tensor, tensor_nbytes

    lay = _Layout.open(ex, d, rng, 16384)
    if lay is None:
        return
    type_id = rng.choice(BLOCK_TYPES)
    info = TYPES[type_id]
    ne0 = info.blck * rng.randint(0, 2) + rng.choice((1, info.blck // 2, info.blck - 1))
    rows = rng.randint(1, 4)
    row = -(-ne0 // info.blck) * info.size  # room for the partial block too
    t = lay.place(type_id, (ne0, rows), nb=(info.size, row, row * rows, row * rows))
    n = tensor_nbytes(t)
    broken = f"block: tensor.ne.0 = {ne0} ({info.name}, block {info.blck})"
    cmd = rng.choice((Command.SET_TENSOR, Command.GET_TENSOR, Command.INIT_TENSOR, Command.COPY_TENSOR,
                      Command.GET_ALLOC_SIZE, Command.SET_TENSOR_HASH, Command.GRAPH_COMPUTE))
    k = rng.randint(0, max(0, min(n, 64)))
    if cmd is Command.SET_TENSOR:
        fields = {"tensor": t, "offset": 0}
        if ex.protocol.cache_rule.flag_field:
            fields[ex.protocol.cache_rule.flag_field] = 0
        msg = FuzzMessage(cmd, fields, bytes(rng.randrange(256) for _ in range(k)))
    elif cmd is Command.GET_TENSOR:
        msg = FuzzMessage(cmd, {"tensor": t, "offset": 0, "size": k})
    elif cmd is Command.INIT_TENSOR:
        msg = FuzzMessage(cmd, {"tensor": t})
    elif cmd is Command.COPY_TENSOR:
        dst = lay.place(I8, (n,))
        pair = (t, dst) if rng.random() < 0.7 else (dst, t)
        msg = FuzzMessage(cmd, {"src": pair[0], "dst": pair[1]})
        broken = broken.replace("tensor.", "src." if pair[0] is t else "dst.")
    elif cmd is Command.GET_ALLOC_SIZE:
        msg = FuzzMessage(cmd, {"device": 0, "tensor": t, "srcs": [null_tensor() for _ in range(10)]})
    elif cmd is Command.SET_TENSOR_HASH:
        # Validated only on a hit: a hash the example sent before may be in the cache.
        digest = rng.choice(ex.scope.hashes) if ex.scope.hashes else rng.getrandbits(64)
        msg = FuzzMessage(cmd, {"tensor": t, "offset": 0, "hash": digest})
    else:
        out = lay.place(F32, (ne0, rows))
        node = dict(out, id=ex.scope.new_id(), op=int(GgmlOp.CPY), flags=COMPUTE, src=src_ids(t["id"], out["id"]),
                    view_src=out["id"])
        msg = FuzzMessage(cmd, {"device": 0, "nodes": [node["id"]], "tensors": [t, out, node]})
        broken = broken.replace("tensor.", "tensors.0.")
    msg.broken, msg.tags = broken, ("block",)
    ex.send(ex.active(), msg)


def size_arithmetic(h: Hunt, ex: Example, d: RandomDraw, rng: random.Random) -> None:
    """Size arithmetic (#9799 and views): an empty dimension with huge strides, ne x nb wrapping 64 bits, or a view
    whose view_offs leads past its source, read by GET_TENSOR or computed as a graph node."""
    lay = _Layout.open(ex, d, rng)
    if lay is None:
        return
    kind = rng.choice(("empty", "wrap", "view"))
    src = lay.place(F32, (4,))
    if kind == "empty":
        dim = rng.randrange(1, 4)
        ne = [4, 1, 1, 1]
        ne[dim] = 0
        nb = (4, *(rng.choice((0xFFFF_FFF0, 1 << 31, 16)) for _ in range(3)))
        t = lay.place(F32, tuple(ne), nb=nb)
        broken, tag = f"arith: tensor.ne.{dim} = 0 (nb {nb[dim]:#x})", "arith"
    elif kind == "wrap":
        m = 0xFFFF_FFFF
        # (2^32 - 2) * 2^31 twice and 4 * 2^31: 2^64 exactly, plus the first row (see FRAME-050)
        ne, nb = (16, m, m, 5), (4 if rng.random() < 0.5 else 1, 1 << 31, 1 << 31, 1 << 31)
        t = lay.place(F32 if nb[0] == 4 else I8, ne, nb=nb)
        broken, tag = "arith: tensor.ne = ne x nb past 2^64", "arith"
    else:
        offs = rng.choice((16, 1 << 20, 1 << 40, (1 << 64) - 16))
        t = lay.place(F32, (4,), view_src=src["id"], view_offs=offs)
        broken, tag = f"view: tensor.view_offs = {offs:#x} (past its 16-byte source)", "view"
    if kind != "view" and rng.random() < 0.4:
        ex.send(ex.active(), FuzzMessage(Command.GET_TENSOR, {"tensor": t, "offset": 0, "size": rng.choice((0, 4))},
                                         broken=broken, tags=(tag,)))
        return
    node = dict(t, op=int(GgmlOp.SCALE), flags=COMPUTE, src=src_ids(src["id"]), op_params=[0x40000000] + [0] * 15)
    lay.graph([node["id"]], [src, node], broken.replace("tensor.", "tensors.1."), tag)


def foreign_buffer(h: Hunt, ex: Example, d: RandomDraw, rng: random.Random) -> None:
    """A graph node or source with buffer 0 (data 0 or not), or in a buffer freed before (CVE-2026-34159 /
    PR #20908: buffer 0 skipped every check of graph node creation)."""
    lay = _Layout.open(ex, d, rng)
    if lay is None:
        return
    a = lay.place(F32, (4,))
    b = lay.place(F32, (4,))
    out = lay.place(F32, (4,), op=int(GgmlOp.ADD), flags=COMPUTE, src=src_ids(a["id"], b["id"]))
    victim = rng.choice(("node", "source"))
    t = out if victim == "node" else b
    how = rng.choice(("null", "null+data", "freed"))
    if how == "freed":
        gone = fresh_buffer(ex, d, 4096)
        if gone is None:
            return
        ex.send(ex.active(), FuzzMessage(Command.FREE_BUFFER, {"remote_ptr": gone.handle}))
        t.update(buffer=gone.handle, data=gone.base + rng.choice((0, 64)))
        broken = f"buffer: tensors.{2 if victim == 'node' else 1}.buffer = freed {gone.handle:#x}"
    else:
        t.update(buffer=0, data=0 if how == "null" else t["data"])
        broken = f"buffer: tensors.{2 if victim == 'node' else 1}.buffer = 0 ({'data 0' if how == 'null' else 'data'})"
    lay.graph([out["id"]], [a, b, out], broken, "buffer")


def graph_structure(h: Hunt, ex: Example, d: RandomDraw, rng: random.Random) -> None:
    """Graph structure: a node its own source or view, a -> b -> a, a node listed again, src ids out of range."""
    lay = _Layout.open(ex, d, rng)
    if lay is None:
        return
    a = lay.place(F32, (4,))
    x = lay.place(F32, (4,), op=int(GgmlOp.ADD), flags=COMPUTE, src=src_ids(a["id"], a["id"]))
    y = lay.place(F32, (4,), op=int(GgmlOp.MUL), flags=COMPUTE, src=src_ids(x["id"], a["id"]))
    nodes = [x["id"], y["id"]]
    shape = rng.choice(("self", "pair", "view", "again", "far"))
    if shape == "self":
        x["src"] = src_ids(x["id"], a["id"])
    elif shape == "pair":
        x["src"] = src_ids(y["id"], a["id"])
    elif shape == "view":
        x["view_src"] = rng.choice((x["id"], y["id"]))
    elif shape == "again":
        nodes = nodes + rng.choice(([x["id"]], [y["id"], x["id"]], [x["id"]] * 8))
    else:
        # An id no tensor carries, at the far end of the id space.
        x["src"] = src_ids(a["id"], rng.choice((1 << 63, (1 << 64) - 1, 1 << 32)))
    lay.graph(nodes, [a, x, y], f"graph: tensors.1.src = {shape}", "graph")


def kernel_bounds(h: Hunt, ex: Example, d: RandomDraw, rng: random.Random) -> None:
    """Kernel bounds release builds do not check: ACC/SET strides (#25764), SSM_SCAN ids (#25765), GATED_DELTA_NET
    op_params (#25704), GET_ROWS and SET_ROWS rows past the table or in planes it does not have (#26825, #26912)."""
    lay = _Layout.open(ex, d, rng, 16384)
    if lay is None:
        return
    op = rng.choice(("acc", "ssm", "gdn", "rows"))
    if op == "acc":
        window = rng.choice(((4, 1), (4, 4), (4, 2, 2)))
        a, b = lay.place(F32, (4, 4)), lay.place(F32, window)
        nb1 = rng.choice((-16, -64, -4096, 0, 4, 1 << 20))
        # A plane stride cancelling the row stride puts the window's far corner back inside (#25764).
        nb2 = rng.choice((256, -nb1, 64))
        offset = rng.choice((0, 4, 48, 60, 64, -4))
        kind = rng.choice((GgmlOp.ACC, GgmlOp.SET))
        out = lay.place(F32, (4, 4), op=int(kind), flags=COMPUTE, src=src_ids(a["id"], b["id"]),
                        op_params=[_i32(nb1), _i32(nb2), 256, _i32(offset), rng.choice((0, 1))])
        lay.graph([out["id"]], [a, b, out], f"kernel: {kind.name}.op_params = nb1 {nb1}, nb2 {nb2}, offset {offset}",
                  "kernel")
    elif op == "ssm":
        s = lay.place(F32, (4, 2, 1, 2))
        x, dt, aa = lay.place(F32, (2, 1, 1, 1)), lay.place(F32, (1, 1, 1, 1)), lay.place(F32, (1, 1, 1, 1))
        b, c, ids = lay.place(F32, (4, 1, 1, 1)), lay.place(F32, (4, 1, 1, 1)), lay.place(I32, (1,))
        bad = rng.choice((2, 3, -1, 1 << 20, -(1 << 31)))
        lay.fill(ids, struct.pack("<i", bad))
        out = lay.place(F32, (10,), op=int(GgmlOp.SSM_SCAN), flags=COMPUTE,
                        src=src_ids(*(t["id"] for t in (s, x, dt, aa, b, c, ids))), op_params=[1])
        lay.graph([out["id"]], [s, x, dt, aa, b, c, ids, out], f"kernel: SSM_SCAN.ids = {bad}", "kernel")
    elif op == "gdn":
        parts = [lay.place(F32, ne) for ne in ((2, 1, 1, 1), (2, 1, 1, 1), (2, 1, 1, 1), (1, 1, 1, 1), (1, 1, 1, 1),
                                               (2, 2, 1, 1))]
        k = rng.choice((0, 2, 64, -1, 1 << 20))
        out = lay.place(F32, (6,), op=int(GgmlOp.GATED_DELTA_NET), flags=COMPUTE,
                        src=src_ids(*(t["id"] for t in parts)), op_params=[_i32(k)])
        lay.graph([out["id"]], [*parts, out], f"kernel: GATED_DELTA_NET.op_params.0 = {k}", "kernel")
    else:
        # Rows out of range, or in range in planes the table does not have: its ne[2] = 1 hides nb[2] from its size,
        # so plane 1 lies past it (#26825 reading, #26912 writing).
        planes = rng.choice((1, 2))
        bad = rng.choice((8, -1, 1 << 20)) if planes == 1 else rng.randrange(8)
        table = lay.place(F32, (4, 8), nb=(4, 16, rng.choice((128, 1 << 30)), 128))
        if rng.random() < 0.5:
            rows = lay.place(F32, (4, 2, planes))
            idx = lay.place(I64, (2,))
            lay.fill(idx, struct.pack("<2q", 0, bad))
            node = dict(table, id=ex.scope.new_id(), op=int(GgmlOp.SET_ROWS), flags=COMPUTE,
                        src=src_ids(rows["id"], idx["id"]), view_src=table["id"])
            lay.graph([node["id"]], [rows, idx, table, node], f"kernel: SET_ROWS.rows = {bad}, planes {planes}",
                      "kernel")
        else:
            idx = lay.place(I32, (2, planes))
            lay.fill(idx, struct.pack(f"<{2 * planes}i", *([0, bad] * planes)))
            out = lay.place(F32, (4, 2, planes), op=int(GgmlOp.GET_ROWS), flags=COMPUTE,
                            src=src_ids(table["id"], idx["id"]))
            lay.graph([out["id"]], [table, idx, out], f"kernel: GET_ROWS.rows = {bad}, planes {planes}", "kernel")


def custom_op(h: Hunt, ex: Example, d: RandomDraw, rng: random.Random) -> None:
    """A CUSTOM / MAP_CUSTOM1-3 node whose op_params hold an unmapped function pointer (#25289): a server that
    calls it dies."""
    lay = _Layout.open(ex, d, rng)
    if lay is None:
        return
    op = rng.choice(CALLBACK_OPS)
    pointer = rng.choice(FAULTING_POINTERS)
    srcs = [lay.place(F32, (4,)) for _ in range(3)]
    n_src = {GgmlOp.MAP_CUSTOM1: 1, GgmlOp.MAP_CUSTOM2: 2}.get(op, rng.randint(0, 3))
    params = [_i32(pointer), _i32(pointer >> 32), 1, 0, _i32(pointer), _i32(pointer >> 32)]
    out = lay.place(F32, (4,), op=int(op), flags=COMPUTE, src=src_ids(*(t["id"] for t in srcs[:n_src])),
                    op_params=params + [0] * 10)
    lay.graph([out["id"]], [*srcs, out], f"custom: {op.name}.op_params = {pointer:#x}", "custom")
