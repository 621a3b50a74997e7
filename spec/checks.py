"""Content rules of one request that hold whatever the server state: what a decoder can refuse on its own."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from . import schema_walk
from .enums import GGML_TYPE_COUNT, TYPES, Command
from .errors import SpecViolation
from .facts import ggml_nbytes
from .messages import SET_TENSOR_2D_REQ
from .payloads import REQUEST_HEADER_SIZE
from .versions import PROTOCOLS

if TYPE_CHECKING:
    from .codec import Request


def check_tensor(tensor: Mapping[str, Any], *, command: str, field: str, offset: int) -> int:
    """Raise SpecViolation for a tensor every server refuses; return its nbytes."""
    t = tensor["type"]
    if t >= GGML_TYPE_COUNT:
        raise SpecViolation(f"type {t} is not a ggml type (< {GGML_TYPE_COUNT})", command=command,
                            field=f"{field}.type", offset=offset)
    if TYPES[t].removed:
        raise SpecViolation(f"type {t} ({TYPES[t].name}) was removed from ggml", command=command,
                            field=f"{field}.type", offset=offset)
    return ggml_nbytes(t, tensor["ne"], tensor["nb"])


_OFFSETS_CACHE: dict[tuple[Command, tuple[str, ...]], dict[str, int]] = {}


def _field_offset(req: Request, name: str) -> int:
    """Stream offset of a request field (up to the first variable-size one), for error reports only.

    Read from the spec Struct whose field names the request carries: versions differ in their fields (SET_TENSOR
    has cache_flag before offset since v7).
    """
    key = (req.command, tuple(req.fields))
    offsets = _OFFSETS_CACHE.get(key)
    if offsets is None:
        offsets = {}
        for p in PROTOCOLS:
            spec = p.commands.get(req.command)
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
    return req.offset + REQUEST_HEADER_SIZE + offsets.get(name, 0)


def check_request(req: Request) -> None:
    """Content rules of one request that hold whatever the server state (raise SpecViolation)."""
    name = req.command.name
    f = req.fields
    base = req.offset + REQUEST_HEADER_SIZE
    if req.command in (Command.SET_TENSOR, Command.GET_TENSOR, Command.MEMSET_TENSOR):
        nbytes = check_tensor(f["tensor"], command=name, field="tensor", offset=base)
        if req.command is Command.SET_TENSOR:
            n = req.data.nbytes if req.data is not None else 0
        else:
            n = f["size"]
        if n and f["offset"] + n > nbytes:
            raise SpecViolation(
                f"region offset {f['offset']} + {n} bytes runs past the tensor's {nbytes} bytes",
                command=name, field="offset", offset=_field_offset(req, "offset"),
            )
    elif req.command in (Command.SET_TENSOR_2D, Command.GET_TENSOR_2D):
        _check_region_2d(req, check_tensor(f["tensor"], command=name, field="tensor", offset=base))
    elif req.command in (Command.INIT_TENSOR, Command.COMM_ALLREDUCE):
        check_tensor(f["tensor"], command=name, field="tensor", offset=_field_offset(req, "tensor"))
    elif req.command is Command.COPY_TENSOR:
        src = check_tensor(f["src"], command=name, field="src", offset=base)
        check_tensor(f["dst"], command=name, field="dst", offset=_field_offset(req, "dst"))
        dst = ggml_nbytes(f["dst"]["type"], f["dst"]["ne"], f["dst"]["nb"])
        if src > dst:
            raise SpecViolation(f"copies {src} bytes into a {dst}-byte tensor", command=name, field="dst",
                                offset=_field_offset(req, "dst"))
    elif req.command is Command.GRAPH_COMPUTE:
        tensors = f["tensors"]
        if f["n_nodes"] == 0:
            raise SpecViolation("a graph without nodes", command=name, field="n_nodes",
                                offset=_field_offset(req, "n_nodes"))
        if len(tensors) and int(tensors["type"].max()) >= GGML_TYPE_COUNT:
            i = int(np.argmax(tensors["type"] >= GGML_TYPE_COUNT))
            raise SpecViolation(f"tensor {i} has type {int(tensors['type'][i])}", command=name,
                                field=f"tensors[{i}].type", offset=base)
        if np.any(f["nodes"] == 0):
            raise SpecViolation("node id 0 (a null node)", command=name, field="nodes",
                                offset=_field_offset(req, "nodes"))
        known = np.isin(f["nodes"], tensors["id"])
        if not np.all(known):
            i = int(np.argmin(known))
            raise SpecViolation(f"node id {int(f['nodes'][i]):#x} is not among the tensors", command=name,
                                field=f"nodes[{i}]", offset=_field_offset(req, "nodes") + f["nodes"].itemsize * i)


def region_2d_span(size: int, n_copies: int, stride: int) -> int | None:
    """Bytes a 2-D region covers from its first row: ``(n_copies - 1) * stride + size``; None when a count is 0 or
    the span does not fit 64 bits (upstream refuses both)."""
    if size == 0 or n_copies == 0:
        return None
    span = (n_copies - 1) * stride + size
    return span if span < 1 << 64 else None


def _check_region_2d(req: Request, nbytes: int) -> None:
    """SET_TENSOR_2D / GET_TENSOR_2D: non-zero rows, a span that fits the tensor, and (SET) exactly
    ``size * n_copies`` data bytes."""
    f, name = req.fields, req.command.name
    size, n_copies = f["size"], f["n_copies"]
    if size == 0 or n_copies == 0:
        field = "size" if size == 0 else "n_copies"
        raise SpecViolation(f"{field} is 0", command=name, field=field, offset=_field_offset(req, field))
    if req.command is Command.SET_TENSOR_2D:
        # A stream checker forwards the rows without keeping them: their count is what the size claim leaves.
        n = req.data.nbytes if req.data is not None else max(req.size - SET_TENSOR_2D_REQ.header_size, 0)
        if size * n_copies != n:
            raise SpecViolation(f"{n} data bytes, but size {size} x n_copies {n_copies} = {size * n_copies}",
                                command=name, field="size", offset=_field_offset(req, "size"))
    span = region_2d_span(size, n_copies, f["stride"])
    if span is None or f["offset"] + span > nbytes:
        what = "overflows 64 bits" if span is None else f"runs past the tensor's {nbytes} bytes"
        raise SpecViolation(f"rows at offset {f['offset']}, {n_copies} x {size} bytes, stride {f['stride']}: {what}",
                            command=name, field="stride", offset=_field_offset(req, "stride"))
