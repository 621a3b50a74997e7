"""lint: real captures are clean; each rule fires on a session built to break it."""

from __future__ import annotations

import pytest
from ggml_rpc.conformance.cli import main
from ggml_rpc.conformance.sessions.lint import lint_file
from ggml_rpc.conformance.sessions.pcapwrite import write_session
from ggml_rpc.spec import V6, V7, Command, encode_reply, encode_request
from upstream_captures import captures

from .conftest import hash_then_set, hello, weight

DATA = bytes(i % 255 + 1 for i in range(16384))  # 16 KiB, first byte non-zero


def _lint(tmp_path, writes):
    path = tmp_path / "s.pcap"
    write_session(path, [writes])
    return lint_file(path)


CLEAN = ["v6-upstream-tiny-q8_0-cold.pcap", "v7-upstream-tiny-q8_0-cold.pcap", "v8-upstream-tiny-q8_0-cold.pcap",
         "v8-upstream-tiny-q8_0-split-tensor.pcap", "v7client-v6server-hello.pcap"]
SHARED = ["v7-v7-gen-cold.pcap", "v6-v6-gen-cold.pcap", "v7-v7-test-backend-ops.pcap", "v7client-v6server-hello.pcap"]


@pytest.mark.parametrize(("path", "_"), captures(dict.fromkeys(CLEAN), dict.fromkeys(SHARED)))
def test_real_captures_lint_clean(path, _, capsys):
    assert lint_file(path) == []
    assert main(["lint", str(path)]) == 0
    assert "0 violation(s)" in capsys.readouterr().out


def test_flag_after_matching_miss_is_clean(tmp_path):
    assert _lint(tmp_path, hello(V7) + hash_then_set(V7, DATA)) == []


def test_flag_without_miss_is_flagged(tmp_path):
    t = weight(DATA)
    writes = [
        *hello(V7),
        (True, encode_request(V7, Command.SET_TENSOR, {"tensor": t, "cache_flag": 1, "offset": 0}, DATA)),
    ]
    (v,) = _lint(tmp_path, writes)
    assert v.rule == "CACHE-FLAG-NO-MISS" and v.index == 1 and "without a SET_TENSOR_HASH miss" in v.message


def test_flag_with_a_hash_that_does_not_match_the_data_is_flagged(tmp_path):
    (v,) = _lint(tmp_path, hello(V7) + hash_then_set(V7, DATA, hashed=b"other bytes"))
    assert v.rule == "CACHE-FLAG-HASH" and "data hashes to" in v.message


def test_missing_flag_after_miss_is_flagged(tmp_path):
    (v,) = _lint(tmp_path, hello(V7) + hash_then_set(V7, DATA, flag=0))
    assert v.rule == "CACHE-FLAG-MISSING" and "carries no cache_flag" in v.message


def test_v6_framing_on_a_v7_connection(tmp_path):
    t = weight(DATA)
    v6_set = encode_request(V6, Command.SET_TENSOR, {"tensor": t, "offset": 0}, DATA)
    (v,) = _lint(tmp_path, [*hello(V7), (True, v6_set)])
    assert v.rule == "FRAMING-OTHER-LAYOUT" and "6.0.0" in v.message


def test_v6_framing_on_a_v7_connection_with_a_zero_first_byte(tmp_path):
    """The silent case: read as v7 the write lands one byte short; lint still names the framing."""
    data = b"\0" + DATA[1:]
    v6_set = encode_request(V6, Command.SET_TENSOR, {"tensor": weight(data), "offset": 0}, data)
    (v,) = _lint(tmp_path, [*hello(V7), (True, v6_set)])
    assert v.rule == "FRAMING-SHIFTED" and "probably 6.0.0" in v.message


def test_v7_framing_on_a_v6_connection(tmp_path):
    t = weight(DATA)
    v7_set = encode_request(V7, Command.SET_TENSOR, {"tensor": t, "cache_flag": 0, "offset": 0}, DATA)
    (v,) = _lint(tmp_path, [*hello(V6), (True, v7_set)])
    assert v.rule == "FRAMING-OTHER-LAYOUT" and "7.0.0" in v.message


def test_reply_of_the_wrong_size(tmp_path):
    writes = [
        *hello(V7),
        (True, encode_request(V7, Command.GET_ALIGNMENT, {"device": 0})),
        (False, encode_reply(V7, Command.DEVICE_COUNT, {"device_count": 1})),
    ]
    (v,) = _lint(tmp_path, writes)
    assert v.rule == "REPLY-SIZE" and v.command == "GET_ALIGNMENT" and "expected 8" in v.message


def test_empty_reply_to_a_no_reply_command(tmp_path):
    writes = [
        *hello(V7),
        (True, encode_request(V7, Command.FREE_BUFFER, {"remote_ptr": 4096})),
        (False, bytes(8)),
        (True, encode_request(V7, Command.GET_ALIGNMENT, {"device": 0})),
        (False, encode_reply(V7, Command.GET_ALIGNMENT, {"alignment": 32})),
    ]
    (v,) = _lint(tmp_path, writes)
    assert v.rule == "NO-REPLY" and v.command == "FREE_BUFFER"


def test_trailing_reply_after_no_reply_command(tmp_path):
    writes = [*hello(V7), (True, encode_request(V7, Command.FREE_BUFFER, {"remote_ptr": 4096})), (False, bytes(8))]
    (v,) = _lint(tmp_path, writes)
    assert v.rule == "NO-REPLY"


def test_cli_exit_code_and_json(tmp_path, capsys):
    path = tmp_path / "bad.pcap"
    t = weight(DATA)
    write_session(
        path,
        [
            [
                *hello(V7),
                (True, encode_request(V7, Command.SET_TENSOR, {"tensor": t, "cache_flag": 1, "offset": 0}, DATA)),
            ]
        ],
    )
    assert main(["lint", "--json", "-", str(path)]) == 1
    out = capsys.readouterr().out
    assert '"rule": "CACHE-FLAG-NO-MISS"' in out
    assert main(["lint", str(tmp_path / "missing.pcap")]) == 2
