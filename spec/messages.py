"""Request and reply payloads of every command, declared once as construct Structs.

A payload is one of four shapes (:class:`Shape`):

* ``FIXED``: exactly ``schema.sizeof()`` bytes; a server closes on any other size;
* ``HEADER_DATA``: a fixed header followed by bulk bytes that run to the end of the payload (SET_TENSOR);
* ``GRAPH``: GRAPH_COMPUTE's fixed head (device; 8.0.0 adds a graph uid), then counted node ids and tensors
  (trailing bytes are tolerated by servers);
* ``RAW``: bulk bytes only, whose length the paired request names (GET_TENSOR's reply: ``size``; GET_TENSOR_2D's:
  ``size * n_copies``).

The per-version tables in :mod:`ggml_rpc.spec.versions` pick from these declarations.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import cached_property

from construct import Array, Bytes, Int8ul, Int32ul, Int64ul, Struct, this

from .facts import CONN_CAPS_SIZE
from .tensor import GGML_MAX_SRC, RpcTensor


class Shape(enum.Enum):
    FIXED = "fixed"
    HEADER_DATA = "header+data"
    GRAPH = "graph"
    RAW = "raw"


@dataclass(frozen=True)
class Payload:
    """The layout of one request or reply payload."""

    shape: Shape
    schema: Struct
    doc: str
    #: For RAW replies: the request fields whose product is the reply's length.
    length_from: tuple[str, ...] = ()

    @cached_property
    def header_size(self) -> int:
        """Bytes of the fixed part (the whole payload for FIXED, the header for HEADER_DATA, 0 for RAW, the head
        and both counts for GRAPH: the smallest graph).

        Cached: construct computes a Struct's size by walking it on every call, and servers ask per connection.
        """
        if self.shape is Shape.RAW:
            return 0
        if self.shape is Shape.GRAPH:
            return self.graph_head.sizeof() + 8
        return self.schema.sizeof()

    @cached_property
    def graph_head(self) -> Struct:
        """GRAPH payloads: the fixed fields before ``n_nodes`` (device; device and uid from 8.0.0)."""
        names = [sc.name for sc in self.schema.subcons]
        return Struct(*self.schema.subcons[: names.index("n_nodes")])

    def reply_length(self, request_fields: dict) -> int:
        """RAW replies: the length the request's fields name (their product)."""
        n = 1
        for name in self.length_from or ("size",):
            n *= int(request_fields[name])
        return n


class _NoReply:
    """Marks a command that has no reply at all: not even a size header."""

    _instance: _NoReply | None = None

    def __new__(cls) -> _NoReply:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "NO_REPLY"

    def __bool__(self) -> bool:
        return False


NO_REPLY = _NoReply()


def fixed(doc: str, *fields) -> Payload:
    return Payload(Shape.FIXED, Struct(*fields), doc)


# ---- shared request shapes -------------------------------------------------------------------------------------

DEVICE_REQ = fixed("device index", "device" / Int32ul * "device index, 0 .. DEVICE_COUNT-1")
BUFFER_REQ = fixed("buffer handle", "remote_ptr" / Int64ul * "buffer handle from ALLOC_BUFFER")
U64_REPLY_DOC = "one u64"

ALLOC_BUFFER_REQ = fixed(
    "allocate a buffer on a device",
    "device" / Int32ul * "device index",
    "size" / Int64ul * "bytes requested",
)
ALLOC_BUFFER_REPLY = fixed(
    "the new buffer",
    "remote_ptr" / Int64ul * "buffer handle; 0 means the allocation failed",
    "remote_size" / Int64ul * "bytes actually allocated",
)
GET_ALIGNMENT_REPLY = fixed("buffer alignment", "alignment" / Int64ul * "alignment of the device's buffer type")
GET_MAX_SIZE_REPLY = fixed("largest buffer", "max_size" / Int64ul * "largest buffer the device allocates")
BUFFER_GET_BASE_REPLY = fixed("buffer base", "base_ptr" / Int64ul * "absolute address of the buffer's first byte")
BUFFER_CLEAR_REQ = fixed(
    "fill a whole buffer",
    "remote_ptr" / Int64ul * "buffer handle",
    "value" / Int8ul * "byte written to every byte of the buffer",
)

SET_TENSOR_V6_REQ = Payload(
    Shape.HEADER_DATA,
    Struct(
        "tensor" / RpcTensor * "destination tensor",
        "offset" / Int64ul * "byte offset from tensor.data",
    ),
    "write bytes into a tensor; the data runs to the end of the payload",
)
SET_TENSOR_V7_REQ = Payload(
    Shape.HEADER_DATA,
    Struct(
        "tensor" / RpcTensor * "destination tensor",
        "cache_flag" / Int8ul * "non-zero: the server saves this payload in its hash cache (v7 client: only after "
        "a SET_TENSOR_HASH miss for a weight)",
        "offset" / Int64ul * "byte offset from tensor.data (unaligned, at 297)",
    ),
    "write bytes into a tensor; the data runs to the end of the payload",
)
SET_TENSOR_HASH_REQ = fixed(
    "fill a tensor from the server's hash cache",
    "tensor" / RpcTensor * "destination tensor",
    "offset" / Int64ul * "byte offset from tensor.data",
    "hash" / Int64ul * "FNV-1a-64 of the data",
)
RESULT_REPLY = fixed("outcome", "result" / Int8ul * "1 = done (hit / copied), 0 = not done (miss / declined)")
GET_TENSOR_REQ = fixed(
    "read bytes from a tensor",
    "tensor" / RpcTensor * "source tensor",
    "offset" / Int64ul * "byte offset from tensor.data",
    "size" / Int64ul * "bytes to read",
)
GET_TENSOR_REPLY = Payload(Shape.RAW, Struct(), "the requested bytes, exactly request.size of them", ("size",))
COPY_TENSOR_REQ = fixed(
    "copy a tensor into another",
    "src" / RpcTensor * "source tensor (nbytes(src) bytes are copied)",
    "dst" / RpcTensor * "destination tensor",
)

GRAPH_COMPUTE_REQ = Payload(
    Shape.GRAPH,
    Struct(
        "device" / Int32ul * "device index",
        "n_nodes" / Int32ul * "number of node ids",
        "nodes" / Array(this.n_nodes, Int64ul) * "ids of the tensors to compute, in execution order (each also in "
        "tensors)",
        "n_tensors" / Int32ul * "number of tensors",
        "tensors" / Array(this.n_tensors, RpcTensor) * "each node and every tensor reachable from the nodes "
        "through src and view_src, in any order",
    ),
    "compute a graph; 12 + 8*n_nodes + 296*n_tensors bytes",
)
#: The smallest GRAPH_COMPUTE of 6.0.0 and 7.0.x (device, n_nodes, n_tensors); 8.0.0's is 20.
GRAPH_MIN_SIZE = GRAPH_COMPUTE_REQ.header_size
GET_DEVICE_MEMORY_REPLY = fixed(
    "device memory",
    "free_mem" / Int64ul * "free bytes",
    "total_mem" / Int64ul * "total bytes",
)
INIT_TENSOR_REQ = fixed("let the backend initialise a tensor", "tensor" / RpcTensor * "tensor to initialise")
_OP_WITH_SRCS = (
    "device" / Int32ul * "device index",
    "tensor" / RpcTensor * "the tensor (op node)",
    "srcs" / Array(GGML_MAX_SRC, RpcTensor) * "its sources; id 0 = none",
)
GET_ALLOC_SIZE_REQ = fixed("bytes the backend needs for a tensor", *_OP_WITH_SRCS)
GET_ALLOC_SIZE_REPLY = fixed("allocation size", "alloc_size" / Int64ul * "bytes to allocate for the tensor")
HELLO_REQ = fixed("handshake, first command of every connection", "conn_caps" / Bytes(CONN_CAPS_SIZE) * "client caps")
HELLO_REPLY = fixed(
    "server version and caps",
    "major" / Int8ul * "RPC_PROTO_MAJOR_VERSION of the server",
    "minor" / Int8ul * "RPC_PROTO_MINOR_VERSION",
    "patch" / Int8ul * "RPC_PROTO_PATCH_VERSION",
    "pad" / Int8ul * "always 0",
    "conn_caps" / Bytes(CONN_CAPS_SIZE) * "server caps; all zero over plain TCP",
)
EMPTY_REQ = fixed("no payload")
DEVICE_COUNT_REPLY = fixed("number of devices", "device_count" / Int32ul * "devices this server exposes")
MEMSET_TENSOR_REQ = fixed(
    "fill part of a tensor with one byte",
    "tensor" / RpcTensor * "destination tensor",
    "offset" / Int64ul * "byte offset from tensor.data",
    "size" / Int64ul * "bytes to fill",
    "value" / Int8ul * "byte value",
)
SUPPORTS_OP_REQ = Payload(
    Shape.FIXED,
    Struct(
        "device" / Int32ul * "device index",
        "op" / RpcTensor * "the op node",
        "srcs" / Array(GGML_MAX_SRC, RpcTensor) * "its sources; id 0 = none",
    ),
    "ask whether a device supports an op",
)
SUPPORTS_OP_REPLY = fixed("support", "supported" / Int8ul * "1 = supported, 0 = not")


# ---- 8.0.0 ------------------------------------------------------------------------------------------------------

GRAPH_UID_DOC = ("graph uid chosen by the client; non-zero: the server keeps the graph under (device, uid) for "
                 "GRAPH_RECOMPUTE (its cache per device is emptied when it holds GRAPH_CACHE_MAX graphs); 0: not kept")
GRAPH_COMPUTE_V8_REQ = Payload(
    Shape.GRAPH,
    Struct(
        "device" / Int32ul * "device index",
        "uid" / Int64ul * GRAPH_UID_DOC,
        "n_nodes" / Int32ul * "number of node ids",
        "nodes" / Array(this.n_nodes, Int64ul) * "ids of the tensors to compute, in execution order (each also in "
        "tensors)",
        "n_tensors" / Int32ul * "number of tensors",
        "tensors" / Array(this.n_tensors, RpcTensor) * "each node and every tensor reachable from the nodes "
        "through src and view_src, in any order",
    ),
    "compute a graph (asynchronously: commands that touch buffer data wait for it); 20 + 8*n_nodes + "
    "296*n_tensors bytes",
)
GRAPH_RECOMPUTE_V8_REQ = fixed(
    "a stored graph",
    "device" / Int32ul * "device index",
    "uid" / Int64ul * "uid the graph was computed under (GRAPH_COMPUTE)",
)
_REGION_2D = (
    "offset" / Int64ul * "byte offset from tensor.data of the first row",
    "size" / Int64ul * "bytes per row (non-zero)",
    "n_copies" / Int64ul * "number of rows (non-zero)",
    "stride" / Int64ul * "bytes from one row's start to the next in the tensor",
)
SET_TENSOR_2D_REQ = Payload(
    Shape.HEADER_DATA,
    Struct("tensor" / RpcTensor * "destination tensor", *_REGION_2D),
    "write n_copies rows of size bytes, stride apart; the data (exactly size * n_copies bytes, rows packed) runs "
    "to the end of the payload",
)
GET_TENSOR_2D_REQ = fixed("read n_copies rows of size bytes, stride apart", "tensor" / RpcTensor * "source tensor",
                          *_REGION_2D)
GET_TENSOR_2D_REPLY = Payload(Shape.RAW, Struct(), "the rows, packed: exactly request.size * request.n_copies bytes",
                              ("size", "n_copies"))
COMM_HOST_SIZE = 64
COMM_INIT_REQ = fixed(
    "join a two-server communicator (tensor split)",
    "device" / Int32ul * "device index",
    "rank" / Int32ul * "this server's rank, 0 or 1",
    "world" / Int32ul * "number of ranks; only 2 is served",
    "port" / Int32ul * "rank 0: the port it listens on for its peer; rank 1: rank 0's port",
    "host" / Bytes(COMM_HOST_SIZE) * "rank 1: rank 0's host, NUL-padded; rank 0: unused",
)
COMM_INIT_REPLY = fixed("outcome", "ok" / Int8ul * "1 = joined (or already joined), 0 = not")
COMM_ALLREDUCE_REQ = fixed(
    "add the peer's copy of a tensor to this one (sum over both ranks, in place)",
    "device" / Int32ul * "device index",
    "tensor" / RpcTensor * "the partial result, overwritten by the sum",
)
