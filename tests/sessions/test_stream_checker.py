"""The proxy's live check finds each rule's violation on the right message, however the bytes are chunked.

The checker frames with the codec's streaming mode (the framer lint's decoders use too), so what is checked here is
the rules it applies as bytes stream through: whole writes, one byte at a time, and bulk data skipped unseen.
"""

from __future__ import annotations

import pytest
from ggml_rpc.conformance.sessions.stream_checker import StreamChecker
from ggml_rpc.spec import V6, V7, Command, encode_reply, encode_request

from .conftest import hash_then_set, hello, weight

DATA = bytes(i % 255 + 1 for i in range(16384))
ZERO_FIRST = b"\0" + DATA[1:]
ALIGNMENT = encode_request(V7, Command.GET_ALIGNMENT, {"device": 0})
FREE = encode_request(V7, Command.FREE_BUFFER, {"remote_ptr": 4096})

SESSIONS = {
    "clean": ([], hello(V7) + hash_then_set(V7, DATA)),
    "flag missing after a miss": (["CACHE-FLAG-MISSING"], hello(V7) + hash_then_set(V7, DATA, flag=0)),
    "flag with another hash": (["CACHE-FLAG-HASH"], hello(V7) + hash_then_set(V7, DATA, hashed=b"other")),
    "flag without a miss": (["CACHE-FLAG-NO-MISS"], [*hello(V7), (True, encode_request(
        V7, Command.SET_TENSOR, {"tensor": weight(DATA), "cache_flag": 1, "offset": 0}, DATA))]),
    "v6 framing on v7": (["FRAMING-OTHER-LAYOUT"], [*hello(V7), (True, encode_request(
        V6, Command.SET_TENSOR, {"tensor": weight(DATA), "offset": 0}, DATA))]),
    "v6 framing on v7, zero first byte": (["FRAMING-SHIFTED"], [*hello(V7), (True, encode_request(
        V6, Command.SET_TENSOR, {"tensor": weight(ZERO_FIRST), "offset": 0}, ZERO_FIRST))]),
    "v7 framing on v6": (["FRAMING-OTHER-LAYOUT"], [*hello(V6), (True, encode_request(
        V7, Command.SET_TENSOR, {"tensor": weight(DATA), "cache_flag": 0, "offset": 0}, DATA))]),
    "reply of the wrong size": (["REPLY-SIZE"], [
        *hello(V7), (True, ALIGNMENT), (False, encode_reply(V7, Command.DEVICE_COUNT, {"device_count": 1}))]),
    "empty reply to FREE_BUFFER": (["NO-REPLY"], [
        *hello(V7), (True, FREE), (False, bytes(8)), (True, ALIGNMENT),
        (False, encode_reply(V7, Command.GET_ALIGNMENT, {"alignment": 32}))]),
}


def _live(writes: list[tuple[bool, bytes]], *, step: int = 0, skip: bool = False
          ) -> list[tuple[str, int | None, str | None]]:
    """Feed the writes (in pieces of ``step`` bytes if set); with ``skip``, bulk bytes the checker does not need
    are passed by skip() as the proxy's splice does."""
    seen = []
    checker = StreamChecker(0, seen.append)
    for from_client, chunk in writes:
        view = memoryview(chunk)
        pos = 0
        while pos < len(view):
            ahead = checker.bulk_ahead(from_client) if skip else 0
            if ahead:
                n = min(ahead, len(view) - pos)
                checker.skip(from_client, n)
            else:
                n = step or len(view) - pos
                piece = view[pos : pos + n]
                (checker.client_bytes if from_client else checker.server_bytes)(piece)
                n = len(piece)
            pos += n
    return [(v.rule, v.index, v.command) for v in seen]


@pytest.mark.parametrize("name", SESSIONS)
def test_each_rule_lands_on_its_message(name):
    rules, writes = SESSIONS[name]
    found = _live(writes)
    assert [rule for rule, _, _ in found] == rules
    assert all(index is not None and command for _, index, command in found)
    assert _live(writes, step=1) == found
    assert _live(writes, step=4000, skip=True) == found


def test_a_graph_too_large_to_check_streams_through():
    """A GRAPH_COMPUTE above the checker's limit is reported once and passed as bulk; the next request is checked."""
    from ggml_rpc.conformance.sessions import stream_checker

    seen = []
    checker = StreamChecker(0, seen.append)
    for from_client, chunk in hello(V7):
        (checker.client_bytes if from_client else checker.server_bytes)(memoryview(chunk))
    size = stream_checker.MAX_CHECKED_PAYLOAD + 1
    header = bytes([int(Command.GRAPH_COMPUTE)]) + size.to_bytes(8, "little")
    checker.client_bytes(memoryview(header))
    assert checker.bulk_ahead(True) == size  # none of it needs looking at
    checker.skip(True, size)
    checker.client_bytes(memoryview(ALIGNMENT))
    checker.server_bytes(memoryview(encode_reply(V7, Command.GET_ALIGNMENT, {"alignment": 32})))
    assert [(v.rule, v.index) for v in seen] == [("DECODE", 1)]
    assert "too large to check" in seen[0].message
    assert checker.requests == 3 and checker.replies == 2
