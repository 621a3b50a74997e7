"""The servers' link of 8.0.0 (tensor split) is decoded from the client connections that opened it."""

from __future__ import annotations

from ggml_rpc.conformance.cli import main
from ggml_rpc.conformance.sessions.decode import decode_file
from ggml_rpc.conformance.sessions.lint import lint_file
from ggml_rpc.conformance.sessions.pcapwrite import PcapWriter
from ggml_rpc.spec import V8, Command, encode_reply, encode_request, hello_reply, make_tensor
from ggml_rpc.spec.facts import CONN_CAPS_SIZE

PORT = 50052


def _write(path, *, link_bytes: int | None = None, dropped_first: bool = False) -> None:
    small = make_tensor(id=1, ne=(256, 3), buffer=0x10, data=0x1000)  # 3 KiB of F32: sent as is
    large = make_tensor(id=2, ne=(32768,), buffer=0x10, data=0x1000)  # 32,768 F32: sent as BF16
    init = {"device": 0, "rank": 0, "world": 2, "port": PORT + 1000, "host": bytes(64)}
    client = [
        (True, encode_request(V8, Command.HELLO, {"conn_caps": bytes(CONN_CAPS_SIZE)})),
        (False, encode_reply(V8, Command.HELLO, hello_reply(V8.version))),
        (True, encode_request(V8, Command.COMM_INIT, init)),
        (False, encode_reply(V8, Command.COMM_INIT, {"ok": 1})),
        (True, encode_request(V8, Command.COMM_ALLREDUCE, {"device": 0, "tensor": small})),
        (True, encode_request(V8, Command.COMM_ALLREDUCE, {"device": 0, "tensor": large})),
        (True, encode_request(V8, Command.COMM_FREE, {"device": 0})),
    ]
    n = CONN_CAPS_SIZE + 3072 + 65536 if link_bytes is None else link_bytes
    with PcapWriter(path) as w:
        flow = w.flow(server=("127.0.0.1", PORT))
        flow.open()
        for from_client, data in client:
            flow.write(from_client, data)
        if dropped_first:
            # The rank-1 server's first connect to the port, closed before a byte went either way (as genuine
            # 8.0.0 peers do); the next one carries the link.
            dropped = w.flow(server=("127.0.0.1", PORT + 1000))
            dropped.open()
            dropped.close()
        link = w.flow(server=("127.0.0.1", PORT + 1000))
        link.open()
        link.write(True, bytes(n))
        link.write(False, bytes(n))
        link.close()
        flow.close()


def test_the_link_is_read_exchange_by_exchange(tmp_path) -> None:
    pcap = tmp_path / "split.pcap"
    _write(pcap)
    decoded = decode_file(pcap)
    assert [dc.ok for dc in decoded] == [True, True]
    link = decoded[1].link
    assert link is not None and link.port == PORT + 1000 and link.init == (0, 1)
    assert [(x.wire_type, x.nbytes) for x in link.exchanges] == [("F32", 3072), ("BF16", 65536)]
    assert lint_file(pcap) == []


def test_a_link_whose_bytes_do_not_add_up_is_a_violation(tmp_path) -> None:
    pcap = tmp_path / "short.pcap"
    _write(pcap, link_bytes=CONN_CAPS_SIZE + 3072 + 4096)
    violations = lint_file(pcap)
    assert len(violations) == 1 and violations[0].connection == 1
    assert "make 68632" in violations[0].message


def test_a_connect_to_the_link_port_dropped_before_the_link_is_no_violation(tmp_path, capsys) -> None:
    pcap = tmp_path / "split-dropped.pcap"
    _write(pcap, dropped_first=True)
    decoded = decode_file(pcap)
    assert [dc.ok for dc in decoded] == [True, True, True]
    dropped, link = decoded[1].link, decoded[2].link
    assert dropped is not None and dropped.unused and not dropped.exchanges
    assert link is not None and not link.unused and [x.nbytes for x in link.exchanges] == [3072, 65536]
    assert lint_file(pcap) == []
    assert main(["decode", str(pcap)]) == 0 and main(["lint", str(pcap)]) == 0
    out = capsys.readouterr().out
    assert "carried no bytes: a connect dropped before the link's" in out and "LINK-BYTES" not in out
