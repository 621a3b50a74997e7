"""The proxy's live check and lint's offline check find the same violations in the same sessions.

Lint decodes a whole capture; the proxy frames the streams itself so that bulk data passes through unbuffered.
The two framings are separate code, so each rule is checked to land on the same message with the same command.
"""

from __future__ import annotations

import pytest
from ggml_rpc.conformance.sessions.lint import lint_file
from ggml_rpc.conformance.sessions.pcapwrite import write_session
from ggml_rpc.conformance.sessions.stream_checker import StreamChecker
from ggml_rpc.spec import V6, V7, Command, encode_reply, encode_request

from .conftest import hash_then_set, hello, weight

DATA = bytes(i % 255 + 1 for i in range(16384))
ZERO_FIRST = b"\0" + DATA[1:]
ALIGNMENT = encode_request(V7, Command.GET_ALIGNMENT, {"device": 0})
FREE = encode_request(V7, Command.FREE_BUFFER, {"remote_ptr": 4096})

SESSIONS = {
    "clean": ([], hello(V7) + hash_then_set(V7, DATA)),
    "flag missing after a miss": (["CACHE-FLAG"], hello(V7) + hash_then_set(V7, DATA, flag=0)),
    "flag with another hash": (["CACHE-FLAG"], hello(V7) + hash_then_set(V7, DATA, hashed=b"other")),
    "flag without a miss": (["CACHE-FLAG"], [*hello(V7), (True, encode_request(
        V7, Command.SET_TENSOR, {"tensor": weight(DATA), "cache_flag": 1, "offset": 0}, DATA))]),
    "v6 framing on v7": (["FRAMING"], [*hello(V7), (True, encode_request(
        V6, Command.SET_TENSOR, {"tensor": weight(DATA), "offset": 0}, DATA))]),
    "v6 framing on v7, zero first byte": (["FRAMING"], [*hello(V7), (True, encode_request(
        V6, Command.SET_TENSOR, {"tensor": weight(ZERO_FIRST), "offset": 0}, ZERO_FIRST))]),
    "v7 framing on v6": (["FRAMING"], [*hello(V6), (True, encode_request(
        V7, Command.SET_TENSOR, {"tensor": weight(DATA), "cache_flag": 0, "offset": 0}, DATA))]),
    "reply of the wrong size": (["REPLY-SIZE"], [
        *hello(V7), (True, ALIGNMENT), (False, encode_reply(V7, Command.DEVICE_COUNT, {"device_count": 1}))]),
    "empty reply to FREE_BUFFER": (["NO-REPLY"], [
        *hello(V7), (True, FREE), (False, bytes(8)), (True, ALIGNMENT),
        (False, encode_reply(V7, Command.GET_ALIGNMENT, {"alignment": 32}))]),
}


def _live(writes: list[tuple[bool, bytes]]) -> list[tuple[str, int | None, str | None]]:
    seen = []
    checker = StreamChecker(0, seen.append)
    for from_client, chunk in writes:
        (checker.client_bytes if from_client else checker.server_bytes)(memoryview(chunk))
    return [(v.rule, v.index, v.command) for v in seen]


@pytest.mark.parametrize("name", SESSIONS)
def test_live_and_offline_checks_agree(tmp_path, name):
    rules, writes = SESSIONS[name]
    path = tmp_path / "s.pcap"
    write_session(path, [writes])
    offline = [(v.rule, v.index, v.command) for v in lint_file(path)]
    assert [rule for rule, _, _ in offline] == rules
    assert _live(writes) == offline
