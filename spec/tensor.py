"""``rpc_tensor``: the 296-byte tensor description that nearly every command carries.

The construct Struct below is the declaration; the fast layouts (``struct`` format and numpy dtype) used on hot
paths are derived from it in :mod:`ggml_rpc.spec.layout`.
"""

from __future__ import annotations

from construct import Array, Bytes, Int32sl, Int32ul, Int64ul, Struct

from .facts import contiguous_strides

GGML_MAX_DIMS = 4
GGML_MAX_OP_PARAMS = 64
GGML_MAX_SRC = 10
GGML_MAX_NAME = 64

RpcTensor = Struct(
    "id" / Int64ul * "the tensor's identity, chosen by the client (genuine clients send the ggml_tensor's address): "
    "any non-zero value, one per tensor of a request; 0 means 'no tensor'",
    "type" / Int32ul * "ggml_type id, as numbered by the server's build; ids >= 43 and removed types are refused",
    "buffer" / Int64ul * "server buffer handle (remote_ptr from ALLOC_BUFFER) or 0; note the unaligned offset",
    "ne" / Array(GGML_MAX_DIMS, Int32ul) * "elements per dimension, innermost first; unused dimensions are 1 (a 0 "
    "makes the tensor empty); 32-bit on the wire (truncated from int64)",
    "nb" / Array(GGML_MAX_DIMS, Int32ul) * "stride in bytes per dimension; contiguous: nb[0] = the type size, nb[1] = "
    "nb[0] * ne[0] / block elements, nb[i] = nb[i-1] * ne[i-1]; 32-bit on the wire",
    "op" / Int32ul * "ggml_op id (as numbered by the server's build) that computes this tensor in GRAPH_COMPUTE; 0 "
    "(NONE) for inputs and in every other request",
    "op_params" / Array(GGML_MAX_OP_PARAMS // 4, Int32sl) * "the op's parameters, 16 x i32 (a float is stored as its "
    "bits); unused ones 0",
    "flags" / Int32sl * "tensor flags: INPUT=1, OUTPUT=2, PARAM=4, LOSS=8, COMPUTE=16; a graph node is computed only "
    "with COMPUTE set",
    "src" / Array(GGML_MAX_SRC, Int64ul) * "ids of the source tensors (the op's operands, in its order; 0 = none)",
    "view_src" / Int64ul * "id of the tensor this one views (0 = none)",
    "view_offs" / Int64ul * "byte offset into view_src",
    "data" / Int64ul * "absolute server address of the tensor's first byte (the buffer's base + an offset), or 0; "
    "[data, data + nbytes) lies inside the buffer",
    "name" / Bytes(GGML_MAX_NAME) * "NUL-padded tensor name (at most 63 characters and a NUL)",
    "use_count" / Int32sl * "GRAPH_COMPUTE: how many src entries of the graph's nodes name this tensor (ggml's count; "
    "the CPU backend fuses on it); 0 elsewhere",
)
RpcTensor.__doc__ = "rpc_tensor: packed, 296 bytes, little-endian."

RPC_TENSOR_SIZE = RpcTensor.sizeof()
assert RPC_TENSOR_SIZE == 296


def tensor_name(raw: bytes) -> str:
    """The printable name of a tensor: bytes up to the first NUL, undecodable bytes replaced."""
    end = raw.find(b"\0")
    return bytes(raw[: end if end >= 0 else len(raw)]).decode("utf-8", "replace")


def encode_name(name: str) -> bytes:
    """A name field as the client writes it: at most 63 bytes of UTF-8, NUL-padded to 64."""
    raw = name.encode("utf-8")[: GGML_MAX_NAME - 1]
    return raw.ljust(GGML_MAX_NAME, b"\0")


def null_tensor() -> dict:
    """A tensor of all zero fields: what the client sends for 'no tensor' (296 zero bytes)."""
    return {
        "id": 0,
        "type": 0,
        "buffer": 0,
        "ne": [0] * GGML_MAX_DIMS,
        "nb": [0] * GGML_MAX_DIMS,
        "op": 0,
        "op_params": [0] * (GGML_MAX_OP_PARAMS // 4),
        "flags": 0,
        "src": [0] * GGML_MAX_SRC,
        "view_src": 0,
        "view_offs": 0,
        "data": 0,
        "name": b"\0" * GGML_MAX_NAME,
        "use_count": 0,
    }


def src_ids(*ids: int) -> list[int]:
    """An rpc_tensor's ``src`` field: the given source ids, then 0 (none) up to GGML_MAX_SRC."""
    return [*ids, *([0] * (GGML_MAX_SRC - len(ids)))]


def make_tensor(
    *,
    id: int,
    type: int = 0,
    ne: tuple[int, ...] = (1, 1, 1, 1),
    nb: tuple[int, ...] | None = None,
    buffer: int = 0,
    data: int = 0,
    op: int = 0,
    op_params: list[int] | None = None,
    flags: int = 0,
    src: list[int] | None = None,
    view_src: int = 0,
    view_offs: int = 0,
    name: str = "",
    use_count: int = 0,
) -> dict:
    """An rpc_tensor dict; ``ne`` is padded with 1s to 4 dims and ``nb`` defaults to ggml's contiguous strides."""
    dims = [*ne, *([1] * (GGML_MAX_DIMS - len(ne)))]
    strides = list(nb) if nb is not None else contiguous_strides(type, dims)
    return {
        "id": id,
        "type": type,
        "buffer": buffer,
        "ne": dims,
        "nb": strides,
        "op": op,
        "op_params": list(op_params or []) + [0] * (GGML_MAX_OP_PARAMS // 4 - len(op_params or [])),
        "flags": flags,
        "src": list(src or []) + [0] * (GGML_MAX_SRC - len(src or [])),
        "view_src": view_src,
        "view_offs": view_offs,
        "data": data,
        "name": encode_name(name),
        "use_count": use_count,
    }
