"""The request generators: valid requests of every command and version are accepted by the reference server's
logic; near-valid ones differ from a valid request by exactly one broken rule; everything derives from the tables."""

from __future__ import annotations

import random
import struct
from types import SimpleNamespace
from typing import Any

import pytest
from ggml_rpc.conformance.fuzz.draws import HypothesisDraw, RandomDraw
from ggml_rpc.conformance.fuzz.machine import build_machine
from ggml_rpc.conformance.fuzz.message import PAD_LIMIT, FuzzMessage
from ggml_rpc.conformance.fuzz.nearvalid import FLAWS, break_one, flaw_sites, near_valid, unknown_commands
from ggml_rpc.conformance.fuzz.oracle import ModelConnection
from ggml_rpc.conformance.fuzz.targets import fuzz_config
from ggml_rpc.conformance.fuzz.valid_requests import (
    BufferRef,
    ConnRef,
    Scope,
    placed_tensor,
    valid_request,
    valid_requests,
)
from ggml_rpc.spec import (
    CONN_CAPS_SIZE,
    PROTOCOLS,
    V6,
    V7,
    V7_0_1,
    Command,
    RpcTensor,
    encode_request,
    make_tensor,
)
from ggml_rpc.spec.messages import DEVICE_REQ, RESULT_REPLY
from ggml_rpc.spec.versions import CommandSpec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

HELLO = {"conn_caps": bytes(CONN_CAPS_SIZE)}


def model_with_tensors(protocol, rng: random.Random) -> tuple[ModelConnection, Scope]:
    """A reference connection after HELLO with one buffer and two tensors of one shape in it, and its scope."""
    m = ModelConnection(fuzz_config(protocol), None)
    assert not m.exchange(encode_request(protocol, Command.HELLO, HELLO)).closed
    out = m.exchange(encode_request(protocol, Command.ALLOC_BUFFER, {"device": 0, "size": 4096}))
    handle, size = struct.unpack_from("<QQ", out.reply, 8)
    out = m.exchange(encode_request(protocol, Command.BUFFER_GET_BASE, {"remote_ptr": handle}))
    (base,) = struct.unpack_from("<Q", out.reply, 8)
    conn = ConnRef(1, 1)
    buf = BufferRef(conn, 1, handle, base, size, 0)
    scope = Scope(protocol, wild=False)
    d = RandomDraw(rng)
    first = placed_tensor(d, scope, buf)
    second = placed_tensor(d, scope, buf, like=first)
    scope.buffers = scope.all_buffers = [buf]
    scope.tensors = scope.all_tensors = [first, second]
    return m, scope


def leaves(value: Any, path: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(leaves(v, f"{path}.{k}" if path else k))
        return out
    if isinstance(value, list):
        out = {}
        for i, v in enumerate(value):
            out.update(leaves(v, f"{path}.{i}"))
        return out
    return {path: value}


@pytest.mark.parametrize("protocol", PROTOCOLS, ids=lambda p: p.label)
def test_valid_requests_are_accepted_by_the_reference(protocol):
    rng = random.Random(7)
    for command in protocol.commands:
        if command in (Command.HELLO, Command.GRAPH_RECOMPUTE):
            continue
        for _ in range(10):
            m, scope = model_with_tensors(protocol, rng)
            msg = valid_request(RandomDraw(rng), scope, command)
            out = m.exchange(msg.encode(protocol)[0])
            if command is Command.GRAPH_COMPUTE:
                # The graph is always well formed; only the executor may decline an op on these types.
                assert not out.closed or "executor" in out.reason, out.reason
            elif command is Command.COMM_ALLREDUCE:
                # Valid only inside a communicator, which the fuzzer never opens (a rank waits for its peer).
                assert out.closed and "no communicator" in out.reason, out.reason
            else:
                assert not out.closed, f"{command.name}: {out.reason}"
            spec = protocol.commands[command]
            assert bool(out.reply) == spec.has_reply
            m.close()


def test_graph_recompute_after_a_graph_is_accepted():
    rng = random.Random(3)
    m, scope = model_with_tensors(V7, rng)
    ops = 0
    for _ in range(20):
        out = m.exchange(valid_request(RandomDraw(rng), scope, Command.GRAPH_COMPUTE).encode(V7)[0])
        if out.closed:
            m, scope = model_with_tensors(V7, rng)
            continue
        ops += 1
        assert not m.exchange(encode_request(V7, Command.GRAPH_RECOMPUTE, {"device": 0})).closed
    assert ops >= 5


@pytest.mark.parametrize("protocol", [V6, V7_0_1], ids=lambda p: p.label)
def test_near_valid_requests_carry_exactly_one_flaw(protocol):
    rng = random.Random(11)
    seen: set[str] = set()
    for command in protocol.commands:
        for _ in range(20):
            _, scope = model_with_tensors(protocol, rng)
            d = RandomDraw(rng)
            msg = valid_request(d, scope, command)
            bad = break_one(d, scope, msg, protocol)
            flaw = bad.broken.split(":", 1)[0]
            assert flaw in FLAWS
            seen.add(flaw)
            diff = {k for k, v in leaves(bad.fields).items() if leaves(msg.fields).get(k) != v}
            wire = [x for x in (bad.size, bad.cut, bad.patch) if x is not None]
            if flaw in ("size", "truncation", "count"):
                assert not diff and len(wire) == 1, bad.broken
            else:
                assert not wire
                # An op made out of range keeps its node computed (the COMPUTE flag may be set along with it).
                assert len(diff - {k for k in diff if k.endswith(".flags") and ".op =" in bad.broken}) == 1, diff
                assert bad.broken.split(" = ")[0].split(": ", 1)[1] in diff
    assert seen == set(FLAWS)


def test_a_broken_tensor_type_is_refused():
    rng = random.Random(5)
    refused = 0
    for command in (Command.SET_TENSOR, Command.GET_TENSOR, Command.MEMSET_TENSOR, Command.INIT_TENSOR,
                    Command.COPY_TENSOR):
        for _ in range(15):
            m, scope = model_with_tensors(V7, rng)
            d = RandomDraw(rng)
            msg = valid_request(d, scope, command)
            bad = break_one(d, scope, msg, V7)
            if not bad.broken.startswith("type: ") or ".type" not in bad.broken:
                continue
            out = m.exchange(bad.encode(V7)[0])
            assert out.closed and "type" in out.reason and not out.reply
            refused += 1
    assert refused >= 5


def test_graph_flaw_sites_cover_every_kind_of_flaw():
    payload = V7.commands[Command.GRAPH_COMPUTE].request
    assert {t.flaw for t in flaw_sites(payload)} == set(FLAWS)
    counted = {t.path for t in flaw_sites(payload) if t.flaw == "count"}
    assert counted == {"n_nodes", "n_tensors"}


def test_count_lie_patches_the_count_field():
    _, scope = model_with_tensors(V7, random.Random(1))
    msg = valid_request(RandomDraw(random.Random(2)), scope, Command.GRAPH_COMPUTE)
    for seed in range(40):
        bad = break_one(RandomDraw(random.Random(seed)), scope, msg, V7)
        if bad.patch is None:
            continue
        wire, _ = bad.encode(V7)
        good, _ = msg.encode(V7)
        changed = [i for i in range(len(good)) if good[i] != wire[i]]
        at = 9 + bad.patch[0]
        assert changed and all(at <= i < at + 4 for i in changed)
        return
    pytest.fail("no count lie drawn")


def test_unknown_command_ids_derive_from_the_table():
    assert unknown_commands(V6) == [18, 19, 20, 255]
    assert unknown_commands(V7) == [18, 19, 20, 255]
    assert unknown_commands(V7_0_1) == [18, 20, 21, 255]


def test_a_command_added_to_a_table_gets_its_flaws_for_free():
    extra = V7.derive((7, 0, 9), add={Command.GET_DEVICE_SUPPORTS_OP: CommandSpec(
        Command.GET_DEVICE_SUPPORTS_OP, DEVICE_REQ, RESULT_REPLY, "a hypothetical device query")})
    plain = build_machine(SimpleNamespace(protocol=V7, devices=1))
    grown = build_machine(SimpleNamespace(protocol=extra, devices=1))
    assert not hasattr(plain, "send_get_device_supports_op")
    assert hasattr(grown, "send_get_device_supports_op")
    for command in V7.commands:
        if command is not Command.HELLO:
            assert hasattr(plain, f"send_{command.name.lower()}")


def test_random_and_hypothesis_draws_build_rpc_tensors():
    t = RandomDraw(random.Random(9)).tensor()
    assert len(RpcTensor.build(t)) == 296

    @settings(max_examples=20, database=None, suppress_health_check=list(HealthCheck), deadline=None)
    @given(st.data())
    def check(data):
        assert len(RpcTensor.build(HypothesisDraw(data.draw).tensor())) == 296

    check()


@settings(max_examples=40, database=None, suppress_health_check=list(HealthCheck), deadline=None)
@given(st.data())
def test_hypothesis_strategies_give_encodable_requests(data):
    _, scope = model_with_tensors(V7_0_1, random.Random(4))
    command = data.draw(st.sampled_from([c for c in V7_0_1.commands if c is not Command.HELLO]))
    msg = data.draw(valid_requests(scope, command))
    bad = data.draw(near_valid(scope, msg, V7_0_1))
    for m in (msg, bad):
        wire, _ = m.encode(V7_0_1)
        assert wire[0] == int(m.command) or m.wire_command is not None or m.cut is not None


def test_size_claims_and_cuts_on_the_wire():
    msg = FuzzMessage(Command.GET_ALIGNMENT, {"device": 0})
    assert msg.encode(V7) == (bytes([1]) + struct.pack("<Q", 4) + bytes(4), False)
    short = FuzzMessage(Command.GET_ALIGNMENT, {"device": 0}, size=2)
    assert short.encode(V7) == (bytes([1]) + struct.pack("<Q", 2) + bytes(2), False)
    padded = FuzzMessage(Command.GET_ALIGNMENT, {"device": 0}, size=4 + PAD_LIMIT)
    wire, end = padded.encode(V7)
    assert len(wire) == 9 + 4 + PAD_LIMIT and not end
    huge = FuzzMessage(Command.GET_ALIGNMENT, {"device": 0}, size=1 << 63)
    wire, end = huge.encode(V7)
    assert len(wire) == 13 and end
    cut = FuzzMessage(Command.GET_ALIGNMENT, {"device": 0}, cut=5)
    assert cut.encode(V7) == (bytes([1]) + struct.pack("<Q", 4)[:4], True)


def test_relocation_changes_only_addresses():
    t = make_tensor(id=3, ne=(4,), buffer=0x10, data=0x1000)
    msg = FuzzMessage(Command.GET_TENSOR, {"tensor": t, "offset": 0, "size": 16})

    def relocate(fields):
        return {**fields, "tensor": {**fields["tensor"], "buffer": 0x20, "data": 0x2000}}

    a, _ = msg.encode(V7)
    b, _ = msg.encode(V7, relocate)
    assert len(a) == len(b)
    assert sum(x != y for x, y in zip(a, b, strict=True)) <= 4
