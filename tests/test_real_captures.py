"""The real upstream captures decode cleanly, re-encode byte for byte and give the totals their README states."""

from __future__ import annotations

from collections import Counter

import pytest
from ggml_rpc.conformance.sessions.decode import decode_file
from ggml_rpc.conformance.sessions.spans import as_buffer
from ggml_rpc.spec import V6, V7, Command, Reply, SpecViolation, encode_reply, encode_request

GEN_TOTALS = {
    "SET_TENSOR": 122, "GET_TENSOR": 17, "GRAPH_RECOMPUTE": 14, "HELLO": 11, "GET_DEVICE_MEMORY": 10,
    "GET_ALLOC_SIZE": 4, "GRAPH_COMPUTE": 3, "FREE_BUFFER": 3, "BUFFER_GET_BASE": 3, "ALLOC_BUFFER": 3,
    "BUFFER_CLEAR": 2, "SET_TENSOR_HASH": 1, "GET_MAX_SIZE": 1, "GET_ALIGNMENT": 1, "DEVICE_COUNT": 1,
}
BACKEND_OPS_TOTALS = {
    "GET_TENSOR": 280, "SET_TENSOR": 112, "GRAPH_COMPUTE": 102, "ALLOC_BUFFER": 15, "BUFFER_GET_BASE": 15,
    "FREE_BUFFER": 15, "HELLO": 2, "DEVICE_COUNT": 1, "GET_ALIGNMENT": 1, "GET_MAX_SIZE": 1, "GET_DEVICE_MEMORY": 1,
}
CASES = [
    ("v7-v7-gen-cold.pcap", "7.0.0", 11, GEN_TOTALS),
    ("v6-v6-gen-cold.pcap", "6.0.0", 11, GEN_TOTALS),
    ("v7-v7-test-backend-ops.pcap", "7.0.0", 2, BACKEND_OPS_TOTALS),
    ("v7client-v6server-hello.pcap", "6.0.0", 1, {"HELLO": 1}),
]


@pytest.mark.parametrize(("name", "version", "n_conns", "totals"), CASES)
def test_capture_decodes_with_readme_totals(real_captures, name, version, n_conns, totals):
    decoded = decode_file(real_captures / name)
    assert len(decoded) == n_conns
    counts: Counter[str] = Counter()
    for dc in decoded:
        assert dc.error is None, f"connection {dc.conn.index}: {dc.error}"
        assert dc.protocol is not None and dc.protocol.label == version
        counts.update(r.command.name for r in dc.requests)
        assert not dc.notes
    assert dict(counts) == totals


@pytest.mark.parametrize(("name", "version", "n_conns", "totals"), CASES)
def test_capture_reencodes_identically(real_captures, name, version, n_conns, totals):
    for dc in decode_file(real_captures / name):
        c2s = bytearray()
        s2c = bytearray()
        for msg in dc.messages():
            if isinstance(msg, Reply):
                s2c += encode_reply(dc.protocol, msg.command, msg.fields, as_buffer(msg.data))
            else:
                c2s += encode_request(dc.protocol, msg.command, msg.fields, as_buffer(msg.data))
        assert bytes(c2s) == bytes(dc.conn.c2s.data)
        assert bytes(s2c) == bytes(dc.conn.s2c.data)


def test_cache_flag_only_after_the_miss(real_captures):
    """The v7 client sets cache_flag on exactly one SET_TENSOR: output.weight, right after its hash miss."""
    flagged = []
    for dc in decode_file(real_captures / "v7-v7-gen-cold.pcap"):
        msgs = list(dc.messages())
        for i, msg in enumerate(msgs):
            if msg.command is Command.SET_TENSOR and not isinstance(msg, Reply) and msg.fields["cache_flag"]:
                flagged.append(msg)
                assert msgs[i - 1].command is Command.SET_TENSOR_HASH and isinstance(msgs[i - 1], Reply)
                assert msgs[i - 1].fields["result"] == 0
    assert len(flagged) == 1
    assert flagged[0].data.nbytes == 32_768_000


def test_v7_capture_forced_to_v6_fails_at_first_set_tensor(real_captures):
    decoded = decode_file(real_captures / "v7-v7-gen-cold.pcap", V6)
    errors = [dc for dc in decoded if dc.error is not None]
    assert errors, "decoding v7 traffic as v6 must fail"
    err = errors[0].error
    assert isinstance(err, SpecViolation)
    assert err.command == "SET_TENSOR"
    assert errors[0].requests[-1].command is not Command.SET_TENSOR  # stopped at the first SET_TENSOR


def test_v6_capture_as_v7_is_detected(real_captures):
    decoded = decode_file(real_captures / "v6-v6-gen-cold.pcap", V7)
    assert any(dc.error is not None and dc.error.command == "SET_TENSOR" for dc in decoded)
