"""The generated Lua dissector run by real tshark: it agrees with ``ggml-rpc decode`` message for message.

Every capture (the real upstream ones, the kit's fixtures and a few synthetic sessions written here) goes through
tshark once with the generated dissector.  Each decoded message carries one ``ggml_rpc.pdu`` line
("dir command index length violations"), so the sequences can be compared with the codec's, replies included.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from collections import defaultdict
from pathlib import Path

import dpkt
import numpy as np
import pytest
from ggml_rpc.conformance.sessions.decode import decode_file
from ggml_rpc.spec import (
    V7,
    V7_0_1,
    Command,
    GgmlOp,
    encode_reply,
    encode_request,
    hello_reply,
    make_tensor,
    null_tensor,
)
from ggml_rpc.spec.render.lua_source import generate
from upstream_captures import captures

ROOT = Path(__file__).resolve().parent.parent
FIXTURE_PCAPS = sorted((ROOT / "fixtures").glob("*.pcap*"))

pytestmark = pytest.mark.skipif(shutil.which("tshark") is None, reason="tshark is not installed (.ci/run installs it)")

REAL = [
    # (capture, port for decode-as, or None: found by the HELLO heuristic)
    ("v6-v6-gen-cold.pcap", 50060),
    ("v7-v7-gen-cold.pcap", 50070),
    ("v7-v7-test-backend-ops.pcap", None),
    ("v7client-v6server-hello.pcap", 50062),
]


@pytest.fixture(scope="module")
def lua(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("lua") / "ggml_rpc.lua"
    path.write_text(generate())
    return path


def run_tshark(lua: Path, pcap: Path, *, port: int | None = None, fields: tuple[str, ...] = ("ggml_rpc.pdu",),
               display_filter: str | None = None, options: tuple[str, ...] = ()) -> list[list[str]]:
    """tshark's field output, one list per frame: tcp ports, the requested fields, expert messages."""
    cmd = ["tshark", "-n", "-X", f"lua_script:{lua}", "-o", "tcp.desegment_tcp_streams:TRUE", *options,
           "-r", str(pcap), "-T", "fields", "-E", "separator=/t", "-E", "occurrence=a", "-E", "aggregator=,",
           "-e", "tcp.srcport", "-e", "tcp.dstport"]
    for f in fields:
        cmd += ["-e", f]
    cmd += ["-e", "_ws.expert.message"]
    if port is not None:
        cmd[1:1] = ["-d", f"tcp.port=={port},ggml_rpc"]
    if display_filter:
        cmd += ["-Y", display_filter]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    errors = [line for line in proc.stderr.splitlines() if "Running as user" not in line]
    assert proc.returncode == 0 and not errors, proc.stderr
    rows = [line.split("\t") for line in proc.stdout.splitlines()]
    lua_errors = [r[-1] for r in rows if "Lua Error" in r[-1]]
    assert not lua_errors, lua_errors[:3]
    return rows


def dissected(rows: list[list[str]]) -> dict[int, list[tuple[str, str, str, int, int]]]:
    """client port -> [(dir, command, index, payload length, violations)] in the order tshark found them."""
    out: dict[int, list] = defaultdict(list)
    for row in rows:
        sport, dport, pdus = row[0], row[1], row[2]
        if not pdus:
            continue
        for pdu in pdus.split(","):
            direction, command, index, length, violations = pdu.split(" ")
            client = int(sport if direction == "request" else dport)
            out[client].append((direction, command, index, int(length), int(violations)))
    return out


def expected(pcap: Path, protocol=None) -> dict[int, tuple[list, list, bool]]:
    """client port -> (requests, replies, stopped by a violation) as ``ggml-rpc decode`` sees them."""
    out = {}
    for dc in decode_file(pcap, protocol):
        reqs = [("request", m.command.name, str(m.index), m.size, 0) for m in dc.requests]
        reps = [("reply", m.command.name, str(m.request.index), m.size, 0) for m in dc.replies if m.request]
        out[dc.conn.client[1]] = (reqs, reps, dc.error is not None, dc.error_direction)
    return out


def assert_same_as_decode(pcap: Path, got: dict[int, list], protocol=None) -> None:
    want = expected(pcap, protocol)
    assert set(got) == {k for k, v in want.items() if v[0] or v[1] or v[2]}
    for client, (reqs, reps, stopped, direction) in want.items():
        mine = got.get(client, [])
        my_reqs = [m for m in mine if m[0] == "request"]
        my_reps = [m for m in mine if m[0] == "reply"]
        if not stopped:
            assert my_reqs == reqs, f"client port {client}"
            assert my_reps == reps, f"client port {client}"
            continue
        # decode stops at the first violation; the dissector decodes what precedes it the same way and flags it.
        assert [m[:4] for m in my_reqs[: len(reqs)]] == [m[:4] for m in reqs]
        assert [m[:4] for m in my_reps[: len(reps)]] == [m[:4] for m in reps]
        if direction == "client->server":
            assert my_reqs[len(reqs)][4] > 0, f"message {len(reqs)} should carry a violation: {my_reqs[len(reqs)]}"
        else:
            assert any(m[4] > 0 for m in my_reps[max(0, len(reps) - 1) :]), my_reps


@pytest.mark.parametrize(("pcap", "port"), captures(
    # the fixtures' servers listen on ephemeral ports: found by the HELLO heuristic
    dict.fromkeys(["v6-upstream-tiny-q8_0-cold.pcap", "v7-upstream-tiny-q8_0-cold.pcap",
                   "v8-upstream-tiny-q8_0-cold.pcap", "v7client-v6server-hello.pcap"]), dict(REAL)))
def test_real_capture_matches_decode(lua, pcap, port):
    options = ("-o", "tcp.reassemble_out_of_order:TRUE")
    got = dissected(run_tshark(lua, pcap, port=port, options=options))
    assert_same_as_decode(pcap, got)


def test_reordered_segments_without_out_of_order_reassembly(lua, real_captures):
    """The v6 capture holds reordered bulk segments: sequence numbers keep the bulk count right anyway."""
    pcap = real_captures / "v6-v6-gen-cold.pcap"
    assert_same_as_decode(pcap, dissected(run_tshark(lua, pcap, port=50060)))


def test_whole_message_reassembly_option(tmp_path, real_captures):
    lua = tmp_path / "bulk.lua"
    lua.write_text(generate(reassemble_bulk=True))
    pcap = real_captures / "v7-v7-test-backend-ops.pcap"
    rows = run_tshark(lua, pcap, fields=("ggml_rpc.pdu", "ggml_rpc.continuation"))
    assert_same_as_decode(pcap, dissected(rows))
    assert not any(r[3] for r in rows)  # no continuation pieces: every message is whole


def test_second_pass_renders_what_the_first_pass_found(lua, real_captures):
    pcap = real_captures / "v7-v7-test-backend-ops.pcap"
    rows = run_tshark(lua, pcap, options=("-2",), fields=("ggml_rpc.pdu", "ggml_rpc.response_in"))
    assert_same_as_decode(pcap, dissected(rows))
    # On the second pass every request that got a reply names the frame it came in.
    replies = sum(len(dc.replies) for dc in decode_file(pcap))
    assert sum(len(r[3].split(",")) for r in rows if r[3]) == replies == 316


def test_v7_cache_flag_tensor_name_and_bulk_length(lua, real_captures):
    rows = run_tshark(lua, real_captures / "v7-v7-gen-cold.pcap", port=50070, display_filter="ggml_rpc.cache_flag == 1",
                      fields=("ggml_rpc.tensor.name", "ggml_rpc.data_len", "ggml_rpc.tensor.shape", "ggml_rpc.version"))
    assert len(rows) == 1
    _, _, name, data_len, shape, version, _experts = rows[0]
    assert (name, int(data_len), shape, version) == ("output.weight", 32_768_000, "F32[256,32000,1,1]", "7.0.0")


def test_hello_reply_names_the_version(lua, real_captures):
    rows = run_tshark(lua, real_captures / "v7client-v6server-hello.pcap", port=50062, display_filter="ggml_rpc.major",
                      fields=("ggml_rpc.major", "ggml_rpc.minor", "ggml_rpc.patch", "ggml_rpc.version"))
    assert [r[2:6] for r in rows] == [["6", "0", "0", "6.0.0"]]
    assert "server speaks 6.0.0" in rows[0][6]


@pytest.mark.parametrize("pcap", FIXTURE_PCAPS, ids=[p.name for p in FIXTURE_PCAPS])
def test_fixture_matches_decode(lua, pcap):
    ports = {c.conn.server[1] for c in decode_file(pcap)}
    got: dict[int, list] = {}
    for port in ports:
        got.update(dissected(run_tshark(lua, pcap, port=port, display_filter=f"tcp.port == {port}")))
    assert_same_as_decode(pcap, got)


# ---- synthetic sessions ----------------------------------------------------------------------------------------

CLIENT, SERVER = "127.0.0.1", "127.0.0.1"


class PcapSession:
    """A TCP connection written to a pcap: handshake, then each message cut into segments of at most ``mss``."""

    def __init__(self, path: Path, cport: int, sport: int, mss: int = 1400, handshake: bool = True) -> None:
        self.fh = open(path, "wb")
        self.w = dpkt.pcap.Writer(self.fh, linktype=dpkt.pcap.DLT_EN10MB)
        self.cport, self.sport, self.mss = cport, sport, mss
        self.seq = {True: 1000, False: 5000}
        self.t = 1.0
        if not handshake:
            return
        self._frame(True, b"", dpkt.tcp.TH_SYN, seq=999)
        self._frame(False, b"", dpkt.tcp.TH_SYN | dpkt.tcp.TH_ACK, seq=4999)
        self._frame(True, b"", dpkt.tcp.TH_ACK)

    def _frame(self, from_client: bool, data: bytes, flags: int, seq: int | None = None) -> None:
        sport, dport = (self.cport, self.sport) if from_client else (self.sport, self.cport)
        tcp = dpkt.tcp.TCP(sport=sport, dport=dport, seq=self.seq[from_client] if seq is None else seq,
                           ack=self.seq[not from_client], flags=flags, win=65535, data=data)
        ip = dpkt.ip.IP(src=socket.inet_aton(CLIENT), dst=socket.inet_aton(SERVER), p=dpkt.ip.IP_PROTO_TCP, data=tcp,
                        ttl=64)
        ip.len = len(bytes(ip))
        eth = dpkt.ethernet.Ethernet(src=b"\0" * 6, dst=b"\0" * 6, type=dpkt.ethernet.ETH_TYPE_IP, data=ip)
        self.w.writepkt(bytes(eth), ts=self.t)
        self.t += 0.0001

    def send(self, from_client: bool, data: bytes) -> None:
        for i in range(0, len(data), self.mss):
            piece = data[i : i + self.mss]
            self._frame(from_client, piece, dpkt.tcp.TH_ACK | dpkt.tcp.TH_PUSH)
            self.seq[from_client] += len(piece)

    def close(self) -> None:
        self._frame(True, b"", dpkt.tcp.TH_FIN | dpkt.tcp.TH_ACK)
        self.fh.close()


def _session(path: Path, proto, steps, *, sport: int = 50052, mss: int = 1400) -> Path:
    """Write a session: steps are (command, request fields, data, reply fields or None, reply data)."""
    s = PcapSession(path, 40000, sport, mss)
    for cmd, fields, data, reply, reply_data in steps:
        s.send(True, encode_request(proto, cmd, fields, data))
        if reply is not None or reply_data is not None:
            s.send(False, encode_reply(proto, cmd, reply, reply_data))
    s.close()
    return path


def _graph_fields() -> dict:
    a = make_tensor(id=0x10, ne=(8,), buffer=0xB0, data=0x1000, name="x")
    b = make_tensor(id=0x20, ne=(8,), buffer=0xB0, data=0x1040, op=int(GgmlOp.UNARY), op_params=[10], src=[0x10],
                    flags=16, name="silu(x)")
    return {"device": 0, "nodes": np.array([0x20], dtype="<u8"), "tensors": [a, b]}


def _full_session(proto):
    t = make_tensor(id=0x30, ne=(1024,), buffer=0xB0, data=0x2000, name="w")
    cmd = Command
    steps = [
        (cmd.HELLO, {"conn_caps": b"\0" * 24}, None, hello_reply(proto.version), None),
        (cmd.DEVICE_COUNT, {}, None, {"device_count": 1}, None),
        (cmd.ALLOC_BUFFER, {"device": 0, "size": 65536}, None, {"remote_ptr": 0xB0, "remote_size": 65536}, None),
        (cmd.BUFFER_GET_BASE, {"remote_ptr": 0xB0}, None, {"base_ptr": 0x1000}, None),
        (cmd.SET_TENSOR, {"tensor": t, "offset": 0, "cache_flag": 1}, bytes(range(256)) * 16, None, None),
        (cmd.GET_TENSOR, {"tensor": t, "offset": 0, "size": 4096}, None, None, bytes(4096)),
        (cmd.COPY_TENSOR, {"src": t, "dst": t}, None, {"result": 1}, None),
        (cmd.GRAPH_COMPUTE, _graph_fields(), None, None, None),
        (cmd.GRAPH_RECOMPUTE, {"device": 0}, None, None, None),
        (cmd.MEMSET_TENSOR, {"tensor": t, "offset": 0, "size": 16, "value": 7}, None, None, None),
        (cmd.SET_TENSOR_HASH, {"tensor": t, "offset": 0, "hash": 0x446E2D6404939D1E}, None, {"result": 0}, None),
        (cmd.GET_ALLOC_SIZE, {"device": 0, "tensor": t, "srcs": [null_tensor()] * 10}, None, {"alloc_size": 4096},
         None),
        (cmd.GET_DEVICE_SUPPORTS_OP, {"device": 0, "op": t, "srcs": [null_tensor()] * 10}, None, {"supported": 1},
         None),
        (cmd.FREE_BUFFER, {"remote_ptr": 0xB0}, None, None, None),
    ]
    return steps


def test_every_command_of_7_0_1_in_tiny_segments_on_the_default_port(lua, tmp_path):
    """7-byte segments: every header and field crosses segment borders; port 50052 needs no decode-as."""
    pcap = _session(tmp_path / "all.pcap", V7_0_1, _full_session(V7_0_1), mss=7)
    rows = run_tshark(lua, pcap, fields=("ggml_rpc.pdu", "ggml_rpc.tensor.unary_op", "ggml_rpc.cache_flag",
                                         "ggml_rpc.tensor.flags.compute"))
    got = dissected(rows)
    assert_same_as_decode(pcap, got)
    assert len(got[40000]) == 14 + 9  # 14 requests, 9 of them with a reply
    assert any(r[3] == "10" for r in rows)  # SILU named from op_params[0] of the UNARY node
    assert any(r[4] == "1" for r in rows)
    graph_flags = next(r[5] for r in rows if r[3])  # the GRAPH_COMPUTE frame: x is a leaf, silu(x) is computed
    assert graph_flags.split(",") in (["False", "True"], ["0", "1"])


def test_7_0_1_command_under_a_7_0_0_server_is_a_violation(lua, tmp_path):
    steps = [s for s in _full_session(V7_0_1) if s[0] is not Command.HELLO]
    steps.insert(0, (Command.HELLO, {"conn_caps": b"\0" * 24}, None, hello_reply((7, 0, 0)), None))
    pcap = _session(tmp_path / "v700.pcap", V7_0_1, steps)
    rows = run_tshark(lua, pcap)
    got = dissected(rows)
    assert_same_as_decode(pcap, got)
    bad = [m for m in got[40000] if m[4]]
    assert bad[0][:2] == ("request", "GET_DEVICE_SUPPORTS_OP")
    assert any("does not exist in protocol 7.0.0" in r[-1] for r in rows)


def test_region_past_the_tensor_is_flagged(lua, tmp_path):
    small = make_tensor(id=0x40, ne=(4,), buffer=0xB0, data=0x1000, name="tiny")
    steps = [
        (Command.HELLO, {"conn_caps": b"\0" * 24}, None, hello_reply((7, 0, 0)), None),
        (Command.SET_TENSOR, {"tensor": small, "offset": 8, "cache_flag": 0}, b"\1" * 16, None, None),
    ]
    pcap = _session(tmp_path / "region.pcap", V7, steps)
    rows = run_tshark(lua, pcap)
    assert_same_as_decode(pcap, dissected(rows))
    assert any("runs past the tensor's 16 bytes" in r[-1] for r in rows)


def test_reply_for_an_unknown_port_needs_the_heuristic(lua, tmp_path):
    pcap = _session(tmp_path / "heur.pcap", V7, _full_session(V7)[:4], sport=41234)
    got = dissected(run_tshark(lua, pcap))
    assert_same_as_decode(pcap, got)
    assert [m[1] for m in got[40000]][:2] == ["HELLO", "HELLO"]


def test_a_field_added_to_the_spec_is_decoded_by_tshark(tmp_path):
    """Generate from a modified SET_TENSOR Struct, encode with it, and tshark shows the new field's value."""
    from construct import Int16ul, Struct
    from ggml_rpc.spec import V6, Payload, Shape
    from ggml_rpc.spec.messages import NO_REPLY, SET_TENSOR_V7_REQ
    from ggml_rpc.spec.versions import CommandSpec

    subs = SET_TENSOR_V7_REQ.schema.subcons
    changed = Payload(Shape.HEADER_DATA, Struct(*subs[:2], "priority" / Int16ul * "new", *subs[2:]), "x")
    v7x = V6.derive((7, 0, 0), replace={Command.SET_TENSOR: CommandSpec(Command.SET_TENSOR, changed, NO_REPLY, "x")})
    lua = tmp_path / "changed.lua"
    lua.write_text(generate([V6, v7x]))
    t = make_tensor(id=0x30, ne=(64,), buffer=0xB0, data=0x2000, name="w")
    steps = [
        (Command.HELLO, {"conn_caps": b"\0" * 24}, None, hello_reply((7, 0, 0)), None),
        (Command.SET_TENSOR, {"tensor": t, "cache_flag": 0, "priority": 513, "offset": 0}, b"\7" * 256, None, None),
    ]
    pcap = _session(tmp_path / "changed.pcap", v7x, steps)
    rows = run_tshark(lua, pcap, fields=("ggml_rpc.priority", "ggml_rpc.data_len", "ggml_rpc.offset"),
                      display_filter="ggml_rpc.priority")
    assert [r[2:5] for r in rows] == [["513", "256", "0"]]


def _hello(version=(7, 0, 0)) -> list[tuple[bool, bytes]]:
    return [(True, encode_request(V7, Command.HELLO, {"conn_caps": b"\0" * 24})),
            (False, encode_reply(V7, Command.HELLO, hello_reply(version)))]


def _raw(tmp_path: Path, name: str, events: list[tuple[bool, bytes]]) -> Path:
    s = PcapSession(tmp_path / name, 40000, 50052, mss=1400)
    for from_client, data in events:
        s.send(from_client, data)
    s.close()
    return tmp_path / name


def _req(cmd, fields, data=None, proto=V7) -> tuple[bool, bytes]:
    return True, encode_request(proto, cmd, fields, data)


_T = make_tensor(id=0x40, ne=(4,), buffer=0xB0, data=0x1000, name="tiny")
VIOLATIONS = {
    "region past the tensor": (
        [_req(Command.SET_TENSOR, {"tensor": _T, "offset": 8, "cache_flag": 0}, b"\1" * 16)],
        "runs past the tensor's 16 bytes"),
    "graph with a null node and no tensors": (
        [_req(Command.GRAPH_COMPUTE, {"device": 0, "nodes": np.array([0], dtype="<u8"), "tensors": []})],
        "node id 0"),
    "removed type": (
        [_req(Command.INIT_TENSOR, {"tensor": {**_T, "type": 4}})], "was removed from ggml"),
    "type out of range": (
        [_req(Command.GET_TENSOR, {"tensor": {**_T, "type": 99}, "offset": 0, "size": 4})], "is not a ggml type"),
    "copy that does not fit": (
        [_req(Command.COPY_TENSOR, {"src": make_tensor(id=1, ne=(64,)), "dst": _T})], "copies 256 bytes"),
    "fixed size mismatch": ([(True, bytes([Command.DEVICE_COUNT]) + (4).to_bytes(8, "little") + b"\0" * 4)],
                            "DEVICE_COUNT is always 0 bytes"),
    "second HELLO": ([_req(Command.HELLO, {"conn_caps": b"\0" * 24})], "only once"),
    "NONE sentinel": ([(True, bytes([Command.NONE]) + bytes(8))], "sentinel"),
    "unknown command": ([(True, bytes([200]) + bytes(8))], "does not exist in protocol 7.0.0"),
    "reply of the wrong size": ([_req(Command.DEVICE_COUNT, {}), (False, (8).to_bytes(8, "little") + bytes(8))],
                                "reply size 8, expected 4"),
    "reply nobody waits for": ([(False, (4).to_bytes(8, "little") + bytes(4))], "no request awaits a reply"),
}


@pytest.mark.parametrize("case", sorted(VIOLATIONS))
def test_violations_are_expert_errors_where_decode_stops(lua, tmp_path, case):
    events, message = VIOLATIONS[case]
    pcap = _raw(tmp_path, "v.pcap", _hello() + events)
    rows = run_tshark(lua, pcap)
    assert_same_as_decode(pcap, dissected(rows))
    assert any(message in r[-1] for r in rows), [r[-1] for r in rows]


def test_version_not_covered(lua, tmp_path):
    pcap = _raw(tmp_path, "v9.pcap", [*_hello((9, 0, 0)), _req(Command.DEVICE_COUNT, {})])
    rows = run_tshark(lua, pcap)
    assert_same_as_decode(pcap, dissected(rows))
    assert any("server announces 9.0.0: not covered" in r[-1] for r in rows)


def test_large_graph_is_decoded_across_many_segments(lua, tmp_path):
    """A 2,000-node graph (about 600 KB) arrives in 1,400-byte segments and decodes in full."""
    n = 2000
    tensors = [make_tensor(id=0x1000 + i, ne=(16,), buffer=0xB0, data=0x1000, op=int(GgmlOp.ADD) if i else 0,
                           src=[0x1000 + i - 1] if i else [], name=f"t{i}") for i in range(n)]
    fields = {"device": 0, "nodes": np.arange(0x1001, 0x1000 + n, dtype="<u8"), "tensors": tensors}
    pcap = _raw(tmp_path, "graph.pcap", [*_hello(), _req(Command.GRAPH_COMPUTE, fields)])
    rows = run_tshark(lua, pcap, fields=("ggml_rpc.pdu", "ggml_rpc.n_tensors"))
    assert_same_as_decode(pcap, dissected(rows))
    graph = [r for r in rows if r[3]]
    assert len(graph) == 1 and graph[0][3] == str(n)
    assert graph[0][2] == f"request GRAPH_COMPUTE 1 {12 + 8 * (n - 1) + 296 * n} 0"


def test_forced_version_decodes_a_capture_without_handshake(lua, tmp_path):
    """With the version preference set, a capture that starts after HELLO decodes like ``decode --proto 7``."""
    s = PcapSession(tmp_path / "mid.pcap", 40000, 50052, handshake=False)
    for from_client, data in [_req(Command.DEVICE_COUNT, {}), (False, encode_reply(V7, Command.DEVICE_COUNT,
                                                                                      {"device_count": 2})),
                              _req(Command.SET_TENSOR, {"tensor": _T, "offset": 0, "cache_flag": 1}, b"\2" * 16),
                              _req(Command.GET_ALIGNMENT, {"device": 1}),
                              (False, encode_reply(V7, Command.GET_ALIGNMENT, {"alignment": 64}))]:
        s.send(from_client, data)
    s.close()
    pcap = tmp_path / "mid.pcap"
    got = dissected(run_tshark(lua, pcap, options=("-o", "ggml_rpc.version:7.0.0")))
    assert_same_as_decode(pcap, got, V7)
    assert [m[1] for m in got[40000]] == ["DEVICE_COUNT", "DEVICE_COUNT", "SET_TENSOR", "GET_ALIGNMENT",
                                          "GET_ALIGNMENT"]
    # left on auto, the same capture is a violation (no HELLO), exactly where decode without --proto gives up
    auto = dissected(run_tshark(lua, pcap))
    assert auto[40000][0][:2] == ("request", "DEVICE_COUNT") and auto[40000][0][4] == 1
