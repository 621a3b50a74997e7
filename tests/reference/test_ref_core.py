"""The sans-IO connection core, driven without a socket: bytes in any chunks, bulk data straight into tensor memory,
one event per command, the end of the stream; and the package rule that only server.py does network I/O."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np
import pytest
from ggml_rpc.reference import Hooks, ServerCore, make_config
from ggml_rpc.reference.closing import Close, PeerGone
from ggml_rpc.reference.devices import BufferTable, DeviceConfig
from ggml_rpc.reference.replies import Replies
from ggml_rpc.reference.resolve import Resolver
from ggml_rpc.reference.tensor_commands import TensorCommands
from ggml_rpc.spec import V7, Command, GgmlType, encode_request, make_tensor
from ggml_rpc.spec.codec import REPLY_HEADER

REFERENCE = Path(__file__).resolve().parents[2] / "reference"
HELLO = encode_request(V7, Command.HELLO, {"conn_caps": bytes(24)})


def _greeted(**options: object) -> ServerCore:
    core = ServerCore(make_config(V7, **options), None)  # type: ignore[arg-type]
    core.receive_data(HELLO)
    assert core.next_event()  # the HELLO reply
    return core


def _event(core: ServerCore, wire: bytes) -> list:
    core.receive_data(wire)
    out = core.next_event()
    assert out is not None
    return out


def _alloc_tensor(core: ServerCore, n: int) -> dict:
    reply = b"".join(_event(core, encode_request(V7, Command.ALLOC_BUFFER, {"device": 0, "size": n})))
    handle = int.from_bytes(reply[8:16], "little")
    buf = core.table.buffers[handle]
    return make_tensor(id=1, ne=(n,), type=int(GgmlType.I8), buffer=handle, data=buf.base)  # a byte per element


def test_bytes_in_single_bytes_give_the_same_events() -> None:
    core = ServerCore(make_config(V7), None)
    wire = HELLO + encode_request(V7, Command.GET_ALIGNMENT, {"device": 0})
    events = []
    for i in range(len(wire)):
        core.receive_data(wire[i : i + 1])
        while (out := core.next_event()) is not None:
            events.append(b"".join(out))
    assert len(events) == 2 and events[1] == REPLY_HEADER.pack(8) + (32).to_bytes(8, "little")


def test_set_tensor_payload_lands_in_tensor_memory_and_get_tensor_replies_with_a_view_of_it() -> None:
    core = _greeted()
    t = _alloc_tensor(core, 4096)
    wire = encode_request(V7, Command.SET_TENSOR, {"tensor": t, "offset": 0, "cache_flag": 0}, bytes(4096))
    head = len(wire) - 4096
    core.receive_data(wire[: head + 100])  # the header and the first bytes arrive together
    assert core.next_event() is None
    sink = core.bulk_ahead()
    assert sink is not None and sink.nbytes == 4096 - 100
    memory = core.table.buffers[t["buffer"]].memory
    assert np.shares_memory(np.frombuffer(sink, np.uint8), memory)  # the rest goes straight into the tensor
    sink[:] = (bytes(range(256)) * 16)[100:]
    core.skip(sink.nbytes)
    del sink
    assert core.next_event() == ()  # SET_TENSOR has no reply
    out = _event(core, encode_request(V7, Command.GET_TENSOR, {"tensor": t, "offset": 200, "size": 8}))
    assert out[0] == REPLY_HEADER.pack(8) and isinstance(out[1], memoryview)
    assert np.shares_memory(np.frombuffer(out[1], np.uint8), memory)
    assert bytes(out[1]) == (bytes(range(256)) * 16)[200:208]


def test_one_event_per_command_even_when_many_are_buffered() -> None:
    core = _greeted()
    t = _alloc_tensor(core, 64)
    core.receive_data(encode_request(V7, Command.MEMSET_TENSOR, {"tensor": t, "offset": 0, "size": 64, "value": 7})
                      + encode_request(V7, Command.GET_TENSOR, {"tensor": t, "offset": 0, "size": 2}))
    assert core.next_event() == ()
    assert bytes(core.next_event()[1]) == b"\x07\x07"  # type: ignore[index]
    assert core.next_event() is None


@pytest.mark.parametrize(("cut", "reason"), [
    (0, "client closed the connection"),
    (4, "client closed the connection inside a request header (4 of 9 bytes)"),
    (12, "client closed the connection inside a message (3 of 4 bytes)"),
])
def test_the_end_of_the_stream_is_peer_gone_with_upstreams_reasons(cut: int, reason: str) -> None:
    core = _greeted()
    if cut:  # (b"" would be the end of the stream itself)
        core.receive_data(encode_request(V7, Command.GET_ALIGNMENT, {"device": 0})[:cut])
    assert core.next_event() is None
    core.receive_data(b"")
    with pytest.raises(PeerGone, match=f"^{re.escape(reason)}$"):
        core.next_event()


def test_a_rule_raises_close_and_the_close_hook_sees_it_first() -> None:
    seen: list[str] = []
    core = _greeted(hooks=Hooks(close=lambda exc: seen.append(str(exc))))
    core.receive_data(encode_request(V7, Command.GET_ALIGNMENT, {"device": 5}))
    with pytest.raises(Close, match="device 5"):
        core.next_event()
    assert len(seen) == 1 and "device 5" in seen[0]


def test_a_replaced_handler_answers_through_the_core() -> None:
    def wrong(core: ServerCore, fields: dict) -> None:
        core.reply(Command.GET_ALIGNMENT, {"alignment": 64})

    core = _greeted(hooks=Hooks(handlers={Command.GET_ALIGNMENT: wrong}))
    reply = b"".join(_event(core, encode_request(V7, Command.GET_ALIGNMENT, {"device": 0})))
    assert reply[8:] == (64).to_bytes(8, "little")


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_only_server_py_does_network_io_and_nothing_imports_conformance() -> None:
    modules = sorted(REFERENCE.rglob("*.py"))
    network = {p.relative_to(REFERENCE).as_posix() for p in modules if {"socket", "socketserver", "selectors",
                                                                       "asyncio"} & _imports(p)}
    assert network == {"server.py"}
    assert not [p for p in modules if any(m.startswith("ggml_rpc.conformance") for m in _imports(p))]


def test_a_command_group_runs_on_what_it_is_given_without_a_core() -> None:
    """A group is an object given its buffer table, resolver and reply queue: no connection core behind it."""
    table = BufferTable.for_devices(1, DeviceConfig())
    buf = table.alloc(0, 128)  # the tensor is its first half: a region past the tensor stays in the buffer
    assert buf is not None
    buf.memory[:4] = [1, 2, 3, 4]
    out = Replies(V7)
    tensors = TensorCommands(V7, None, Resolver(table, 1), out, name="test")
    t = make_tensor(id=1, ne=(64,), type=int(GgmlType.I8), buffer=buf.handle, data=buf.base)
    tensors.handlers[Command.GET_TENSOR]({"tensor": t, "offset": 0, "size": 4})
    assert b"".join(out.take()) == REPLY_HEADER.pack(4) + bytes([1, 2, 3, 4])
    with pytest.raises(Close) as refused:
        tensors.handlers[Command.GET_TENSOR]({"tensor": t, "offset": 62, "size": 4})
    assert refused.value.rule == "REGION-PAST-TENSOR"
