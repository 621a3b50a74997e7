"""Payload bytes to and from fields, one message at a time: the encoders and the whole-payload decoder.

Fixed parts are packed and unpacked through the flat layouts derived from the construct declarations (never
compiled construct); GRAPH_COMPUTE's node ids and tensors go to and from numpy arrays in one step, so a large graph is
never walked field by field.  Bulk data is passed through as it is, never copied.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from .enums import Command, command_name
from .errors import EncodeError, ProtocolError, SizeMismatch, UnknownCommand
from .layout import flat_layout, numpy_dtype
from .messages import Payload, Shape
from .tensor import RPC_TENSOR_SIZE, RpcTensor
from .versions import Protocol

#: Default cap on a single payload claim (4 GiB): above it a decoder refuses instead of allocating.
DEFAULT_MAX_PAYLOAD = 1 << 32

REQUEST_HEADER = struct.Struct("<BQ")
REPLY_HEADER = struct.Struct("<Q")
REQUEST_HEADER_SIZE = REQUEST_HEADER.size  # 9
REPLY_HEADER_SIZE = REPLY_HEADER.size  # 8

#: numpy dtype of one rpc_tensor, derived from the construct Struct.
TENSOR_DTYPE = numpy_dtype(RpcTensor)
TENSOR_LAYOUT = flat_layout(RpcTensor)

Buffer = bytes | bytearray | memoryview


def tensors_array(tensors: Iterable[Mapping[str, Any]] | np.ndarray) -> np.ndarray:
    """A structured array of rpc_tensors from dicts (or the array itself)."""
    if isinstance(tensors, np.ndarray):
        if tensors.dtype != TENSOR_DTYPE:
            raise TypeError("tensor array has the wrong dtype")
        return tensors
    items = list(tensors)
    buf = bytearray(RPC_TENSOR_SIZE * len(items))
    for i, t in enumerate(items):
        TENSOR_LAYOUT.pack_into(buf, i * RPC_TENSOR_SIZE, t)
    return np.frombuffer(buf, dtype=TENSOR_DTYPE).copy() if items else np.zeros(0, TENSOR_DTYPE)


def encode_payload(payload: Payload, fields: Mapping[str, Any] | None, data: Buffer | None = None) -> list[Buffer]:
    """The payload bytes of one message, as parts (bulk data is passed through, not copied)."""
    fields = fields or {}
    if payload.shape is Shape.FIXED:
        return [flat_layout(payload.schema).pack(dict(fields))]
    if payload.shape is Shape.HEADER_DATA:
        head = flat_layout(payload.schema).pack(dict(fields))
        return [head, data] if data is not None and len(data) else [head]
    if payload.shape is Shape.RAW:
        return [data if data is not None else b""]
    nodes = np.asarray(fields["nodes"], dtype="<u8")
    tensors = tensors_array(fields["tensors"])
    parts: list[Buffer] = [
        flat_layout(payload.graph_head).pack(dict(fields)) + struct.pack("<I", len(nodes)),
        nodes.tobytes(),
        struct.pack("<I", len(tensors)),
        tensors.tobytes(),
    ]
    if data is not None and len(data):
        parts.append(data)
    return parts


def _encode_checked(
    payload: Payload, fields: Mapping[str, Any] | None, data: Buffer | None, command: Command | int
) -> list[Buffer]:
    """encode_payload with a typed error naming the command for values that do not fit their fields."""
    try:
        return encode_payload(payload, fields, data)
    except (struct.error, OverflowError, KeyError, TypeError, ValueError) as exc:
        missing = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
        raise EncodeError(f"cannot encode: {missing}", command=command_name(command)) from exc


def _parts_size(parts: Sequence[Buffer]) -> int:
    return sum(memoryview(p).nbytes for p in parts)


def request_parts(
    protocol: Protocol, command: Command | int, fields: Mapping[str, Any] | None = None, data: Buffer | None = None
) -> list[Buffer]:
    """A request as a list of buffers for ``sendmsg`` (header first, bulk data not copied)."""
    spec = protocol.spec(command)
    if spec is None:
        raise UnknownCommand(f"not a command of protocol {protocol.label}", command=command_name(command))
    body = _encode_checked(spec.request, fields, data, command)
    return [REQUEST_HEADER.pack(protocol.wire_id(spec.command), _parts_size(body)), *body]


def encode_request(
    protocol: Protocol, command: Command | int, fields: Mapping[str, Any] | None = None, data: Buffer | None = None
) -> bytes:
    """The bytes of one request."""
    parts = request_parts(protocol, command, fields, data)
    return b"".join(bytes(p) if isinstance(p, memoryview) else p for p in parts)


def reply_parts(
    protocol: Protocol, command: Command | int, fields: Mapping[str, Any] | None = None, data: Buffer | None = None
) -> list[Buffer]:
    """A reply as a list of buffers; raises for a command that has no reply in this version."""
    spec = protocol.spec(command)
    if spec is None or not spec.has_reply:
        raise ProtocolError(f"has no reply in protocol {protocol.label}", command=command_name(command))
    assert isinstance(spec.reply, Payload)
    body = _encode_checked(spec.reply, fields, data, command)
    return [REPLY_HEADER.pack(_parts_size(body)), *body]


def encode_reply(
    protocol: Protocol, command: Command | int, fields: Mapping[str, Any] | None = None, data: Buffer | None = None
) -> bytes:
    """The bytes of one reply (size header and payload)."""
    parts = reply_parts(protocol, command, fields, data)
    return b"".join(bytes(p) if isinstance(p, memoryview) else p for p in parts)


def decode_payload(payload: Payload, buf: memoryview, *, command: str, base: int = 0) -> tuple[dict, memoryview | None]:
    """Decode one complete payload; ``base`` is its offset in the stream (for error messages)."""
    size = buf.nbytes
    if payload.shape is Shape.FIXED:
        layout = flat_layout(payload.schema)
        if size != layout.size:
            raise SizeMismatch(f"payload is {size} bytes, the layout needs exactly {layout.size}", command=command,
                               field="size", offset=base)
        return layout.unpack(buf), None
    if payload.shape is Shape.HEADER_DATA:
        layout = flat_layout(payload.schema)
        if size < layout.size:
            raise SizeMismatch(f"payload is {size} bytes, shorter than its {layout.size}-byte header",
                               command=command, field="size", offset=base)
        return layout.unpack(buf), buf[layout.size :]
    if payload.shape is Shape.RAW:
        return {}, buf
    return _decode_graph(payload, buf, command=command, base=base)


def _decode_graph(payload: Payload, buf: memoryview, *, command: str, base: int) -> tuple[dict, memoryview | None]:
    size = buf.nbytes
    head = flat_layout(payload.graph_head)
    start = head.size + 4
    if size < start:
        names = ", ".join(sc.name for sc in payload.graph_head.subcons)
        raise SizeMismatch(f"payload is {size} bytes; {names} and n_nodes need {start}", command=command,
                           field="n_nodes", offset=base)
    fields = head.unpack(buf[: head.size])
    (n_nodes,) = struct.unpack_from("<I", buf, head.size)
    nodes_end = start + 8 * n_nodes
    if size < nodes_end + 4:
        raise SizeMismatch(f"payload is {size} bytes; {n_nodes} node ids and n_tensors need {nodes_end + 4}",
                           command=command, field="nodes", offset=base + 8)
    (n_tensors,) = struct.unpack_from("<I", buf, nodes_end)
    end = nodes_end + 4 + RPC_TENSOR_SIZE * n_tensors
    if size < end:
        raise SizeMismatch(f"payload is {size} bytes; {n_tensors} tensors need {end}", command=command,
                           field="tensors", offset=base + nodes_end + 4)
    nodes = np.frombuffer(buf, dtype="<u8", count=n_nodes, offset=start)
    tensors = np.frombuffer(buf, dtype=TENSOR_DTYPE, count=n_tensors, offset=nodes_end + 4)
    fields |= {"n_nodes": n_nodes, "nodes": nodes, "n_tensors": n_tensors, "tensors": tensors}
    return fields, (buf[end:] if size > end else None)
