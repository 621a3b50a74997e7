"""The reference server refuses a request for one of the rule table's reasons exactly when the table finds that rule
broken: both decide by the same condition (``spec.conditions``), so each case below, one breaking a rule and one at
its edge that breaks nothing, gets the same answer from the table (``first_broken``) and from the core (the rule id
its :class:`Close` carries, or no close at all)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from ggml_rpc.reference import ServerCore, make_config
from ggml_rpc.reference.closing import REFUSED_RULES, Close
from ggml_rpc.spec import V8, Command, GgmlType, encode_request, make_tensor
from ggml_rpc.spec.codec import RequestDecoder
from ggml_rpc.spec.rules import BY_ID, ConnState, Message, first_broken

C = Command
HELLO = encode_request(V8, C.HELLO, {"conn_caps": bytes(24)})
#: The tensor every case names: 256 one-byte elements at the start of a 4 KiB buffer, so a region past the tensor
#: still lies inside the buffer (the buffer bound is the server's state, not the table's).
TENSOR_BYTES, BUFFER_BYTES = 256, 4096
ROW0 = {"offset": 0, "size": 16, "n_copies": 4, "stride": 64}

#: (case name, command, fields given the tensor, bulk data)
Case = tuple[str, Command, Callable[[dict], dict], bytes]


def _typed(t: dict, type_id: int) -> dict:
    return {**t, "type": type_id}


CASES: list[Case] = [
    ("unknown type", C.GET_TENSOR, lambda t: {"tensor": _typed(t, 99), "offset": 0, "size": 4}, b""),
    ("a known type", C.GET_TENSOR, lambda t: {"tensor": t, "offset": 0, "size": 4}, b""),
    ("removed type", C.GET_TENSOR, lambda t: {"tensor": _typed(t, 4), "offset": 0, "size": 4}, b""),
    ("get past the tensor", C.GET_TENSOR, lambda t: {"tensor": t, "offset": 200, "size": 100}, b""),
    ("get to the tensor's end", C.GET_TENSOR, lambda t: {"tensor": t, "offset": 156, "size": 100}, b""),
    ("set past the tensor", C.SET_TENSOR, lambda t: {"tensor": t, "offset": 250, "cache_flag": 0}, bytes(10)),
    ("set to the tensor's end", C.SET_TENSOR, lambda t: {"tensor": t, "offset": 246, "cache_flag": 0}, bytes(10)),
    ("memset past the tensor", C.MEMSET_TENSOR, lambda t: {"tensor": t, "offset": 255, "value": 1, "size": 2}, b""),
    ("empty memset at the end", C.MEMSET_TENSOR, lambda t: {"tensor": t, "offset": 256, "value": 1, "size": 0}, b""),
    ("rows of size 0", C.GET_TENSOR_2D, lambda t: {"tensor": t, **ROW0, "size": 0}, b""),
    ("no rows sent", C.SET_TENSOR_2D, lambda t: {"tensor": t, **ROW0, "n_copies": 0}, b""),
    ("rows short of data", C.SET_TENSOR_2D, lambda t: {"tensor": t, **ROW0}, bytes(63)),
    ("rows with their data", C.SET_TENSOR_2D, lambda t: {"tensor": t, **ROW0}, bytes(64)),
    ("span past 64 bits", C.GET_TENSOR_2D, lambda t: {"tensor": t, **ROW0, "stride": (1 << 64) - 1}, b""),
    ("rows past the tensor", C.GET_TENSOR_2D, lambda t: {"tensor": t, **ROW0, "n_copies": 5}, b""),
    ("rows to the tensor's end", C.GET_TENSOR_2D, lambda t: {"tensor": t, **ROW0, "offset": 48}, b""),
    ("a null node", C.GRAPH_COMPUTE, lambda t: {"device": 0, "uid": 0, "nodes": [0], "tensors": [t]}, b""),
    ("an unknown node", C.GRAPH_COMPUTE, lambda t: {"device": 0, "uid": 0, "nodes": [7], "tensors": [t]}, b""),
    ("a node of unknown type", C.GRAPH_COMPUTE,
     lambda t: {"device": 0, "uid": 0, "nodes": [1], "tensors": [_typed(t, 99)]}, b""),
]


def _core_and_tensor() -> tuple[ServerCore, dict]:
    core = ServerCore(make_config(V8), None)
    core.receive_data(HELLO + encode_request(V8, C.ALLOC_BUFFER, {"device": 0, "size": BUFFER_BYTES}))
    assert core.next_event()  # HELLO
    handle = int.from_bytes(b"".join(core.next_event() or ())[8:16], "little")
    base = core.table.buffers[handle].base
    return core, make_tensor(id=1, ne=(TENSOR_BYTES,), type=int(GgmlType.I8), buffer=handle, data=base)


def _table(wire: bytes) -> str | None:
    req = RequestDecoder(V8, expect_hello=False, validate=False).feed(wire)[0]
    data_len = req.data.nbytes if req.data is not None and req.command in (C.SET_TENSOR, C.SET_TENSOR_2D) else 0
    broken = first_broken(Message(req.command, req.fields, 0, 0, req.size, data_len, req.raw), ConnState(V8))
    return None if broken is None else broken[0].id


def _reference(core: ServerCore, wire: bytes) -> str | None:
    """The rule id the core closes with; None when it serves the request; "other" for a refusal of its own."""
    core.receive_data(wire)
    try:
        core.next_event()
    except Close as exc:
        return exc.rule or f"other: {exc}"
    return None


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_the_reference_refuses_what_the_table_finds(case: Case) -> None:
    _name, command, fields, data = case
    core, t = _core_and_tensor()
    wire = encode_request(V8, command, fields(t), data)
    assert _reference(core, wire) == _table(wire)


def test_the_cases_cover_every_rule_the_reference_refuses() -> None:
    assert REFUSED_RULES <= set(BY_ID)
    found = set()
    for _name, command, fields, data in CASES:
        _core, t = _core_and_tensor()
        found.add(_table(encode_request(V8, command, fields(t), data)))
    assert found - {None} == REFUSED_RULES
