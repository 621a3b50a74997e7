"""The rule table's stateless rules (:mod:`.rules`) as the codec's errors: what a decoder can refuse on its own.

The rules live in the table; this module only turns a broken one into a SpecViolation located in the stream."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from . import schema_walk
from .conditions import region_2d_span, removed_type, unknown_type
from .decoded import Request
from .enums import GGML_TYPE_COUNT, TYPES, Command
from .errors import SpecViolation
from .facts import ggml_nbytes
from .payloads import REQUEST_HEADER_SIZE
from .rules import ConnState, Finding, Message, Rule, first_broken
from .versions import PROTOCOLS


def check_tensor(tensor: Mapping[str, Any], *, command: str, field: str, offset: int) -> int:
    """Raise SpecViolation for a tensor every server refuses; return its nbytes."""
    t = tensor["type"]
    if unknown_type(t):
        raise SpecViolation(f"type {t} is not a ggml type (< {GGML_TYPE_COUNT})", command=command,
                            field=f"{field}.type", offset=offset)
    if removed_type(t):
        raise SpecViolation(f"type {t} ({TYPES[t].name}) was removed from ggml", command=command,
                            field=f"{field}.type", offset=offset)
    return ggml_nbytes(t, tensor["ne"], tensor["nb"])


_OFFSETS_CACHE: dict[tuple[Command, tuple[str, ...]], dict[str, int]] = {}


def field_offset(command: Command, fields: dict[str, Any], offset: int, name: str) -> int:
    """Stream offset of a request field (up to the first variable-size one; ``name`` may be dotted or indexed),
    for error reports only.

    Read from the spec Struct whose field names the request carries: versions differ in their fields (SET_TENSOR
    has cache_flag before offset since v7).
    """
    top = name.split(".", 1)[0]
    item = 0
    if "[" in top:  # an array element: nodes[3] lies 3 ids after nodes[0]
        top, index = top[:-1].split("[", 1)
        array = fields.get(top)
        if isinstance(array, np.ndarray) and array.dtype.names is None:
            item = int(index) * array.itemsize
    key = (command, tuple(fields))
    offsets = _OFFSETS_CACHE.get(key)
    if offsets is None:
        offsets = {}
        for p in PROTOCOLS:
            spec = p.commands.get(command)
            if spec is None or tuple(sub.name for sub in spec.request.schema.subcons) != key[1]:
                continue
            pos = 0
            for info in schema_walk.fields(spec.request.schema):
                offsets[info.name] = pos
                if info.variable:
                    break
                pos += info.length
            break
        _OFFSETS_CACHE[key] = offsets
    return offset + REQUEST_HEADER_SIZE + offsets.get(top, 0) + item


def _message(req: Request) -> Message:
    # The codec holds whole messages: the data length and the first bytes are what a stream checker also knows.
    data_len = req.data.nbytes if req.data is not None and req.command in _DATA_COMMANDS else 0
    return Message(req.command, req.fields, req.index, req.offset, req.size, data_len, req.raw)


_DATA_COMMANDS = frozenset({Command.SET_TENSOR, Command.SET_TENSOR_2D})


def rule_error(rule: Rule, found: Finding, command: Command, fields: dict[str, Any], offset: int, *,
               tag: bool = True) -> SpecViolation:
    """A broken rule as the codec's error: the command, the field and its stream offset, and (``tag``) the rule id
    in front of the text (a checker that reports the id itself leaves it out)."""
    return SpecViolation(f"[{rule.id}] {found.text}" if tag else found.text, command=command.name, field=found.field,
                         offset=field_offset(command, fields, offset, found.field))


def check_request(req: Request) -> None:
    """The table's rules that hold whatever the connection said before (raise SpecViolation for the first broken)."""
    broken = first_broken(_message(req), ConnState(), stateless_only=True)
    if broken is not None:
        raise rule_error(*broken, req.command, req.fields, req.offset)


__all__ = ["check_request", "check_tensor", "field_offset", "region_2d_span", "rule_error"]
