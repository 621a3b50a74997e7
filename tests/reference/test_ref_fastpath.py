"""The reference server's small-request fast path: flat-tuple field positions and the tensor hook it keeps."""

from __future__ import annotations

import random
import socket
import threading
from typing import Any

import pytest
from ggml_rpc.conformance.client import RpcClient
from ggml_rpc.reference import Hooks, ServerCore, make_config
from ggml_rpc.reference.server import serve_connection
from ggml_rpc.spec import V6, V7, V7_0_1, Command, make_tensor
from ggml_rpc.spec.layout import flat_layout
from ggml_rpc.spec.messages import Shape
from refhelpers import assert_closes


def _fixed_schemas() -> list[tuple[str, Any]]:
    out = []
    for proto in (V6, V7, V7_0_1):
        for cmd, spec in proto.commands.items():
            if spec.request.shape in (Shape.FIXED, Shape.HEADER_DATA):
                out.append((f"{proto.label}-{cmd.name}", spec.request.schema))
    return out


def _at(value: Any, path: str) -> Any:
    for part in path.split("."):
        value = value[part]
    return value


@pytest.mark.parametrize(("name", "schema"), _fixed_schemas(), ids=[n for n, _ in _fixed_schemas()])
def test_slots_agree_with_the_nested_dict_on_random_bytes(name: str, schema: Any) -> None:
    layout = flat_layout(schema)
    slots = layout.slots()
    rng = random.Random(name)
    for _ in range(5):
        raw = rng.randbytes(layout.size)
        flat = layout.struct.unpack(raw)
        nested = layout.unpack(raw)
        for path, (start, width) in slots.items():
            expected = _at(nested, path)
            if isinstance(expected, dict) or (isinstance(expected, list) and isinstance(expected[0], dict)):
                continue  # nested Structs: those the fast path reads are checked under their dotted paths
            got = list(flat[start : start + width]) if isinstance(expected, list) else flat[start]
            assert got == expected, path


def _recording_hooks(seen: list[str]) -> Hooks:
    """A tensor hook that checks it gets every tensor as a dict and records which commands checked one."""

    def hook(t: Any, command: str, what: str) -> None:
        seen.append(command)
        assert isinstance(t["ne"], list) and isinstance(t["name"], bytes)

    return Hooks(tensor=hook)


def _serve_then_close(sock: socket.socket, core: ServerCore) -> None:
    try:
        serve_connection(sock, core)
    finally:
        sock.close()  # as the accept loop does: the connection only releases its own state


def _serve_pair(proto: str = "7") -> tuple[RpcClient, list[str], threading.Thread]:
    ours, theirs = socket.socketpair()
    seen: list[str] = []
    core = ServerCore(make_config(proto, hooks=_recording_hooks(seen)), None)
    thread = threading.Thread(target=_serve_then_close, args=(theirs, core), daemon=True)
    thread.start()
    ours.settimeout(10)
    client = RpcClient(ours)
    client.hello()
    return client, seen, thread


def test_a_tensor_hook_sees_every_fast_path_command() -> None:
    client, seen, thread = _serve_pair()
    with client:
        handle, _ = client.alloc_buffer(0, 256)
        base = client.buffer_get_base(handle)
        t = make_tensor(id=1, ne=(64,), buffer=handle, data=base)
        client.set_tensor(t, 0, bytes(range(256)))
        client.memset_tensor(t, 0, 4, 9)
        assert bytes(client.get_tensor(t, 4, 4)) == bytes(range(4, 8))
        assert bytes(client.get_tensor(t, 0, 2)) == b"\x09\x09"
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert seen == ["SET_TENSOR", "MEMSET_TENSOR", "GET_TENSOR", "GET_TENSOR"]


def test_constant_replies_follow_the_configuration() -> None:
    ours, theirs = socket.socketpair()
    config = make_config("6", devices=3, alignment=64, max_size=1 << 30)
    thread = threading.Thread(target=_serve_then_close, args=(theirs, ServerCore(config, None)), daemon=True)
    thread.start()
    ours.settimeout(10)
    with RpcClient(ours) as c:
        c.hello()
        assert c.get_alignment(2) == 64
        assert c.get_max_size(1) == 1 << 30
        assert c.device_count() == 3
        assert_closes(c, Command.GET_ALIGNMENT, {"device": 3})  # the device check stays in front of the reply
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_get_alloc_size_checks_each_src_with_an_id_and_a_valid_type() -> None:
    client, seen, thread = _serve_pair()
    with client:
        handle, _ = client.alloc_buffer(0, 256)
        base = client.buffer_get_base(handle)
        t = make_tensor(id=1, ne=(10,))
        inside = make_tensor(id=2, ne=(8,), buffer=handle, data=base)
        no_id = make_tensor(id=0, ne=(1 << 20,), buffer=handle, data=base)  # would lie outside: never checked
        removed = make_tensor(id=3) | {"type": 4}
        assert client.get_alloc_size(0, t, [inside, no_id, removed, inside]) == 40
        outside = make_tensor(id=4, ne=(8,), buffer=handle, data=base + 240)
        assert_closes(client, Command.GET_ALLOC_SIZE, {"device": 0, "tensor": t, "srcs": [inside, outside]
                                                       + [make_tensor(id=0)] * 8})
    thread.join(timeout=10)
    assert not thread.is_alive()
    # The tensor and both `inside` srcs, then the tensor, `inside` and `outside` (which closes).
    assert seen == ["GET_ALLOC_SIZE"] * 6
