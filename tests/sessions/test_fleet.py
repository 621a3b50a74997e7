"""A fleet (a model split over servers): one proxy fronts both, one recording holds both servers' connections,
and the recording replays each server's connections against its own target, all at once (COMM_INIT readdressed)."""

from __future__ import annotations

import threading

import numpy as np
from ggml_rpc.conformance.cli import main
from ggml_rpc.conformance.client import RpcClient
from ggml_rpc.conformance.harness import free_port
from ggml_rpc.conformance.sessions.decode import decode_file
from ggml_rpc.conformance.sessions.fleet import recorded_servers, replay_fleet
from ggml_rpc.conformance.sessions.lint import lint_file
from ggml_rpc.conformance.sessions.proxy import running_proxy
from ggml_rpc.conformance.sessions.replay import load_captures
from ggml_rpc.reference import running_server
from ggml_rpc.spec import make_tensor

N = 40000  # F32 elements: BF16 on the servers' link


def _split_session(addresses: list[tuple[str, int]]) -> list[np.ndarray]:
    """What a tensor-split client does, in small: each rank holds a partial sum, COMM_ALLREDUCE adds them."""
    clients = [RpcClient.connect(h, p, timeout=20) for h, p in addresses]
    port = addresses[0][1] + 1000  # upstream's clients choose rank 0's RPC port + 1000
    tensors = []
    for i, c in enumerate(clients):
        handle, _ = c.alloc_buffer(0, 4 * N)
        t = make_tensor(id=1, ne=(N,), buffer=handle, data=c.buffer_get_base(handle), name="partial")
        c.set_tensor(t, 0, np.full(N, i + 1.5, np.float32).tobytes())
        tensors.append(t)
    ok = [False, False]

    def join(rank: int) -> None:
        ok[rank] = clients[rank].comm_init(0, rank, 2, port, "127.0.0.1")

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert ok == [True, True]
    for c, t in zip(clients, tensors, strict=True):
        c.comm_allreduce(0, t)
    sums = [np.frombuffer(bytes(c.get_tensor(t, 0, 4 * N)), np.float32) for c, t in zip(clients, tensors,
                                                                                        strict=True)]
    for c in clients:
        c.comm_free(0)
        c.close()
    return sums


def test_one_proxy_records_a_fleet_and_the_recording_replays_as_one(tmp_path) -> None:
    pcap = tmp_path / "fleet.pcap"
    with running_server("8") as a, running_server("8") as b:
        with running_proxy([(a.host, a.port), (b.host, b.port)], pcap=pcap, check=True) as proxy:
            sums = _split_session(proxy.addresses)
        assert proxy.stats.violations == [] and proxy.stats.connections == 2
    assert sums[0].tolist() == sums[1].tolist() == [4.0] * N  # 1.5 + 2.5, exact in BF16
    assert len(recorded_servers(load_captures([pcap]))) == 2
    assert [dc.ok for dc in decode_file(pcap)] == [True, True] and lint_file(pcap) == []
    with running_server("8") as a, running_server("8") as b:
        report = replay_fleet(load_captures([pcap]), [(a.host, a.port), (b.host, b.port)], free_port=free_port,
                              timeout=30)
    assert report.ok and report.connections == 2 and report.compared["exact"] >= 2, report
    assert main(["replay", str(pcap)]) == 0  # two embedded reference servers, one per recorded server


def test_a_fleet_needs_one_target_per_server(tmp_path, capsys) -> None:
    pcap = tmp_path / "fleet.pcap"
    with running_server("8") as a, running_server("8") as b:
        with running_proxy([(a.host, a.port), (b.host, b.port)], pcap=pcap) as proxy:
            _split_session(proxy.addresses)
        three = [f"{a.host}:{a.port}", f"{b.host}:{b.port}", f"{a.host}:{a.port}"]
        assert main(["replay", str(pcap), *[x for t in three for x in ("--server", t)]]) == 2
    assert "connections to 2 server(s)" in capsys.readouterr().err
