"""The kit's reference server as the interop rows start it: a child process whose log is read as it comes."""

from __future__ import annotations

from ggml_rpc.conformance.client import RpcClient
from ggml_rpc.conformance.upstream.runs import reference_server


def test_a_thousand_connections_do_not_fill_the_servers_log_pipe() -> None:
    # Each connection logs two lines; an unread pipe (64 KiB) used to fill after a few hundred and block the
    # server, which is what test-backend-ops (a connection per case) ran into.
    with reference_server(7, None) as address:
        host, port = address.split(":")
        for _ in range(1000):
            with RpcClient.connect(host, int(port), timeout=10) as c:
                assert c.device_count() == 1


def test_a_refusal_compares_with_or_without_the_log_timestamp() -> None:
    """The same client abort, printed through upstream's log thread (timestamped) or at once (not), is one reason;
    the build path, line number and port never count."""
    from ggml_rpc.conformance.upstream.runs import abort_reason

    timed = ("0.00.010.804 /tmp/pip-req-build-x/llama.cpp/ggml/src/ggml-rpc/ggml-rpc.cpp:550: RPC handshake failed "
             "for 127.0.0.1:41234")
    levelled = ("0.00.006.546 E /tmp/pip-req-build-ko22_seq/llama.cpp/ggml/src/ggml-rpc/ggml-rpc.cpp:550: RPC "
                "handshake failed for 127.0.0.1:40001")
    plain = "/build/llama.cpp/ggml/src/ggml-rpc/ggml-rpc.cpp:551: RPC handshake failed for 127.0.0.1:5555"
    assert abort_reason("noise\n" + timed + "\n") == abort_reason(plain) == "RPC handshake failed for SERVER"
    assert abort_reason(levelled) == abort_reason(plain)
    assert abort_reason(plain.replace("handshake", "version")) != abort_reason(plain)
