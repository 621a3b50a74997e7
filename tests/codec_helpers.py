"""Helpers shared by the codec tests: the construct path of a payload, and normalising codec output to it."""

from __future__ import annotations

from typing import Any

import numpy as np
from construct import Container, ListContainer
from ggml_rpc.spec import Payload, Shape
from ggml_rpc.spec.layout import record_to_dict
from hypothesis import strategies as st


def plain(value: Any) -> Any:
    """construct's Containers as plain dicts/lists (without the ``_io`` bookkeeping key)."""
    if isinstance(value, Container | dict):
        return {k: plain(v) for k, v in value.items() if not k.startswith("_")}
    if isinstance(value, ListContainer | list):
        return [plain(v) for v in value]
    return value


def codec_plain(fields: dict[str, Any]) -> dict[str, Any]:
    """Codec fields in construct's shape: numpy node ids and tensor arrays become lists and dicts."""
    out: dict[str, Any] = {}
    for key, value in fields.items():
        if isinstance(value, np.ndarray):
            out[key] = [record_to_dict(r) for r in value] if value.dtype.names else [int(x) for x in value]
        else:
            out[key] = plain(value)
    return out


def construct_build(payload: Payload, fields: dict[str, Any], data: bytes | None) -> bytes:
    """Payload bytes built by interpreted construct (the declaration itself), bulk data appended."""
    if payload.shape is Shape.RAW:
        return data or b""
    return payload.schema.build(fields) + (data or b"")


def construct_parse(payload: Payload, raw: bytes) -> tuple[dict[str, Any], bytes | None]:
    """(fields, bulk data) parsed by interpreted construct."""
    if payload.shape is Shape.RAW:
        return {}, raw
    parsed = payload.schema.parse(raw)
    used = len(payload.schema.build(parsed))
    if payload.shape is Shape.FIXED:
        assert used == len(raw)
        return plain(parsed), None
    rest = raw[used:]
    if payload.shape is Shape.GRAPH and not rest:
        return plain(parsed), None
    return plain(parsed), rest


def chunks(data: bytes, sizes: list[int]) -> list[bytes]:
    """``data`` cut into pieces whose lengths cycle through ``sizes``."""
    out, pos, i = [], 0, 0
    while pos < len(data):
        n = sizes[i % len(sizes)]
        out.append(data[pos : pos + n])
        pos += n
        i += 1
    return out


chunk_sizes = st.lists(st.integers(1, 700), min_size=1, max_size=12)
