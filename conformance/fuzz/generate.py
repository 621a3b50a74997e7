"""State-aware valid requests of any command, derived from the payload schemas.

:mod:`ggml_rpc.spec.strategies` gives any message over the full range of every field.  Against a live server
almost all of those are refused at the first check, so the fuzzer steers the fields that name server state
towards that state, by field name and shape as the schemas declare them:

* a field holding an rpc_tensor (``tensor``, ``src``, ``dst``, ``op``) gets a tensor placed in a known buffer
  (sometimes a fully random one), an array of them (``srcs``) mostly null tensors and a few known ones;
* ``device`` is a device index the server has, ``remote_ptr`` a known buffer handle, ``hash`` the hash of data
  sent earlier (or any value);
* ``offset``/``size`` next to a tensor describe a region inside it, bulk data fits that region;
* GRAPH_COMPUTE's counted arrays become a small graph over known tensors.

Every other field keeps its schema-derived strategy, so a command added to a version table is fuzzed as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from construct import Struct
from ggml_rpc.spec import TYPES, Command, GgmlOp, GgmlType, Payload, Protocol, Shape, TensorFlag, ggml_nbytes
from ggml_rpc.spec import strategies as spec_st
from ggml_rpc.spec.schema_walk import FieldInfo, fields
from ggml_rpc.spec.tensor import RpcTensor, make_tensor, null_tensor
from hypothesis import strategies as st

from .message import FuzzMessage

#: Bytes of bulk data at most (SET_TENSOR data; GET_TENSOR and MEMSET regions are bounded by the tensors).
MAX_DATA = 2048
#: Buffer sizes the fuzzer allocates (small: every step stays cheap; 0 is upstream's dummy buffer).
ALLOC_SIZES = st.one_of(st.integers(1, 4096), st.just(0), st.integers(4097, 65536))
#: Types tensors are placed with: plain and block-quantised ones, so nbytes takes both formulas.
PLACE_TYPES = tuple(int(GgmlType[n]) for n in ("F32", "F16", "I32", "I8", "BF16", "Q8_0", "Q4_0", "Q4_K"))
#: Ops of fuzzed graphs: cheap element-wise and layout ops the reference executor runs.
GRAPH_OPS = tuple(int(GgmlOp[n]) for n in ("NONE", "DUP", "ADD", "SUB", "MUL", "DIV", "SQR", "SCALE", "CPY",
                                            "CONT", "RESHAPE", "VIEW"))
_COMPUTE = int(TensorFlag.COMPUTE)


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


def random_tensors() -> st.SearchStrategy[dict[str, Any]]:
    """Any rpc_tensor (every field over its whole range), straight from the schema."""
    return spec_st.tensors()


_RANDOM_TENSOR = random_tensors()
_NULL = null_tensor()


def _known_tensor(draw: st.DrawFn, scope: Scope) -> dict[str, Any]:
    """Mostly a live tensor of the connection; one time in 16 (or when there is none) any tensor at all."""
    ts = scope.tensors
    if not ts or draw(st.integers(0, 15)) == 15:
        return draw(_RANDOM_TENSOR)
    return ts[draw(st.integers(0, len(ts) - 1))].fields


def _tensor_array(draw: st.DrawFn, scope: Scope, count: int) -> list[dict[str, Any]]:
    """``count`` tensors, null but for the first few (how sources are sent: id 0 = none)."""
    used = draw(st.integers(0, min(2, count))) if scope.tensors else 0
    return [_known_tensor(draw, scope) for _ in range(used)] + [_NULL] * (count - used)


def _handle(draw: st.DrawFn, scope: Scope) -> int:
    bs = scope.buffers
    if not bs:
        return draw(st.integers(0, (1 << 64) - 1))
    return bs[draw(st.integers(0, len(bs) - 1))].handle


Drawer = Callable[[st.DrawFn, Scope], Any]


def _drawer(info: FieldInfo) -> Drawer:
    """How one payload field is drawn, chosen once per payload from its name and shape."""
    if info.kind == "struct" and is_tensor(info):
        return _known_tensor
    if info.kind == "struct_array" and isinstance(info.count, int) and is_tensor(info):
        count = info.count
        return lambda draw, scope: _tensor_array(draw, scope, count)
    if info.name == "device":
        return lambda draw, scope: draw(st.integers(0, max(0, scope.devices - 1)))
    if info.name == "remote_ptr":
        return _handle
    if info.name == "hash":
        anything = spec_st.integers(info.fmt)
        return lambda draw, scope: (scope.hashes[draw(st.integers(0, len(scope.hashes) - 1))]
                                    if scope.hashes and draw(st.booleans()) else draw(anything))
    if info.name in ("offset", "size"):
        return lambda draw, scope: 0  # fitted to the tensor afterwards
    derived = spec_st.field_values(info)  # the schema's own strategy (full range)
    return lambda draw, scope: draw(derived)


@cache
def _drawers(payload: Payload) -> tuple[tuple[str, Drawer], ...]:
    return tuple((info.name, _drawer(info)) for info in payload_fields(payload.schema))


@st.composite
def graph_fields(draw: st.DrawFn, scope: Scope) -> dict[str, Any]:
    """A small graph: one node computed from up to three known tensors (sources first, then the node)."""
    device = draw(st.integers(0, max(0, scope.devices - 1)))
    if not scope.tensors:
        t = draw(random_tensors())
        return {"device": device, "nodes": [t["id"]], "tensors": [t]}
    out = draw(st.sampled_from(scope.tensors))
    # Sources of the same type and shape (the node itself included), so element-wise ops can run.
    same = [t for t in scope.tensors if t.fields["type"] == out.fields["type"] and t.fields["ne"] == out.fields["ne"]
            and t is not out]
    n_src = draw(st.integers(0, 2)) if same else 0
    srcs = [draw(st.sampled_from(same)) for _ in range(n_src)]
    node = dict(out.fields)
    node["op"] = draw(st.sampled_from(GRAPH_OPS))
    node["flags"] = _COMPUTE
    node["src"] = [t.fields["id"] for t in srcs] + [0] * (10 - n_src)
    params = draw(st.lists(st.integers(-4, 4), max_size=4))
    node["op_params"] = params + [0] * (16 - len(params))
    seen = {node["id"]}
    tensors = []
    for t in srcs:
        if t.fields["id"] not in seen:
            seen.add(t.fields["id"])
            tensors.append(t.fields)
    tensors.append(node)
    return {"device": device, "nodes": [node["id"]], "tensors": tensors}


@st.composite
def valid_request(draw: st.DrawFn, scope: Scope, command: Command) -> FuzzMessage:
    """A request of ``command`` that a correct server accepts, given what ``scope`` knows (mostly)."""
    payload = scope.protocol.commands[command].request
    if payload.shape is Shape.GRAPH:
        return FuzzMessage(command, draw(graph_fields(scope)))
    values = {name: drawer(draw, scope) for name, drawer in _drawers(payload)}
    data = None
    tensor = values.get("tensor")
    if tensor is not None and "offset" in values:
        try:
            nbytes = ggml_nbytes(tensor["type"], tensor["ne"], tensor["nb"])
        except (KeyError, ValueError):
            nbytes = 0
        room = min(nbytes, 1 << 20)
        offset = draw(st.integers(0, room))
        values["offset"] = offset
        if "size" in values:
            values["size"] = draw(st.integers(0, min(room - offset, MAX_DATA)))
        if payload.shape is Shape.HEADER_DATA:
            data = draw(st.binary(max_size=min(room - offset, MAX_DATA)))
    elif "size" in values:
        values["size"] = draw(ALLOC_SIZES)
    if payload.shape is Shape.HEADER_DATA and data is None:
        data = draw(st.binary(max_size=MAX_DATA))
    return FuzzMessage(command, values, data)


@st.composite
def placed_tensor(draw: st.DrawFn, scope: Scope, buf: BufferRef, like: TensorRef | None = None) -> TensorRef:
    """A contiguous tensor inside ``buf`` (aligned as the server's alignment asks); ``like``: same type and shape."""
    tid = scope.new_id()
    if like is not None and like.nbytes:
        t = dict(like.fields, id=tid, name=f"t{tid}".encode().ljust(64, b"\0"))
        align = max(1, scope.alignment)
        slots = (buf.size - like.nbytes) // align
        if slots >= 0:
            t["data"] = buf.base + draw(st.integers(0, slots)) * align
            t["buffer"] = buf.handle
            return TensorRef(t, buf, like.nbytes)
    ttype = draw(st.sampled_from(PLACE_TYPES))
    info = TYPES[ttype]
    blocks_fit = buf.size // info.size
    if blocks_fit == 0:
        fields_ = make_tensor(id=tid, type=ttype, ne=(0, 1, 1, 1), buffer=buf.handle, data=buf.base, name=f"t{tid}")
        return TensorRef(fields_, buf, 0)
    rows = draw(st.integers(1, min(4, blocks_fit)))
    blocks = draw(st.integers(1, min(64, blocks_fit // rows)))
    ne = (blocks * info.blck, rows)
    probe = make_tensor(id=tid, type=ttype, ne=ne)
    nbytes = ggml_nbytes(ttype, probe["ne"], probe["nb"])
    align = max(1, scope.alignment)
    slots = (buf.size - nbytes) // align
    offset = draw(st.integers(0, max(0, slots))) * align
    t = make_tensor(id=tid, type=ttype, ne=ne, buffer=buf.handle, data=buf.base + offset, name=f"t{tid}")
    return TensorRef(t, buf, nbytes)
