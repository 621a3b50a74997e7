"""SIGTERM stops a command the way Ctrl-C does: proxies finish their pcap, spawned servers are stopped."""

from __future__ import annotations

import signal
import subprocess
import sys

from ggml_rpc.conformance.client import RpcClient
from ggml_rpc.conformance.sessions.decode import decode_file
from ggml_rpc.reference import running_server
from ggml_rpc.spec import make_tensor

CLI = [sys.executable, "-m", "ggml_rpc.conformance.cli"]


def test_sigterm_stops_the_proxy_with_its_pcap_complete(tmp_path):
    pcap = tmp_path / "terminated.pcap"
    data = bytes(range(256)) * 4096  # 1 MiB: more than any write buffer, so a lost tail would show
    with running_server("7") as srv:
        proc = subprocess.Popen([*CLI, "proxy", "--listen", "127.0.0.1:0", "--upstream", f"{srv.host}:{srv.port}",
                                 "--pcap", str(pcap)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            banner = proc.stdout.readline()  # "ggml-rpc proxy: HOST:PORT -> ..."
            host, port = banner.split()[2].rsplit(":", 1)
            with RpcClient.connect(host, int(port)) as c:
                handle, _ = c.alloc_buffer(0, len(data))
                t = make_tensor(id=1, type=24, ne=(len(data),), buffer=handle, data=c.buffer_get_base(handle))
                c.set_tensor(t, 0, data)
                assert bytes(c.get_tensor(t, 0, len(data))) == data
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=30)
        finally:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert "1 connection(s)" in out
    (dc,) = decode_file(pcap)
    assert dc.error is None
    assert bytes(dc.replies[-1].data) == data
