"""Hypothesis strategies derived from the construct schemas: any message of any version, for free.

Every strategy here is computed by walking a Struct (:mod:`ggml_rpc.spec.schema_walk`): integer fields over their
full range, fixed arrays, byte strings, nested Structs, counted arrays (whose count field is then set from the
drawn array, so GRAPH_COMPUTE's ``n_nodes``/``n_tensors`` always agree with its lists).  Adding a command to a
version table gives it request and reply strategies without touching this module.

Extension point for "near-valid, break-one-rule" strategies: every builder takes ``overrides``, a mapping from a
dotted field path to the strategy to use instead of the derived one.  Paths are relative to the payload:
``"offset"``, ``"tensor.type"``, ``"srcs.type"`` (every element of an array of Structs), ``"tensors.ne"``.  An
override of a count field (``"n_nodes"``) replaces the derived count, which is how a lying count is made.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from construct import Struct
from hypothesis import strategies as st

from .enums import Command
from .messages import NO_REPLY, Payload, Shape
from .schema_walk import FieldInfo, count_fields, fields, int_range
from .tensor import RpcTensor
from .versions import Protocol

Strategy = st.SearchStrategy
Overrides = Mapping[str, Strategy]

#: Default upper bound of a counted array (GRAPH_COMPUTE nodes/tensors): keeps examples small and fast.
DEFAULT_MAX_COUNT = 4
#: Default upper bound of bulk data (SET_TENSOR data, GET_TENSOR replies).
DEFAULT_MAX_DATA = 64


@dataclass(frozen=True)
class MessageValues:
    """A request or reply as values: what ``encode_request``/``encode_reply`` take."""

    command: Command
    fields: dict[str, Any]
    data: bytes | None = None


def integers(fmt: str) -> Strategy[int]:
    """Every value of a struct integer format character."""
    lo, hi = int_range(fmt)
    return st.integers(lo, hi)


def field_values(
    info: FieldInfo,
    *,
    path: str = "",
    overrides: Overrides | None = None,
    max_count: int = DEFAULT_MAX_COUNT,
) -> Strategy[Any]:
    """The derived strategy of one field (``path`` is its dotted path, for overrides of nested fields)."""
    overrides = overrides or {}
    path = path or info.name
    if path in overrides:
        return overrides[path]
    if info.kind == "int":
        return integers(info.fmt)
    if info.kind == "bytes":
        return st.binary(min_size=info.length, max_size=info.length)
    if info.kind == "struct":
        assert info.struct is not None
        return struct_values(info.struct, overrides=overrides, prefix=path + ".", max_count=max_count)
    if info.kind == "array":
        elem: Strategy[Any] = integers(info.fmt)
    else:
        assert info.struct is not None
        elem = struct_values(info.struct, overrides=overrides, prefix=path + ".", max_count=max_count)
    if isinstance(info.count, int):
        return st.lists(elem, min_size=info.count, max_size=info.count)
    return st.lists(elem, max_size=max_count)


def struct_values(
    schema: Struct,
    *,
    overrides: Overrides | None = None,
    prefix: str = "",
    max_count: int = DEFAULT_MAX_COUNT,
) -> Strategy[dict[str, Any]]:
    """Dicts that ``schema.build`` accepts, one key per field; count fields agree with their arrays."""
    overrides = overrides or {}
    infos = fields(schema)
    counted = count_fields(schema)  # count field -> array field
    parts = {
        f.name: field_values(f, path=prefix + f.name, overrides=overrides, max_count=max_count)
        for f in infos
        if f.name not in counted or prefix + f.name in overrides
    }
    names = [f.name for f in infos]

    def complete(drawn: dict[str, Any]) -> dict[str, Any]:
        for count_name, array_name in counted.items():
            if count_name not in drawn:
                drawn[count_name] = len(drawn[array_name])
        return {name: drawn[name] for name in names}

    return st.fixed_dictionaries(parts).map(complete)


def tensors(overrides: Overrides | None = None) -> Strategy[dict[str, Any]]:
    """Any rpc_tensor (every field over its full range); overrides use paths such as ``"type"``."""
    return struct_values(RpcTensor, overrides=overrides)


def payload_values(
    payload: Payload,
    *,
    overrides: Overrides | None = None,
    max_count: int = DEFAULT_MAX_COUNT,
    max_data: int = DEFAULT_MAX_DATA,
) -> Strategy[tuple[dict[str, Any], bytes | None]]:
    """(fields, data) of one payload: data is the bulk part (None for payloads without one)."""
    overrides = overrides or {}
    if payload.shape is Shape.RAW:
        data = overrides.get("data", st.binary(max_size=max_data))
        return st.tuples(st.just({}), data)
    values = struct_values(payload.schema, overrides=overrides, max_count=max_count)
    if payload.shape is Shape.FIXED:
        return st.tuples(values, st.none())
    if payload.shape is Shape.HEADER_DATA:
        return st.tuples(values, overrides.get("data", st.binary(max_size=max_data)))
    # GRAPH: servers ignore trailing bytes; the codec hands them back as data.
    trailing = overrides.get("data", st.one_of(st.none(), st.binary(min_size=1, max_size=16)))
    return st.tuples(values, trailing)


def _commands(protocol: Protocol, command: Command | int | None, *, with_reply: bool) -> list[Command]:
    if command is not None:
        spec = protocol.spec(command)
        if spec is None:
            raise KeyError(f"command {command} is not in protocol {protocol.label}")
        if with_reply and not spec.has_reply:
            raise KeyError(f"{spec.command.name} has no reply in protocol {protocol.label}")
        return [spec.command]
    return [c for c, s in protocol.commands.items() if s.has_reply or not with_reply]


def requests(
    protocol: Protocol,
    command: Command | int | None = None,
    *,
    overrides: Overrides | None = None,
    max_count: int = DEFAULT_MAX_COUNT,
    max_data: int = DEFAULT_MAX_DATA,
) -> Strategy[MessageValues]:
    """Requests of ``protocol`` (of one command, or of any command of the table)."""

    def one(cmd: Command) -> Strategy[MessageValues]:
        payload = protocol.commands[cmd].request
        values = payload_values(payload, overrides=overrides, max_count=max_count, max_data=max_data)
        return values.map(lambda fd: MessageValues(cmd, fd[0], fd[1]))

    return st.one_of([one(c) for c in _commands(protocol, command, with_reply=False)])


def replies(
    protocol: Protocol,
    command: Command | int | None = None,
    *,
    overrides: Overrides | None = None,
    max_data: int = DEFAULT_MAX_DATA,
) -> Strategy[MessageValues]:
    """Replies of ``protocol`` (only commands that have one)."""

    def one(cmd: Command) -> Strategy[MessageValues]:
        payload = protocol.commands[cmd].reply
        assert isinstance(payload, Payload)
        values = payload_values(payload, overrides=overrides, max_data=max_data)
        return values.map(lambda fd: MessageValues(cmd, fd[0], fd[1]))

    return st.one_of([one(c) for c in _commands(protocol, command, with_reply=True)])


def exchanges(
    protocol: Protocol,
    command: Command | int | None = None,
    *,
    max_count: int = DEFAULT_MAX_COUNT,
    max_data: int = DEFAULT_MAX_DATA,
) -> Strategy[tuple[MessageValues, MessageValues | None]]:
    """(request, reply or None) pairs that belong together.

    A reply whose length a request field names (GET_TENSOR) gets that field set to the drawn reply's length.
    """

    @st.composite
    def one(draw: st.DrawFn, cmd: Command) -> tuple[MessageValues, MessageValues | None]:
        spec = protocol.commands[cmd]
        if spec.reply is NO_REPLY:
            req = draw(requests(protocol, cmd, max_count=max_count, max_data=max_data))
            return req, None
        assert isinstance(spec.reply, Payload)
        reply = draw(replies(protocol, cmd, max_data=max_data))
        overrides = {}
        if spec.reply.length_from:
            # The reply's length is the product of these request fields: the first takes it all, the rest are 1.
            assert reply.data is not None
            first, *rest = spec.reply.length_from
            overrides[first] = st.just(len(reply.data))
            overrides |= {name: st.just(1) for name in rest}
        req = draw(requests(protocol, cmd, overrides=overrides, max_count=max_count, max_data=max_data))
        return req, reply

    return st.one_of([one(c) for c in _commands(protocol, command, with_reply=False)])
