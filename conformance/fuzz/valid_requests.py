"""State-aware valid requests of any command, derived from the payload schemas.

:mod:`ggml_rpc.spec.strategies` gives any message over the full range of every field.  Against a live server
almost all of those are refused at the first check, so the fuzzer steers the fields that name server state
towards that state, by field name and shape as the schemas declare them:

* a field holding an rpc_tensor (``tensor``, ``src``, ``dst``, ``op``) gets a tensor placed in a known buffer
  (sometimes a fully random one), an array of them (``srcs``) mostly null tensors and a few known ones;
* ``device`` is a device index the server has, ``remote_ptr`` a known buffer handle, ``hash`` the hash of data
  sent earlier (or any value);
* ``offset``/``size`` next to a tensor describe a region inside it, bulk data fits that region;
* GRAPH_COMPUTE's counted arrays become a small graph over known tensors;
* the version's cache flag field (from its cache rule) is 0, and 1 now and then, as a client sends it.

Every other field keeps its schema-derived values, so a command added to a version table is fuzzed as it is.  The
generators take their choices from a :class:`~.draws.Draw` (hypothesis or a seeded PRNG); ``valid_requests`` and
``placed_tensors`` are the hypothesis strategies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from construct import Struct
from ggml_rpc.spec import TYPES, Command, GgmlOp, GgmlType, Payload, Protocol, Shape, TensorFlag, ggml_nbytes
from ggml_rpc.spec.geometry import VIEWS, Span, classify, draw_geometry, view_of
from ggml_rpc.spec.schema_walk import FieldInfo, fields
from ggml_rpc.spec.tensor import GGML_MAX_OP_PARAMS, GGML_MAX_SRC, RpcTensor, encode_name, make_tensor, null_tensor
from hypothesis import strategies as st

from .draws import Draw, HypothesisDraw
from .message import FuzzMessage

#: Bytes of bulk data at most (SET_TENSOR data; GET_TENSOR and MEMSET regions are bounded by the tensors).
MAX_DATA = 2048
#: Types tensors are placed with: plain and block-quantised ones, so nbytes takes both formulas.
PLACE_TYPES = tuple(int(GgmlType[n]) for n in ("F32", "F16", "I32", "I8", "BF16", "Q8_0", "Q4_0", "Q4_K"))
#: Ops of fuzzed graphs: cheap element-wise and layout ops the reference executor runs.
GRAPH_OPS = tuple(int(GgmlOp[n]) for n in ("NONE", "DUP", "ADD", "SUB", "MUL", "DIV", "SQR", "SCALE", "CPY",
                                            "CONT", "RESHAPE", "VIEW"))
_COMPUTE = int(TensorFlag.COMPUTE)
#: Geometry classes of placed tensors: any op of the fuzzed graphs takes them (no transposed, broadcast or
#: overlapping rows, which element-wise kernels refuse or write in no set order).
PLACED_SHAPES = ("contiguous", "one-element", "empty-0", "empty-1", "empty-2", "empty-3", "block-edge", "padded",
                 "negative-unit")
IN_PLACES = ("inside", "misaligned", "at-start", "at-end")


@dataclass(eq=False)
class ConnRef:
    """A fuzzed connection (re-opened when used after it ended: ``incarnation`` counts the openings)."""

    index: int
    incarnation: int = 0

    def __repr__(self) -> str:
        return f"conn{self.index}"


@dataclass(eq=False, frozen=True)
class BufferRef:
    """A buffer the model allocated (model handle and base; the target's are found by relocation)."""

    conn: ConnRef
    incarnation: int
    handle: int
    base: int
    size: int
    device: int

    def __repr__(self) -> str:
        return f"buf({self.conn!r}, {self.size} B)"


@dataclass(eq=False, frozen=True)
class TensorRef:
    """A tensor placed inside a buffer (model addresses)."""

    fields: dict[str, Any]
    buffer: BufferRef
    nbytes: int

    def __repr__(self) -> str:
        return f"tensor(id={self.fields['id']}, {self.nbytes} B in {self.buffer!r})"


@dataclass
class Scope:
    """What the generators may refer to: the version, the devices, the buffers and tensors made so far."""

    protocol: Protocol
    devices: int = 1
    alignment: int = 32
    #: Live buffers and tensors of the connection a request goes to (what valid requests refer to).
    buffers: list[BufferRef] = field(default_factory=list)
    tensors: list[TensorRef] = field(default_factory=list)
    #: Everything made in this example, of any connection, freed or not (what broken ids refer to).
    all_buffers: list[BufferRef] = field(default_factory=list)
    all_tensors: list[TensorRef] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    next_id: int = 1
    #: Let a tensor field now and then be any rpc_tensor at all (False: only known tensors, for tests).
    wild: bool = True

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def buffer_for(self, handle: int) -> BufferRef | None:
        for b in reversed(self.all_buffers):
            if b.handle == handle:
                return b
        return None


@cache
def needs_state(payload: Payload) -> bool:
    """Does a valid request of this payload name a buffer or a tensor (so the connection needs one first)?"""
    if payload.shape is Shape.GRAPH:
        return True
    return any(i.name == "remote_ptr" or is_tensor(i) for i in payload_fields(payload.schema)
               if i.kind in ("int", "struct", "struct_array"))


def is_tensor(info: FieldInfo) -> bool:
    return info.struct is not None and info.struct.sizeof() == RpcTensor.sizeof() and \
        [f.name for f in fields(info.struct)] == [f.name for f in fields(RpcTensor)]


@cache
def payload_fields(schema: Struct) -> tuple[FieldInfo, ...]:
    return tuple(fields(schema))


_NULL = null_tensor()


def known_tensor(d: Draw, scope: Scope) -> dict[str, Any]:
    """Mostly a live tensor of the connection; one time in 32 (or when there is none) any tensor at all."""
    ts = scope.tensors
    if not ts or (scope.wild and d.integer(0, 31) == 31):
        return d.tensor()
    return d.choice(ts).fields


def _tensor_array(d: Draw, scope: Scope, count: int) -> list[dict[str, Any]]:
    """``count`` tensors, null but for the first few (how sources are sent: id 0 = none)."""
    used = d.integer(0, min(2, count)) if scope.tensors else 0
    return [known_tensor(d, scope) for _ in range(used)] + [_NULL] * (count - used)


def _handle(d: Draw, scope: Scope) -> int:
    bs = scope.buffers
    if not bs:
        return d.integer(0, (1 << 64) - 1)
    return d.choice(bs).handle


def _hash(d: Draw, scope: Scope, info: FieldInfo) -> int:
    if scope.hashes and d.integer(0, 1):
        return d.choice(scope.hashes)
    return d.field(info)


FieldDrawer = Callable[[Draw, Scope], Any]
#: COMM_INIT world sizes no server serves (8.0.0 serves two ranks only).
_NO_COMMUNICATOR = (0, 1, 3, 4, 0xFFFFFFFF)


def _drawer(info: FieldInfo) -> FieldDrawer:
    """How one payload field is drawn, chosen once per payload from its name and shape."""
    if info.kind == "struct" and is_tensor(info):
        return known_tensor
    if info.kind == "struct_array" and isinstance(info.count, int) and is_tensor(info):
        count = info.count
        return lambda d, scope: _tensor_array(d, scope, count)
    if info.name == "device":
        return lambda d, scope: d.integer(0, max(0, scope.devices - 1))
    if info.name == "remote_ptr":
        return _handle
    if info.name == "hash":
        return lambda d, scope: _hash(d, scope, info)
    if info.name in ("offset", "size", "n_copies", "stride"):
        return lambda d, scope: 0  # fitted to the tensor afterwards
    if info.name == "uid":
        # 8.0.0 graph uids: a few, so that GRAPH_RECOMPUTE finds what a GRAPH_COMPUTE kept (0: kept nowhere).
        return lambda d, scope: d.integer(0, 4)
    if info.name == "world":
        # A communicator of two ranks waits for its peer (upstream's rank 0: forever); the fuzzer asks only for
        # the ones a server refuses at once.
        return lambda d, scope: d.choice(_NO_COMMUNICATOR)
    if info.name == "rank":
        return lambda d, scope: d.integer(0, 3)
    return lambda d, scope: d.field(info)  # the schema's own full range


@cache
def _drawers(payload: Payload) -> tuple[tuple[str, FieldDrawer], ...]:
    return tuple((info.name, _drawer(info)) for info in payload_fields(payload.schema))


def graph_fields(d: Draw, scope: Scope) -> dict[str, Any]:
    """A small graph: one node computed from up to two known tensors of its shape (sources first, then the node)."""
    device = d.integer(0, max(0, scope.devices - 1))
    if not scope.tensors:
        t = d.tensor()
        return {"device": device, "nodes": [t["id"]], "tensors": [t]}
    out = d.choice(scope.tensors)
    if d.integer(0, 7) == 0:
        return _view_graph(d, scope, out, device)
    # Sources of the same type and shape, so that element-wise ops can run.
    same = [t for t in scope.tensors if t.fields["type"] == out.fields["type"] and t.fields["ne"] == out.fields["ne"]
            and t is not out]
    n_src = d.integer(0, 2) if same else 0
    srcs = [d.choice(same) for _ in range(n_src)]
    node = dict(out.fields)
    node["op"] = d.choice(GRAPH_OPS)
    node["flags"] = _COMPUTE
    node["src"] = [t.fields["id"] for t in srcs] + [0] * (GGML_MAX_SRC - n_src)
    params = [d.integer(-4, 4) for _ in range(d.integer(0, 4))]
    node["op_params"] = params + [0] * (GGML_MAX_OP_PARAMS // 4 - len(params))
    seen = {node["id"]}
    tensors = []
    for t in srcs:
        if t.fields["id"] not in seen:
            seen.add(t.fields["id"])
            tensors.append(t.fields)
    tensors.append(node)
    return {"device": device, "nodes": [node["id"]], "tensors": tensors}


def _view_graph(d: Draw, scope: Scope, base: TensorRef, device: int) -> dict[str, Any]:
    """A graph of one VIEW node over a known tensor: view_offs at its start, inside it, at its end or past it."""
    b = base.buffer
    g = classify(base.fields, Span(b.handle, b.base, b.size), alignment=scope.alignment)
    v = view_of(d, g, id=scope.new_id(), view=d.choice(VIEWS))
    node = dict(v.fields, op=int(GgmlOp.VIEW), flags=_COMPUTE, src=[base.fields["id"]] + [0] * (GGML_MAX_SRC - 1))
    return {"device": device, "nodes": [node["id"]], "tensors": [base.fields, node]}


def valid_request(d: Draw, scope: Scope, command: Command) -> FuzzMessage:
    """A request of ``command`` that a correct server accepts, given what ``scope`` knows (mostly)."""
    payload = scope.protocol.commands[command].request
    if payload.shape is Shape.GRAPH:
        fields_ = graph_fields(d, scope)
        if "uid" in (sc.name for sc in payload.graph_head.subcons):
            fields_["uid"] = d.integer(0, 4)
        return FuzzMessage(command, fields_)
    values = {name: drawer(d, scope) for name, drawer in _drawers(payload)}
    data = None
    tensor = values.get("tensor")
    if tensor is not None and "offset" in values:
        try:
            nbytes = ggml_nbytes(tensor["type"], tensor["ne"], tensor["nb"])
        except (KeyError, ValueError):
            nbytes = 0
        if "n_copies" in values and nbytes == 0:
            # Rows need at least one byte: a tensor of none has no valid 2-D request; another live one has.
            sized = [t for t in scope.tensors if t.nbytes]
            if sized:
                values["tensor"] = tensor = d.choice(sized).fields
                nbytes = ggml_nbytes(tensor["type"], tensor["ne"], tensor["nb"])
        room = min(nbytes, 1 << 20)
        offset = d.integer(0, max(0, room - 1) if "n_copies" in values else room)
        values["offset"] = offset
        if "n_copies" in values:
            data = _fit_rows(d, values, room - offset, payload.shape is Shape.HEADER_DATA)
        else:
            if "size" in values:
                values["size"] = d.integer(0, min(room - offset, MAX_DATA))
            if payload.shape is Shape.HEADER_DATA:
                data = d.binary(min(room - offset, MAX_DATA))
    elif "size" in values:
        values["size"] = alloc_size(d)
    if "src" in values and "dst" in values:
        _fit_copy(values, scope)
    flag = scope.protocol.cache_rule.flag_field
    if flag is not None and flag in values:
        # As a client sends it: 0, and 1 now and then (any other value is the near-valid flag rule's business).
        # Every flagged payload is a cache file written and synced on both sides.
        values[flag] = 1 if d.integer(0, 15) == 15 else 0
    if payload.shape is Shape.HEADER_DATA and data is None:
        data = d.binary(MAX_DATA)
    return FuzzMessage(command, values, data)


def _fit_rows(d: Draw, values: dict[str, Any], room: int, with_data: bool) -> bytes | None:
    """8.0.0 rows that fit ``room`` bytes: 1-4 rows of at least one byte, stride apart (a stride below the row
    size overlaps rows, which servers write in order); the data of SET_TENSOR_2D, ``size * n_copies`` bytes."""
    room = min(room, MAX_DATA)
    rows = d.integer(1, 4)
    size = d.integer(1, max(1, room // rows))
    stride = d.integer(0, max(0, (room - size) // max(1, rows - 1))) if rows > 1 else d.integer(0, 64)
    if room == 0 or (rows - 1) * stride + size > room:
        rows, size, stride = 1, max(1, room), 0  # a tensor of no bytes leaves nothing valid: the server refuses
    values.update(size=size, n_copies=rows, stride=stride)
    if not with_data:
        return None
    n = size * rows
    return (d.binary(n) + bytes(n))[:n]  # exactly the rows' bytes: drawn bytes, zero-padded


def _fit_copy(values: dict[str, Any], scope: Scope) -> None:
    """A copy whose source does not fit after the destination's address becomes a copy of the destination onto
    itself (a server refuses the other: the copy would run past the destination buffer)."""
    known = {t.fields["id"]: t for t in scope.tensors}
    src, dst = known.get(values["src"]["id"]), known.get(values["dst"]["id"])
    if src is None or dst is None or src.fields is not values["src"] or dst.fields is not values["dst"]:
        return
    room = dst.buffer.base + dst.buffer.size - dst.fields["data"]
    if src.nbytes > room:
        values["src"] = values["dst"]


def alloc_size(d: Draw) -> int:
    """Mostly small buffers; 0 (upstream's dummy buffer) and up to 64 KiB now and then."""
    pick = d.integer(0, 7)
    if pick == 0:
        return 0
    if pick == 1:
        return d.integer(4097, 65536)
    return d.integer(1, 4096)


def placed_tensor(d: Draw, scope: Scope, buf: BufferRef, like: TensorRef | None = None) -> TensorRef:
    """A tensor inside ``buf``: mostly contiguous and aligned as the server's alignment asks, one time in four of a
    geometry class (``spec.geometry``: at the buffer's first or last byte, misaligned; one element, empty in a
    dimension, a block per row, padded rows, a negative stride where it moves nothing); ``like``: same type and
    shape."""
    tid = scope.new_id()
    align = max(1, scope.alignment)
    if like is not None and like.nbytes:
        slots = (buf.size - like.nbytes) // align
        if slots >= 0:
            t = dict(like.fields, id=tid, name=encode_name(f"t{tid}"), buffer=buf.handle,
                     data=buf.base + d.integer(0, slots) * align)
            return TensorRef(t, buf, like.nbytes)
    if buf.size and d.integer(0, 3) == 0:
        g = draw_geometry(d, Span(buf.handle, buf.base, buf.size), id=tid, shapes=PLACED_SHAPES, places=IN_PLACES,
                          types=PLACE_TYPES, alignment=align, max_span=min(buf.size, MAX_DATA))
        if g.in_buffer:
            return TensorRef(dict(g.fields, name=encode_name(f"t{tid}")), buf, g.nbytes)
    ttype = d.choice(PLACE_TYPES)
    info = TYPES[ttype]
    blocks_fit = buf.size // info.size
    if blocks_fit == 0:
        fields_ = make_tensor(id=tid, type=ttype, ne=(0, 1, 1, 1), buffer=buf.handle, data=buf.base, name=f"t{tid}")
        return TensorRef(fields_, buf, 0)
    rows = d.integer(1, min(4, blocks_fit))
    blocks = d.integer(1, min(64, blocks_fit // rows))
    ne = (blocks * info.blck, rows)
    probe = make_tensor(id=tid, type=ttype, ne=ne)
    nbytes = ggml_nbytes(ttype, probe["ne"], probe["nb"])
    slots = (buf.size - nbytes) // align
    offset = d.integer(0, max(0, slots)) * align
    t = make_tensor(id=tid, type=ttype, ne=ne, buffer=buf.handle, data=buf.base + offset, name=f"t{tid}")
    return TensorRef(t, buf, nbytes)


# ---- as hypothesis strategies ----------------------------------------------------------------------------------


@st.composite
def valid_requests(draw: st.DrawFn, scope: Scope, command: Command) -> FuzzMessage:
    """Hypothesis strategy of :func:`valid_request` (every choice shrinkable)."""
    return valid_request(HypothesisDraw(draw), scope, command)


@st.composite
def placed_tensors(draw: st.DrawFn, scope: Scope, buf: BufferRef, like: TensorRef | None = None) -> TensorRef:
    """Hypothesis strategy of :func:`placed_tensor`."""
    return placed_tensor(HypothesisDraw(draw), scope, buf, like)
