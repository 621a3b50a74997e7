"""Every validation rule (spec/PROTOCOL.md#rules): the bad input, the documented outcome, and a server still serving.

Where upstream closes, the reference closes; where upstream aborts (or is unsafe), the reference closes only that
connection.  Each test ends by checking that a new connection is served.
"""

from __future__ import annotations

import struct

import pytest
from ggml_rpc.reference import running_server
from ggml_rpc.spec import Command, GgmlOp, GgmlType, make_tensor, null_tensor, request_parts
from refhelpers import TIMEOUT, assert_closes, assert_served, connect, send_only, tensor_in

U64 = struct.Struct("<Q")


def raw_request(cmd: int, payload: bytes = b"", size: int | None = None) -> bytes:
    return bytes([cmd]) + U64.pack(len(payload) if size is None else size) + payload


# ---- framing and handshake -------------------------------------------------------------------------------------


def test_first_command_not_hello_closes(srv) -> None:
    with connect(srv, hello=False) as c:
        c.send_raw(raw_request(Command.DEVICE_COUNT))
        assert c.expect_closed(TIMEOUT)
    assert_served(srv)


@pytest.mark.parametrize("size", [0, 23, 28])
def test_hello_size_mismatch_closes(srv, size) -> None:
    with connect(srv, hello=False) as c:
        c.send_raw(raw_request(Command.HELLO, bytes(size)))
        assert c.expect_closed(TIMEOUT)
    assert_served(srv)


def test_second_hello_closes(srv) -> None:
    with connect(srv) as c:
        c.send_raw(raw_request(Command.HELLO, bytes(24)))
        assert c.expect_closed(TIMEOUT)
    assert_served(srv)


@pytest.mark.parametrize("cmd", [18, 19, 20, 200, 255])
def test_unknown_commands_close(srv, cmd) -> None:
    with connect(srv) as c:
        c.send_raw(raw_request(cmd, bytes(4)))
        assert c.expect_closed(TIMEOUT)
    assert_served(srv)


def test_supports_op_exists_only_in_7_0_1(srv701) -> None:
    with connect(srv701) as c:
        assert c.supports_op(0, make_tensor(id=1, ne=(4,), op=GgmlOp.MAP_CUSTOM1)) is False
        c.send_raw(raw_request(18))
        assert c.expect_closed(TIMEOUT)
    assert_served(srv701)


@pytest.mark.parametrize(
    ("cmd", "size"),
    [(Command.GET_ALIGNMENT, 8), (Command.ALLOC_BUFFER, 16), (Command.FREE_BUFFER, 4), (Command.DEVICE_COUNT, 4),
     (Command.GET_TENSOR, 311), (Command.GET_ALLOC_SIZE, 3259), (Command.MEMSET_TENSOR, 312)],
)
def test_fixed_size_mismatch_closes_unread(srv, cmd, size) -> None:
    with connect(srv) as c:
        c.send_raw(raw_request(cmd, bytes(size)))
        assert c.expect_closed(TIMEOUT)
    assert_served(srv)


@pytest.mark.parametrize(
    "command", [Command.ALLOC_BUFFER, Command.GET_ALIGNMENT, Command.GET_MAX_SIZE, Command.GET_DEVICE_MEMORY,
                Command.GET_ALLOC_SIZE, Command.GRAPH_COMPUTE, Command.GRAPH_RECOMPUTE],
)
def test_device_out_of_range_closes(srv, command) -> None:
    fields = {
        Command.ALLOC_BUFFER: {"device": 1, "size": 16},
        Command.GET_ALLOC_SIZE: {"device": 1, "tensor": make_tensor(id=1), "srcs": [null_tensor()] * 10},
        Command.GRAPH_COMPUTE: {"device": 1, "nodes": [1], "tensors": [make_tensor(id=1)]},
    }.get(command, {"device": 1})
    if command in (Command.GRAPH_COMPUTE, Command.GRAPH_RECOMPUTE) and srv.protocol.graph_cache_max is not None:
        fields = {**fields, "uid": 1}  # 8.0.0 names its graphs
    with connect(srv) as c:
        assert_closes(c, command, fields)
    assert_served(srv)


def test_supports_op_device_out_of_range_and_bad_op_close(srv701) -> None:
    srcs = [null_tensor()] * 10
    with connect(srv701) as c:
        assert_closes(c, Command.GET_DEVICE_SUPPORTS_OP, {"device": 1, "op": make_tensor(id=1), "srcs": srcs})
    with connect(srv701) as c:
        removed_type = make_tensor(id=1) | {"type": 4}
        assert_closes(c, Command.GET_DEVICE_SUPPORTS_OP, {"device": 0, "op": removed_type, "srcs": srcs})
    with connect(srv701) as c:
        bad_src = [make_tensor(id=2) | {"type": 99}, *srcs[1:]]
        assert_closes(c, Command.GET_DEVICE_SUPPORTS_OP, {"device": 0, "op": make_tensor(id=1), "srcs": bad_src})
    assert_served(srv701)


@pytest.mark.parametrize("size", [1 << 63, (1 << 64) - 1, 1 << 62])
def test_huge_size_claims_close_without_allocating(srv, size) -> None:
    for cmd in (Command.SET_TENSOR, Command.GRAPH_COMPUTE):
        with connect(srv) as c:
            c.send_raw(raw_request(cmd, bytes(400), size=size))
            assert c.expect_closed(TIMEOUT)
    assert_served(srv)


# ---- buffers ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [Command.BUFFER_GET_BASE, Command.FREE_BUFFER, Command.BUFFER_CLEAR])
@pytest.mark.parametrize("handle", [0, 0x1234_5678_9ABC_DEF0])
def test_unknown_buffer_handle_closes(srv, command, handle) -> None:
    fields = {"remote_ptr": handle, "value": 0} if command is Command.BUFFER_CLEAR else {"remote_ptr": handle}
    with connect(srv) as c:
        tensor_in(c, 64)  # the table is not empty: the handle is still unknown
        assert_closes(c, command, fields)
    assert_served(srv)


def test_freed_buffer_is_forgotten(srv) -> None:
    with connect(srv) as c:
        _t, h, _b = tensor_in(c, 64)
        c.free_buffer(h)
        assert_closes(c, Command.BUFFER_GET_BASE, {"remote_ptr": h})
    assert_served(srv)


# ---- tensors in every tensor-taking command --------------------------------------------------------------------


def _tensor_commands(t: dict) -> list[tuple[Command, dict, bytes | None]]:
    return [
        (Command.SET_TENSOR, {"tensor": t, "offset": 0}, b"\0" * 4),
        (Command.GET_TENSOR, {"tensor": t, "offset": 0, "size": 4}, None),
        (Command.MEMSET_TENSOR, {"tensor": t, "offset": 0, "size": 4, "value": 1}, None),
        (Command.INIT_TENSOR, {"tensor": t}, None),
        (Command.COPY_TENSOR, {"src": t, "dst": t}, None),
        (Command.GET_ALLOC_SIZE, {"device": 0, "tensor": t, "srcs": [null_tensor()] * 10}, None),
    ]


def _fields_for(c, command, fields):
    if command is Command.SET_TENSOR and c.protocol.cache_rule.flag_field:
        fields = {**fields, "cache_flag": 0}
    return fields


@pytest.mark.parametrize("bad_type", [43, 200, 4, 5, 31, 36, 38])
@pytest.mark.parametrize("which", range(6))
def test_invalid_or_removed_type_closes(srv, bad_type, which) -> None:
    with connect(srv) as c:
        t, _h, _b = tensor_in(c, 64)
        t = {**t, "type": bad_type}
        command, fields, data = _tensor_commands(t)[which]
        assert_closes(c, command, _fields_for(c, command, fields), data)
    assert_served(srv)


@pytest.mark.parametrize("which", range(6))
@pytest.mark.parametrize("where", ["below", "past_end", "wraps"])
def test_data_outside_its_buffer_closes(srv, which, where) -> None:
    # Upstream: buffer-range assertion, the process dies.  Reference: this connection closes.
    with connect(srv) as c:
        t, _h, base = tensor_in(c, 64, ne=(16,))
        data = {"below": base - 4, "past_end": base + 8, "wraps": 2**64 - 8}[where]
        t = {**t, "data": data}
        command, fields, payload = _tensor_commands(t)[which]
        assert_closes(c, command, _fields_for(c, command, fields), payload)
    assert_served(srv)


def test_unknown_buffer_handle_in_a_tensor_is_null_silently(srv) -> None:
    with connect(srv) as c:
        t = make_tensor(id=1, ne=(16,), buffer=0xDEAD, data=0x1000)
        assert c.get_alloc_size(0, t) == 64  # null buffer: the device's default buffer type answers
        c.init_tensor(t)  # null buffer: logged, not closed
        assert c.device_count() == 1


# ---- SET_TENSOR ------------------------------------------------------------------------------------------------


def test_set_tensor_below_minimum_size_closes(srv) -> None:
    header = 305 if srv.protocol.cache_rule.flag_field else 304
    with connect(srv) as c:
        c.send_raw(raw_request(Command.SET_TENSOR, bytes(header - 1)))
        assert c.expect_closed(TIMEOUT)
    assert_served(srv)


@pytest.mark.parametrize("buffer", ["null", "unknown"])
def test_set_tensor_without_buffer_closes(srv, buffer) -> None:
    with connect(srv) as c:
        t, _h, base = tensor_in(c, 64)
        t = {**t, "buffer": 0 if buffer == "null" else 0xBAD, "data": base if buffer == "unknown" else 0}
        c.set_tensor(t, 0, b"abcd")
        assert c.expect_closed(TIMEOUT)
    assert_served(srv)


@pytest.mark.parametrize(("offset", "n"), [(64, 1), (64, 0), (60, 8), (2**64 - 1, 4), (0, 65)])
def test_set_tensor_region_outside_buffer_closes(srv, offset, n) -> None:
    with connect(srv) as c:
        t, _h, _b = tensor_in(c, 64)
        c.set_tensor(t, offset, b"x" * n)
        assert c.expect_closed(TIMEOUT)
    assert_served(srv)


def test_set_tensor_past_nbytes_inside_buffer_closes_before_reading(srv) -> None:
    # Upstream: "tensor write out of bounds" assertion (process abort).  The payload is never read: the header is
    # enough to refuse, so the claimed size cannot make the server allocate or wait for anything.
    with connect(srv) as c:
        _t, h, base = tensor_in(c, 1 << 20)
        small = make_tensor(id=2, ne=(4,), buffer=h, data=base)  # 16 bytes inside a 1 MiB buffer
        flag = {"cache_flag": 0} if c.protocol.cache_rule.flag_field else {}
        parts = request_parts(c.protocol, Command.SET_TENSOR, {"tensor": small, "offset": 8, **flag}, b"y" * 16)
        c.send_raw(parts[:-1])  # header only: the 16 data bytes are never sent
        assert c.expect_closed(TIMEOUT)
    assert_served(srv)


def test_set_tensor_empty_payload_inside_is_accepted(srv) -> None:
    with connect(srv) as c:
        t, _h, _b = tensor_in(c, 64)
        c.set_tensor(t, 63, b"")
        assert c.device_count() == 1


# ---- SET_TENSOR_HASH -------------------------------------------------------------------------------------------


def test_set_tensor_hash_without_cache_is_a_miss_without_validation(srv) -> None:
    with connect(srv) as c:
        garbage = {**make_tensor(id=1), "type": 250, "buffer": 0x77, "data": 2**64 - 1}
        assert c.set_tensor_hash(garbage, 2**64 - 1, 0x1234) is False
        assert c.device_count() == 1


# (hits with bad tensors are in test_ref_cache.py, which runs servers with a cache directory)


# ---- GET_TENSOR ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("offset", "size"), [(64, 0), (60, 8), (0, 65), (2**64 - 4, 8)])
def test_get_tensor_region_outside_buffer_closes(srv, offset, size) -> None:
    with connect(srv) as c:
        t, _h, _b = tensor_in(c, 64)
        assert_closes(c, Command.GET_TENSOR, {"tensor": t, "offset": offset, "size": size})
    assert_served(srv)


def test_get_tensor_past_nbytes_closes(srv) -> None:
    with connect(srv) as c:
        _t, h, base = tensor_in(c, 256)
        small = make_tensor(id=2, ne=(4,), buffer=h, data=base)
        assert_closes(c, Command.GET_TENSOR, {"tensor": small, "offset": 8, "size": 16})
    assert_served(srv)


def test_get_tensor_without_buffer_closes(srv) -> None:
    with connect(srv) as c:
        assert_closes(c, Command.GET_TENSOR, {"tensor": make_tensor(id=1, ne=(4,)), "offset": 0, "size": 4})
    assert_served(srv)


# ---- MEMSET_TENSOR ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("offset", "size"), [(65, 0), (60, 8), (0, 2**64 - 1)])
def test_memset_outside_tensor_closes(srv, offset, size) -> None:
    with connect(srv) as c:
        t, _h, _b = tensor_in(c, 64)
        assert_closes(c, Command.MEMSET_TENSOR, {"tensor": t, "offset": offset, "size": size, "value": 1})
    assert_served(srv)


def test_memset_without_buffer_closes(srv) -> None:
    with connect(srv) as c:
        t = make_tensor(id=1, ne=(4,))
        assert_closes(c, Command.MEMSET_TENSOR, {"tensor": t, "offset": 0, "size": 4, "value": 1})
    assert_served(srv)


def test_memset_zero_size_on_dummy_buffer_is_a_no_op(srv) -> None:
    with connect(srv) as c:
        h, _ = c.alloc_buffer(0, 0)
        t = make_tensor(id=1, ne=(0,), buffer=h, data=0)
        c.memset_tensor(t, 0, 0, 1)
        assert c.device_count() == 1


# ---- COPY_TENSOR -----------------------------------------------------------------------------------------------


def test_copy_tensor_without_buffer_closes(srv) -> None:
    with connect(srv) as c:
        t, _h, _b = tensor_in(c, 64)
        assert_closes(c, Command.COPY_TENSOR, {"src": t, "dst": make_tensor(id=9, ne=(16,))})
    assert_served(srv)


def test_copy_tensor_overflowing_dst_buffer_closes(srv) -> None:
    with connect(srv) as c:
        src, _h1, _b1 = tensor_in(c, 256, id=1)
        _d, h2, b2 = tensor_in(c, 64, id=2)
        small_dst = make_tensor(id=3, ne=(4,), buffer=h2, data=b2 + 32)  # valid itself, but 256 bytes won't fit
        assert_closes(c, Command.COPY_TENSOR, {"src": src, "dst": small_dst})
    assert_served(srv)


def test_copy_into_a_zero_size_buffer_is_declined(srv) -> None:
    # A zero-size buffer is upstream's dummy without a copy function: nothing to copy, yet result 0 (declined).
    with connect(srv) as c:
        h, _ = c.alloc_buffer(0, 0)
        empty = make_tensor(id=1, ne=(0,), buffer=h, data=0)
        assert c.copy_tensor(empty, empty) is False
        src, _h2, _b2 = tensor_in(c, 64, id=2)
        assert c.copy_tensor(empty, src) is True  # a real destination copies (zero bytes) and says so
    assert_served(srv)


# ---- GRAPH_COMPUTE / GRAPH_RECOMPUTE ---------------------------------------------------------------------------


def _graph_bytes(device: int, nodes: list[int], tensors: list[dict], protocol=None) -> bytes:
    """A GRAPH_COMPUTE payload in the layout of ``protocol`` (6.0.0's when None; 8.0.0 adds a uid of 1)."""
    from ggml_rpc.spec import encode_request
    from ggml_rpc.spec.versions import V6

    protocol = protocol or V6
    fields = {"device": device, "nodes": nodes, "tensors": tensors}
    if protocol.graph_cache_max is not None:
        fields["uid"] = 1
    return encode_request(protocol, Command.GRAPH_COMPUTE, fields)[9:]


@pytest.mark.parametrize("cut", ["below8", "nodes", "tensors"])
def test_graph_compute_short_payload_closes(srv, cut) -> None:
    payload = _graph_bytes(0, [1, 2], [make_tensor(id=1), make_tensor(id=2)], srv.protocol)
    head = srv.protocol.commands[Command.GRAPH_COMPUTE].request.header_size - 4  # the fixed fields and n_nodes
    keep = {"below8": head - 1, "nodes": head + 8 * 2 + 3, "tensors": len(payload) - 1}[cut]
    with connect(srv) as c:
        c.send_raw(raw_request(Command.GRAPH_COMPUTE, payload[:keep]))
        assert c.expect_closed(TIMEOUT)
    assert_served(srv)


@pytest.fixture(scope="module")
def graph_srv(request):
    """A v7 server whose executor records graphs (so graph rules are tested whatever the real executor runs)."""
    runs: list = []
    with running_server("7", executor=lambda nodes: runs.append(nodes)) as s:
        s.runs = runs
        yield s


def _graph_case(c, kind: str):
    a, h, base = tensor_in(c, 64, ne=(8,), id=1)
    add = dict(op=GgmlOp.ADD, flags=16)
    if kind == "node0":
        return [0], [a]
    if kind == "missing_node":
        return [7], [a]
    if kind == "dangling_src":
        return [2], [a, make_tensor(id=2, ne=(8,), buffer=h, data=base, src=[1, 99], **add)]
    if kind == "dangling_view_src":
        return [2], [a, make_tensor(id=2, ne=(8,), buffer=h, data=base, src=[1], view_src=55, **add)]
    if kind == "null_buffer_data":
        return [2], [a, make_tensor(id=2, ne=(8,), data=base, src=[1], **add)]
    if kind == "bad_type":
        return [2], [a, make_tensor(id=2, ne=(8,), buffer=h, data=base, src=[1], **add) | {"type": 77}]
    if kind == "outside_buffer":
        return [2], [a, make_tensor(id=2, ne=(8,), buffer=h, data=base + 40, src=[1], **add)]
    if kind in ("custom", "map_custom1", "map_custom3"):
        op = {"custom": GgmlOp.CUSTOM, "map_custom1": GgmlOp.MAP_CUSTOM1, "map_custom3": GgmlOp.MAP_CUSTOM3}[kind]
        return [2], [a, make_tensor(id=2, ne=(8,), buffer=h, data=base, src=[1], op=op, op_params=[0x41414141] * 4,
                                    flags=16)]
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind", ["node0", "missing_node", "dangling_src", "dangling_view_src", "null_buffer_data", "bad_type",
             "outside_buffer", "custom", "map_custom1", "map_custom3"],
)
def test_graph_compute_bad_graph_closes(graph_srv, kind) -> None:
    before = len(graph_srv.runs)
    with connect(graph_srv) as c:
        nodes, tensors = _graph_case(c, kind)
        c.graph_compute(0, nodes, tensors)
        assert c.expect_closed(TIMEOUT)
    assert len(graph_srv.runs) == before  # nothing reached the executor
    assert_served(graph_srv)


def test_graph_recompute_without_stored_graph_closes(graph_srv) -> None:
    with connect(graph_srv) as c:
        c.graph_recompute(0)
        assert c.expect_closed(TIMEOUT)
    assert_served(graph_srv)


def test_graph_recompute_after_free_buffer_closes(graph_srv) -> None:
    # Upstream 6/7: a use-after-free (the stored graph still points into the freed buffer).
    with connect(graph_srv) as c:
        a, h, base = tensor_in(c, 64, ne=(8,), id=1)
        out = make_tensor(id=2, ne=(8,), buffer=h, data=base + 32, src=[1, 1], op=GgmlOp.ADD, flags=16)
        c.graph_compute(0, [2], [a, out])
        c.graph_recompute(0)
        assert c.device_count() == 1
        c.free_buffer(h)
        c.graph_recompute(0)
        assert c.expect_closed(TIMEOUT)
    assert_served(graph_srv)


def test_free_of_an_unrelated_buffer_keeps_the_stored_graph(graph_srv) -> None:
    with connect(graph_srv) as c:
        a, h, base = tensor_in(c, 64, ne=(8,), id=1)
        _other, h2, _b2 = tensor_in(c, 64, id=5)
        out = make_tensor(id=2, ne=(8,), buffer=h, data=base + 32, src=[1, 1], op=GgmlOp.ADD, flags=16)
        before = len(graph_srv.runs)
        c.graph_compute(0, [2], [a, out])
        c.free_buffer(h2)
        c.graph_recompute(0)
        assert c.device_count() == 1
    assert len(graph_srv.runs) == before + 2


def test_graph_backend_failure_closes() -> None:
    # Upstream: assertion on a non-success status (process abort).
    from ggml_rpc.reference.graph import ExecutorError

    def refuse(nodes):
        raise ExecutorError(f"ADD of {nodes[0].name!r} not supported")

    def crash(nodes):
        raise ZeroDivisionError("kernel bug")

    for executor in (refuse, crash):
        with running_server("6", executor=executor) as srv:
            with connect(srv) as c:
                a, h, base = tensor_in(c, 64, ne=(8,), id=1)
                out = make_tensor(id=2, ne=(8,), buffer=h, data=base + 32, src=[1, 1], op=GgmlOp.ADD, flags=16)
                c.graph_compute(0, [2], [a, out])
                assert c.expect_closed(TIMEOUT)
            assert_served(srv)


def test_graph_compute_trailing_bytes_are_ignored(graph_srv) -> None:
    with connect(graph_srv) as c:
        a, _h, _base = tensor_in(c, 64, ne=(8,), id=1)
        payload = _graph_bytes(0, [1], [a]) + b"trailing"
        c.send_raw(raw_request(Command.GRAPH_COMPUTE, payload))
        assert c.device_count() == 1


def test_graph_over_the_size_limit_closes() -> None:
    with running_server("7", max_graph_bytes=4096, executor=lambda nodes: None) as srv:
        with connect(srv) as c:
            send_only(c, Command.GRAPH_COMPUTE, {"device": 0, "nodes": [1] * 600, "tensors": [make_tensor(id=1)]})
            assert c.expect_closed(TIMEOUT)
        assert_served(srv)


def test_executor_unavailable_or_refusing_closes_only_the_connection(srv) -> None:
    # With the real executor: an op it cannot run (here an op id beyond the op table) closes the connection.
    with connect(srv) as c:
        a, h, base = tensor_in(c, 64, ne=(8,), id=1)
        out = make_tensor(id=2, ne=(8,), buffer=h, data=base + 32, src=[1], op=250, flags=16)
        c.graph_compute(0, [2], [a, out])
        assert c.expect_closed(TIMEOUT)
    assert_served(srv)


def test_gettype_checks_cover_quantized_tensors(srv) -> None:
    # A quantized tensor whose ne[0] is not a multiple of the block size ends inside a block (#25288): upstream
    # accepts it (nbytes rounds down) and its kernels read or write the partial block; the reference closes
    # (FRAME-048), and the server goes on.  Whole blocks are accepted.
    with connect(srv) as c:
        t, _h, _b = tensor_in(c, 64, type=GgmlType.Q8_0, ne=(40,))
        fields = {"tensor": t, "offset": 0}
        if c.protocol.cache_rule.flag_field:
            fields[c.protocol.cache_rule.flag_field] = 0
        assert_closes(c, Command.SET_TENSOR, fields, b"z" * 34)
    with connect(srv) as c:
        t, _h, _b = tensor_in(c, 64, type=GgmlType.Q8_0, ne=(32,))
        c.set_tensor(t, 0, b"z" * 34)
        assert bytes(c.get_tensor(t, 0, 34)) == b"z" * 34
    assert_served(srv)


def test_get_alloc_size_drops_a_bad_src_silently(srv) -> None:
    with connect(srv) as c:
        main_tensor = make_tensor(id=1, ne=(10,))
        bad_src = make_tensor(id=2) | {"type": 4}
        assert c.get_alloc_size(0, main_tensor, [bad_src, make_tensor(id=3) | {"type": 99}]) == 40


def test_graph_compute_duplicates_and_cycles_are_accepted(graph_srv) -> None:
    with connect(graph_srv) as c:
        a, h, base = tensor_in(c, 64, ne=(8,), id=1, name="first")
        shadow = make_tensor(id=1, ne=(8,), buffer=h, data=base + 32, name="second")
        loop = make_tensor(id=2, ne=(8,), buffer=h, data=base, src=[1, 3], op=GgmlOp.ADD, flags=16)
        back = make_tensor(id=3, ne=(8,), buffer=h, data=base, src=[2], op=GgmlOp.SQR, flags=16)
        before = len(graph_srv.runs)
        c.graph_compute(0, [2], [a, shadow, loop, back])
        assert c.device_count() == 1
    (node,) = graph_srv.runs[before]
    assert node.src[0].name == "first" and node.src[1].src[0] is node


def test_v6_layout_sent_to_a_v7_server_is_misread_as_upstream_does() -> None:
    # As upstream's 7.0.0 server reads it: the offset's low byte becomes cache_flag and the rest shifts by one byte.
    from ggml_rpc.spec.versions import V6

    with running_server("7") as srv:
        with connect(srv, protocol=V6) as c:
            t, _h, _b = tensor_in(c, 64)
            c.set_tensor(t, 0, b"\x00ABCDEFG")  # first data byte 0: lands one byte short, silently
            got = bytes(c.get_tensor(t, 0, 8))
            assert got == b"ABCDEFG\x00"
        with connect(srv, protocol=V6) as c:
            t, _h, _b = tensor_in(c, 64)
            c.set_tensor(t, 0, b"\x01ABCDEFG")  # non-zero first byte: a huge offset, out of the buffer
            assert c.expect_closed(TIMEOUT)
        assert_served(srv)


def test_v7_layout_sent_to_a_v6_server_closes_instead_of_aborting() -> None:
    # As upstream's 6.0.0 server reads it: one extra leading byte and dies on the "write out of bounds" assertion.
    from ggml_rpc.spec.versions import V7

    with running_server("6") as srv:
        with connect(srv, protocol=V7) as c:
            t, _h, _b = tensor_in(c, 64)
            c.set_tensor(t, 0, b"\x55" * 64)
            assert c.expect_closed(TIMEOUT)
        assert_served(srv)
