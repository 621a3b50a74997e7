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
